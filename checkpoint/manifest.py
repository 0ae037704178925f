"""MANIFEST.json: what makes a checkpoint directory exist.

A checkpoint directory (`full-0000000007/`, `delta-0000000008/`) holds a tensor
bundle (`ckpt.index`, `ckpt.data-*`) and, written last, `MANIFEST.json`:

    {"format": "evstore-checkpoint", "version": 1,
     "seq": 8, "kind": "delta", "parent": 7, "base": 7,
     "global_step": 1200, "wall_time": 1795317834.07,
     "files": {"ckpt.index": {"size": 362, "crc32c": 2924530611}, ...},
     "evs": {"user": {"dim": 16, "key_dtype": "int64", "slots": ["m", "v"],
                      "rows": 1000, "filtered": 20, "deleted": 3}},
     "dense": {"dense/kernel": {"dtype": "float32", "shape": [16, 1]}},
     "metadata": {...caller's, e.g. the input position...},
     "quality": {"auc": 0.74, "logloss": 0.52, "examples": 40960, "label_rate": 0.31}}

Optional: `"serving_view": {"dtype": "bfloat16"}` when the commit also holds
a lower-precision serving view (checkpoint/serving_view.py); absent otherwise.

Optional: `"deleted_complete": true` when each EV's deleted keys list every
key erased since the parent, also those re-inserted since (evstore/native/core/
table.h, "Dirty / deleted tracking"). A serving replica then erases only the
deleted keys and never reads the counted-not-admitted keys; without it (commits
of writers before it, synchronous jobs' merged bundles included) it reads them
too, since a key evicted and seen again within one delta is only among those.

`parent` is the checkpoint this one follows (None for a full), `base` the full
that starts its chain (a full's base is itself). Checksums are crc32c
(Castagnoli, unmasked) of whole files. `quality` (optional: absent when the
trainer gave none) is the progressive-validation quality of the data trained
since the previous commit, as evstore.quality defines it.

The manifest protects itself: `"checksum": "sha256:<hex>"` is the SHA-256 of
the manifest's canonical JSON without that field (keys sorted, no spaces,
ASCII). A reader parses the JSON, validates it against SCHEMA (jsonschema:
every field present with its type, no unknown field), then checks the
checksum; any failure is a CorruptCheckpointError naming the file and the
field. Manifests written before the checksum existed (same format version 1)
have no "checksum" field and are read as before.

The checksum is also the checkpoint's content identity (`Manifest.checksum`):
a delta names its parent by sequence number and by the parent's checksum
(`"parent_checksum"`), so the chain is a hash chain, and a reader that
applied a checkpoint can tell whether the checkpoint it holds is still the
committed one (a withdrawn commit: see checkpoint/commit.py).
"""
import dataclasses
import hashlib
import json
import re

import jsonschema

from checkpoint.errors import CorruptCheckpointError
from evstore import quality as _quality

__all__ = ["Manifest", "MANIFEST", "BUNDLE_PREFIX", "dir_name", "parse_dir_name"]

MANIFEST = "MANIFEST.json"
BUNDLE_PREFIX = "ckpt"
FORMAT = "evstore-checkpoint"
VERSION = 1
_DIR_RE = re.compile(r"^(full|delta)-(\d{10})$")


