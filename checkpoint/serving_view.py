"""The serving view: a lower-precision copy of the served embedding rows,
written by the trainer inside the same commit (docs/ARCHITECTURE.md,
"Checkpoints", "Serving view").

A commit with a view holds a second TensorFlow bundle, `serving.index` and
its data files (`tf.train.load_checkpoint` and any stock tool read it),
listed in the same MANIFEST.json as the main bundle and committed by it: one
commit protocol, never a second chain. The native writer encodes each chunk
of rows as it streams the main bundle (EvSaveBundle's `view`,
evstore/native/core/view_codec.h: one pass, no copy of the table, its files
fsynced with the bundle's): the EVs' view tensors one after another in one
data file, `serving.data-00000-of-00001`, an int8 view's row scales after
each EV's values (held until they end: 4 bytes a row). `write_view` below writes the same bundle from a finished
bundle's rows instead (the bundle merged from several tasks' parts). Per EV (part) `<ev>` it
holds `<ev>-values` in the view's dtype, row-aligned with the main bundle's
`<ev>-keys`, and for int8 `<ev>-values_scale` [N] float32. The manifest says
`"serving_view": {"dtype": ...}`. The trainer's own state (the main bundle,
what restore reads) stays float32; a serving replica reads the view instead
of `<ev>-values` and refuses the whole commit when the view is missing or
corrupt.

Encodings (one small class each behind `ViewCodec`; view_codec.h encodes
bit for bit the same):
  - "bfloat16", "float16": each value rounded to the nearest (ties to even);
  - "int8": per row, scale = max |value| / 127, q = round(value / scale) in
    [-127, 127] (Check-N-Run's uniform quantization); a row of zeros has
    scale 0. Decoded value = q * scale.
"""
import abc
import concurrent.futures
import os

import numpy as np
import tensorflow as tf

from checkpoint.fileio import crc32c as _crc32c
from checkpoint.fileio import fsync as _fsync
from checkpoint.index import build_index, data_file, parse_index
from evstore import schema

__all__ = ["VIEW_PREFIX", "SCALE", "CODECS", "codec", "write_view", "view_tensors"]

VIEW_PREFIX = "serving"
SCALE = "-values_scale"


class ViewCodec(abc.ABC):
    """How the view stores float32 rows and reads them back."""

    dtype = None   # the manifest's name of the view

    def suffixes(self):
        """Tensor suffixes one EV has in the view bundle."""
        return (schema.VALUES,)

    @abc.abstractmethod
    def encode(self, values):
        """{suffix: np.ndarray} for float32 rows `values` [N, dim]."""

    @abc.abstractmethod
    def decode(self, tensors, dim):
        """float32 [N, dim] from {suffix: np.ndarray}; ValueError if inconsistent."""


class _Cast(ViewCodec):
    def __init__(self, dtype):
        self._tf = tf.as_dtype(dtype)
        self.dtype = self._tf.name

    def encode(self, values):
        return {schema.VALUES: np.asarray(values, np.float32).astype(self._tf.as_numpy_dtype)}

    def decode(self, tensors, dim):
        v = tensors[schema.VALUES]
        if v.dtype != self._tf.as_numpy_dtype or v.ndim != 2 or v.shape[1] != dim:
            raise ValueError(f"view values are {v.dtype} {list(v.shape)}, expected {self.dtype} [N, {dim}]")
        return v.astype(np.float32)


class _Int8PerRow(ViewCodec):
    dtype = "int8"

    def suffixes(self):
        return (schema.VALUES, SCALE)

    def encode(self, values):
        values = np.asarray(values, np.float32)
        scale = (np.abs(values).max(axis=1, initial=0.0) / np.float32(127)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(values / safe[:, None]), -127, 127)
        return {schema.VALUES: q.astype(np.int8), SCALE: scale}

    def decode(self, tensors, dim):
        q, scale = tensors[schema.VALUES], tensors[SCALE]
        if q.dtype != np.int8 or q.ndim != 2 or q.shape[1] != dim or scale.dtype != np.float32 \
                or scale.shape != (q.shape[0],):
            raise ValueError(f"view values are {q.dtype} {list(q.shape)} with scales {scale.dtype} "
                             f"{list(scale.shape)}, expected int8 [N, {dim}] and float32 [N]")
        return q.astype(np.float32) * scale[:, None]


CODECS = {"bfloat16": _Cast(tf.bfloat16), "float16": _Cast(tf.float16), "int8": _Int8PerRow()}


def codec(dtype):
    """The ViewCodec of view dtype `dtype`; ValueError naming the choices."""
    if dtype not in CODECS:
        raise ValueError(f"serving_view must be one of {sorted(CODECS)} (or None), got {dtype!r}")
    return CODECS[dtype]


def view_tensors(dtype, ev):
    """Names of EV (part) `ev`'s tensors in the view bundle."""
    return [schema.tensor(ev, s) for s in codec(dtype).suffixes()]




def _read_values(directory, main_prefix, ev_names):
    """{ev: float32 [N, dim]} read straight from the main bundle's data files."""
    with open(os.path.join(directory, main_prefix + ".index"), "rb") as f:
        num_shards, entries = parse_index(f.read(), os.path.join(directory, main_prefix + ".index"))
    out = {}
    for ev in ev_names:
        e = entries[schema.tensor(ev, schema.VALUES)]
        n = int(np.prod(e.shape, dtype=np.int64))
        if n == 0:
            out[ev] = np.zeros(e.shape, np.float32)
            continue
        path = os.path.join(directory, data_file(main_prefix, e.shard_id, num_shards))
        out[ev] = np.fromfile(path, np.float32, count=n, offset=e.offset).reshape(e.shape)
    return out


def write_view(directory, ev_names, dtype, main_prefix):
    """Writes `directory/serving.*` (a TensorFlow bundle: one data file and
    its index, in the format BundleWriter writes) from the float32
    `<ev>-values` of the bundle `directory/<main_prefix>` just written; fsyncs
    both. Returns {file name: {"size", "crc32c"}} for the manifest.

    Memory: the commit's float32 rows of every EV and their encoding are
    held until the view is written (not streamed as the main bundle is)."""
    c = codec(dtype)
    values = _read_values(directory, main_prefix, ev_names)
    data_name = data_file(VIEW_PREFIX, 0, 1)
    index_name = VIEW_PREFIX + ".index"
    entries, offset, data_crc = [], 0, 0
    data_path = os.path.join(directory, data_name)
    with open(data_path, "wb") as f:
        for ev in ev_names:
            for suffix, t in c.encode(values[ev]).items():
                b = np.ascontiguousarray(t).tobytes()
                crc = _crc32c(b) if b else 0
                entries.append((schema.tensor(ev, suffix), tf.as_dtype(t.dtype).as_datatype_enum, t.shape, 0,
                                offset, len(b), crc))
                f.write(b)
                data_crc = _crc32c(b, data_crc) if b else data_crc
                offset += len(b)
    index = build_index(entries, 1, _crc32c)
    index_path = os.path.join(directory, index_name)
    with open(index_path, "wb") as f:
        f.write(index)
    # Both files fsynced at once: a filesystem journal commits them together.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(_fsync, data_path), pool.submit(_fsync, index_path)]:
            done.result()
    return {data_name: {"size": offset, "crc32c": data_crc}, index_name: {"size": len(index), "crc32c": _crc32c(index)}}
