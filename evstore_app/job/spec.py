"""The job's feature spec: which columns are sparse fields (and their EV
settings), which are dense features, what the label is, the model head.

JSON (a file or a dict):
  {"data": {"format": "csv"|"parquet", "timestamp": "timestamp",
            "join": [{"file": "movies.csv", "on": "movieId", "columns": ["genres"]}]},
   "label": {"column": "rating", "threshold": 4.0},     # label = column >= threshold (omit: column is 0/1)
   "sparse": [{"name": "user", "column": "userId", "dim": 16,
               "filter": {"counter": 2} | {"bloom": 2, "capacity": 1e6, "fp_rate": 0.01},
               "evict": {"global_step": 5000} | {"l2": 1e-4}}],
   "dense": ["hour"],
   "hidden": [64, 32], "batch_size": 512,
   "optimizer": {"name": "adam"|"adagrad"|"sgd"|"ftrl"|..., "learning_rate": 0.005}}
String columns are hashed to int64 ids (FarmHash, stable across runs).
"""
import json
import os

__all__ = ["load_spec", "SpecError"]


class SpecError(ValueError):
    """The spec is malformed; the message names the field."""


def _req(d, key, where, types):
    if key not in d:
        raise SpecError(f"spec: {where} needs '{key}'")
    if not isinstance(d[key], types):
        raise SpecError(f"spec: {where}.{key} must be {types}, got {d[key]!r}")
    return d[key]


def load_spec(spec):
    """A validated spec dict from a dict or a JSON file path."""
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
    spec = dict(spec)
    label = _req(spec, "label", "spec", dict)
    _req(label, "column", "label", str)
    if "threshold" in label and not isinstance(label["threshold"], (int, float)):
        raise SpecError("spec: label.threshold must be a number")
    sparse = _req(spec, "sparse", "spec", list)
    if not sparse:
        raise SpecError("spec: 'sparse' must name at least one field")
    names = set()
    for i, f in enumerate(sparse):
        where = f"sparse[{i}]"
        if not isinstance(f, dict):
            raise SpecError(f"spec: {where} must be an object")
        name = _req(f, "name", where, str)
        _req(f, "column", where, str)
        dim = _req(f, "dim", where, int)
        if dim < 1 or isinstance(dim, bool):
            raise SpecError(f"spec: {where}.dim must be a positive int")
        if name in names:
            raise SpecError(f"spec: two sparse fields are named {name!r}")
        names.add(name)
        flt = f.get("filter")
        if flt is not None and not (isinstance(flt, dict) and (set(flt) <= {"counter"} or
                                                              set(flt) <= {"bloom", "capacity", "fp_rate"})):
            raise SpecError(f"spec: {where}.filter must be {{'counter': n}} or {{'bloom': n, 'capacity': c, "
                            f"'fp_rate': p}}, got {flt!r}")
        ev = f.get("evict")
        if ev is not None and not (isinstance(ev, dict) and set(ev) <= {"global_step", "l2"} and ev):
            raise SpecError(f"spec: {where}.evict must be {{'global_step': n}} and/or {{'l2': t}}, got {ev!r}")
    dense = spec.setdefault("dense", [])
    if not isinstance(dense, list) or not all(isinstance(c, str) for c in dense):
        raise SpecError("spec: 'dense' must be a list of column names")
    hidden = spec.setdefault("hidden", [64, 32])
    if not isinstance(hidden, list) or not all(isinstance(h, int) and h > 0 for h in hidden):
        raise SpecError("spec: 'hidden' must be a list of positive ints")
    bs = spec.setdefault("batch_size", 512)
    if not isinstance(bs, int) or bs < 1:
        raise SpecError("spec: 'batch_size' must be a positive int")
    opt = spec.setdefault("optimizer", {"name": "adam", "learning_rate": 0.005})
    if not isinstance(opt, dict) or not isinstance(opt.get("name"), str):
        raise SpecError("spec: 'optimizer' must be {'name': ..., 'learning_rate': ...}")
    spec.setdefault("data", {})
    return spec