_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_SEQ = {"type": "integer", "minimum": 1}
_CHECKSUM = {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format", "version", "seq", "kind", "parent", "base", "global_step", "wall_time", "files", "evs",
                 "dense"],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT},
        "version": {"const": VERSION},
        "checksum": _CHECKSUM,
        "parent_checksum": {"oneOf": [{"type": "null"}, _CHECKSUM]},
        "seq": _SEQ,
        "kind": {"enum": ["full", "delta"]},
        "parent": {"oneOf": [{"type": "null"}, _SEQ]},
        "base": _SEQ,
        "global_step": _INT,
        "wall_time": {"type": "number"},
        "files": {"type": "object", "minProperties": 1, "additionalProperties": {
            "type": "object", "required": ["size", "crc32c"], "additionalProperties": False,
            "properties": {"size": _COUNT, "crc32c": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF}}}},
        "evs": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["dim", "key_dtype", "slots", "rows", "filtered", "deleted"],
            "additionalProperties": False,
            "properties": {
                "dim": {"type": "integer", "minimum": 1},
                "key_dtype": {"enum": ["int32", "int64", "string"]},
                "slots": {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
                "rows": _COUNT, "filtered": _COUNT, "deleted": _COUNT,
                "shard": {"type": "object", "required": ["ev", "index", "count", "route"],
                          "additionalProperties": False,
                          "properties": {"ev": {"type": "string", "minLength": 1}, "index": _COUNT,
                                         "count": {"type": "integer", "minimum": 1},
                                         "route": {"type": "string"}}}}}},
        "dense": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["dtype", "shape"], "additionalProperties": False,
            "properties": {"dtype": {"type": "string", "minLength": 1},
                           "shape": {"type": "array", "items": _COUNT}}}},
        "metadata": {"type": "object"},
        "quality": _quality.SCHEMA,
        "deleted_complete": {"const": True},
        "serving_view": {"type": "object", "required": ["dtype"], "additionalProperties": False,
                         "properties": {"dtype": {"enum": ["bfloat16", "float16", "int8"]}}},
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def canonical_checksum(d):
    """"sha256:<hex>" of manifest dict `d` without its "checksum" field."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def dir_name(kind, seq):
    return f"{kind}-{seq:010d}"


def parse_dir_name(name):
    """(kind, seq) for a checkpoint directory name, else None."""
    m = _DIR_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


@dataclasses.dataclass
class Manifest:
    seq: int
    kind: str                 # "full" or "delta"
    parent: int | None
    base: int
    global_step: int
    wall_time: float
    files: dict               # name -> {"size": int, "crc32c": int}
    evs: dict                 # name -> {"dim", "key_dtype", "slots", "rows", "filtered", "deleted"}
    dense: dict               # name -> {"dtype", "shape"}
    metadata: dict = dataclasses.field(default_factory=dict)
    parent_checksum: str | None = None   # the parent manifest's checksum (deltas; None: not recorded)
    quality: dict | None = None          # evstore.quality record of the data since the parent (None: not given)
    serving_view: dict | None = None     # {"dtype": ...} when the commit holds a serving view
    deleted_complete: bool = False       # deleted keys list every key erased since the parent
    # `checksum` (an attribute, not a field): this manifest's content identity,
    # set by to_json / from_json (None for a manifest without one).
    checksum = None

    @property
    def dir(self):
        return dir_name(self.kind, self.seq)

    @property
    def total_bytes(self):
        return sum(f["size"] for f in self.files.values())

    def to_json(self):
        d = {"format": FORMAT, "version": VERSION}
        d.update(dataclasses.asdict(self))
        if d["quality"] is None:   # written only when given: a manifest without it reads as before
            del d["quality"]
        if d["serving_view"] is None:
            del d["serving_view"]   # optional: manifests without a view stay as they were
        if not d["deleted_complete"]:
            del d["deleted_complete"]
        d["checksum"] = self.checksum = canonical_checksum(d)
        return json.dumps(d, indent=1, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text, where):
        """Parses and validates a manifest; `where` names it in errors."""
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the checkpoint is corrupt") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where}: not an evstore checkpoint manifest")
        if d.get("version") != VERSION:
            raise CorruptCheckpointError(f"{where}: manifest version {d.get('version')!r} is not supported "
                                         f"(this evstore reads version {VERSION})")
        err = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(d))
        if err is not None:
            field = "/".join(str(p) for p in err.absolute_path) or "(top level)"
            raise CorruptCheckpointError(f"{where}: manifest does not match the checkpoint manifest schema at "
                                         f"{field!r}: {err.message}; the checkpoint is corrupt")
        if "checksum" in d and canonical_checksum(d) != d["checksum"]:
            raise CorruptCheckpointError(f"{where}: manifest checksum mismatch (its content was changed after it "
                                         "was written); the checkpoint is corrupt")
        m = cls(seq=d["seq"], kind=d["kind"], parent=d["parent"], base=d["base"], global_step=d["global_step"],
                wall_time=float(d["wall_time"]), files=d["files"], evs=d["evs"], dense=d["dense"],
                metadata=d.get("metadata") or {}, parent_checksum=d.get("parent_checksum"),
                quality=d.get("quality"),
                serving_view=d.get("serving_view"), deleted_complete=bool(d.get("deleted_complete")))
        m.checksum = d.get("checksum")
        if m.kind == "full" and (m.parent is not None or m.base != m.seq):
            raise CorruptCheckpointError(f"{where}: a full must have no parent and be its own base")
        if m.kind == "delta" and (m.parent is None or m.parent >= m.seq or m.base > m.parent):
            raise CorruptCheckpointError(f"{where}: delta {m.seq} names parent {m.parent} and base {m.base}, "
                                         "which cannot precede it")
        for name, f in m.files.items():
            if not isinstance(f, dict) or not isinstance(f.get("size"), int) or not isinstance(f.get("crc32c"), int):
                raise CorruptCheckpointError(f"{where}: bad file entry for {name!r}")
        return m
