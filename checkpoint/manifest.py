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
     "metadata": {...caller's, e.g. the input position...}}

`parent` is the checkpoint this one follows (None for a full), `base` the full
that starts its chain (a full's base is itself). Checksums are crc32c
(Castagnoli, unmasked) of whole files.
"""
import dataclasses
import json
import re

from checkpoint.errors import CorruptCheckpointError

__all__ = ["Manifest", "MANIFEST", "BUNDLE_PREFIX", "dir_name", "parse_dir_name"]

MANIFEST = "MANIFEST.json"
BUNDLE_PREFIX = "ckpt"
FORMAT = "evstore-checkpoint"
VERSION = 1
_DIR_RE = re.compile(r"^(full|delta)-(\d{10})$")


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

    @property
    def dir(self):
        return dir_name(self.kind, self.seq)

    @property
    def total_bytes(self):
        return sum(f["size"] for f in self.files.values())

    def to_json(self):
        d = {"format": FORMAT, "version": VERSION}
        d.update(dataclasses.asdict(self))
        return json.dumps(d, indent=1, sort_keys=True)

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
        try:
            m = cls(seq=int(d["seq"]), kind=str(d["kind"]),
                    parent=None if d["parent"] is None else int(d["parent"]), base=int(d["base"]),
                    global_step=int(d["global_step"]), wall_time=float(d["wall_time"]), files=dict(d["files"]),
                    evs=dict(d["evs"]), dense=dict(d["dense"]), metadata=dict(d.get("metadata") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: manifest field missing or malformed ({e!r})") from None
        if m.kind not in ("full", "delta"):
            raise CorruptCheckpointError(f"{where}: unknown checkpoint kind {m.kind!r}")
        if m.kind == "full" and (m.parent is not None or m.base != m.seq):
            raise CorruptCheckpointError(f"{where}: a full must have no parent and be its own base")
        if m.kind == "delta" and (m.parent is None or m.parent >= m.seq or m.base > m.parent):
            raise CorruptCheckpointError(f"{where}: delta {m.seq} names parent {m.parent} and base {m.base}, "
                                         "which cannot precede it")
        for name, f in m.files.items():
            if not isinstance(f, dict) or not isinstance(f.get("size"), int) or not isinstance(f.get("crc32c"), int):
                raise CorruptCheckpointError(f"{where}: bad file entry for {name!r}")
        return m
