"""The job's feature spec: which columns are sparse fields (and their EV
settings), which are dense features, what the label is, the model head.

JSON (a file or a dict):
  {"data": {"format": "csv"|"parquet", "timestamp": "timestamp",
            "join": [{"file": "movies.csv", "on": "movieId", "columns": ["genres"]}]},
   "label": {"column": "rating", "threshold": 4.0},     # label = column >= threshold (omit: column is 0/1)
   "sparse": [{"name": "user", "column": "userId", "dim": 16,
               "keys": "int64" | "string" | "hash",                # default "int64"
               "split": "|", "max_ids": 8,                         # string keys: a list of ids per row
               "filter": {"counter": 2} | {"bloom": 2, "capacity": 1e6, "fp_rate": 0.01},
               "evict": {"global_step": 5000} | {"l2": 1e-4}}],
   "dense": ["hour"],
   "hidden": [64, 32], "batch_size": 512,
   "optimizer": {"name": "adam"|"adagrad"|"sgd"|"ftrl"|..., "learning_rate": 0.005}}
Keys of a sparse field ("keys"):
  "int64"   the column's integers as they are (the default; a column of strings is refused);
  "string"  the column's values as string keys, no hashing (integers as their decimal text);
            with "split": SEP, each row is a list of ids (the value split at SEP, empty pieces
            dropped, at most "max_ids" (default 8) kept), combined by their mean;
  "hash"    the column's text hashed to int64 ids, tf.strings.to_hash_bucket_fast(s, 2**62)
            (FarmHash, stable across runs): fixed-width keys for those who want them.
"""
import difflib
import json
import os

import jsonschema

__all__ = ["load_spec", "SpecError", "SCHEMA", "KEY_KINDS"]


class SpecError(ValueError):
    """The spec is malformed; the message names the field."""


KEY_KINDS = ("int64", "string", "hash")
MAX_IDS = 8   # default "max_ids" of a split field
_POS_INT = {"type": "integer", "minimum": 1, "x-message": "must be a positive int"}
_NAME = {"type": "string", "minLength": 1, "x-message": "must be a non-empty string"}
_COLUMNS = {"type": "array", "items": _NAME, "x-message": "must be a list of column names"}

# The spec as a JSON Schema (draft 2020-12): types, ranges, and no unknown keys
# anywhere but in the optimizer's keyword arguments. "x-message" is the
# wording of our error for that node (jsonschema ignores unknown keywords).
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["label", "sparse"],
    "properties": {
        "data": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "format": {"enum": ["csv", "parquet"], "x-message": "must be 'csv' or 'parquet'"},
                "timestamp": _NAME,
                "join": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["file", "on", "columns"],
                    "properties": {"file": _NAME, "on": _NAME, "columns": _COLUMNS}}},
            },
        },
        "label": {
            "type": "object", "additionalProperties": False, "required": ["column"],
            "properties": {"column": _NAME, "threshold": {"type": "number", "x-message": "must be a number"}},
        },
        "sparse": {
            "type": "array", "minItems": 1, "x-message": "must list at least one sparse field",
            "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "column", "dim"],
                "properties": {
                    "name": _NAME, "column": _NAME, "dim": _POS_INT,
                    "keys": {"enum": list(KEY_KINDS), "x-message": f"must be one of {list(KEY_KINDS)}"},
                    "split": _NAME, "max_ids": _POS_INT,
                    "filter": {
                        "x-message": "must be {'counter': n} or {'bloom': n, 'capacity': c, 'fp_rate': p}",
                        "oneOf": [
                            {"type": "object", "additionalProperties": False, "required": ["counter"],
                             "properties": {"counter": _POS_INT}},
                            {"type": "object", "additionalProperties": False, "required": ["bloom"],
                             "properties": {"bloom": _POS_INT, "capacity": {"type": "number", "exclusiveMinimum": 0},
                                            "fp_rate": {"type": "number", "exclusiveMinimum": 0,
                                                        "exclusiveMaximum": 1}}},
                        ]},
                    "evict": {
                        "type": "object", "additionalProperties": False, "minProperties": 1,
                        "x-message": "must be {'global_step': n} and/or {'l2': t}",
                        "properties": {"global_step": _POS_INT,
                                       "l2": {"type": "number", "minimum": 0, "x-message": "must be a number >= 0"}}},
                },
            },
        },
        "dense": _COLUMNS,
        "hidden": {"type": "array", "items": _POS_INT, "x-message": "must be a list of positive ints"},
        "batch_size": _POS_INT,
        "optimizer": {
            "type": "object", "required": ["name"],
            "x-message": "must be {'name': ..., 'learning_rate': ..., other arguments of the optimizer}",
            "properties": {"name": _NAME, "learning_rate": {"type": "number", "exclusiveMinimum": 0,
                                                            "x-message": "must be a number > 0"}},
        },
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _where(path):
    """'spec: sparse[0].dim' for the path ['sparse', 0, 'dim'], 'spec' for the root."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return f"spec: {out[1:]}" if out else "spec"


def _message(error):
    """One line naming the field, for a jsonschema ValidationError."""
    where = _where(list(error.absolute_path))
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, allowed, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"{where} has unknown key(s) {', '.join(hints)}; allowed: {', '.join(allowed)}"
    if error.validator == "required":
        return f"{where} needs {error.message.split(' is a required')[0]}"
    custom = error.schema.get("x-message")
    if custom:
        return f"{where} {custom}, got {error.instance!r}"
    return f"{where}: {error.message}"


def _first_error(spec):
    errors = sorted(_VALIDATOR.iter_errors(spec), key=lambda e: (len(e.absolute_path), list(map(str, e.path))))
    if not errors:
        return None
    # Unknown keys first (typos are the common mistake), then the shallowest.
    unknown = [e for e in errors if e.validator == "additionalProperties"]
    return (unknown or [jsonschema.exceptions.best_match(errors)])[0]


def load_spec(spec):
    """A validated spec dict (defaults filled in) from a dict or a JSON file path.

    Raises:
      SpecError: the file is missing or not JSON, or the spec breaks SCHEMA
        (unknown keys, wrong types, out of range) or names two sparse fields
        alike; one line naming the field.
    """
    if isinstance(spec, (str, os.PathLike)):
        try:
            with open(spec) as f:
                spec = json.load(f)
        except FileNotFoundError:
            raise SpecError(f"spec file {spec} does not exist") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"spec file {spec} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise SpecError("spec must be a JSON object")
    error = _first_error(spec)
    if error is not None:
        raise SpecError(_message(error))
    names = [f["name"] for f in spec["sparse"]]
    for name in names:
        if names.count(name) > 1:
            raise SpecError(f"spec: two sparse fields are named {name!r}")
    for i, f in enumerate(spec["sparse"]):
        if ("split" in f or "max_ids" in f) and f.get("keys") != "string":
            raise SpecError(f"spec: sparse[{i}] has {'split' if 'split' in f else 'max_ids'} but keys "
                            f"{f.get('keys', 'int64')!r}: a list of ids per row needs \"keys\": \"string\"")
        if "max_ids" in f and "split" not in f:
            raise SpecError(f"spec: sparse[{i}].max_ids needs split (the separator of the ids)")
    spec = dict(spec)
    spec["sparse"] = [{"keys": "int64", **f, **({"max_ids": f.get("max_ids", MAX_IDS)} if "split" in f else {})}
                      for f in spec["sparse"]]
    spec.setdefault("dense", [])
    spec.setdefault("hidden", [64, 32])
    spec.setdefault("batch_size", 512)
    spec.setdefault("optimizer", {"name": "adam", "learning_rate": 0.005})
    spec.setdefault("data", {})
    return spec
