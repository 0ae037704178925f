"""The serving view: a lower-precision copy of the served embedding rows,
written by the trainer inside the same commit (docs/ARCHITECTURE.md,
"Checkpoints", "Serving view").

A commit with a view holds a second TensorFlow bundle, `serving.index` and
`serving.data-*` (written with TensorFlow's own SaveV2, so any stock tool
reads it), listed in the same MANIFEST.json as the main bundle and committed
by it: one commit protocol, never a second chain. Per EV (part) `<ev>` it
holds `<ev>-values` in the view's dtype, row-aligned with the main bundle's
`<ev>-keys`, and for int8 `<ev>-values_scale` [N] float32. The manifest says
`"serving_view": {"dtype": ...}`. The trainer's own state (the main bundle,
what restore reads) stays float32; a serving replica reads the view instead
of `<ev>-values` and refuses the whole commit when the view is missing or
corrupt.

Encodings (one small class each behind `ViewCodec`):
  - "bfloat16", "float16": each value rounded to the nearest (ties to even);
  - "int8": per row, scale = max |value| / 127, q = round(value / scale) in
    [-127, 127] (Check-N-Run's uniform quantization); a row of zeros has
    scale 0. Decoded value = q * scale.
"""
import concurrent.futures
import os

import numpy as np
import tensorflow as tf

from evstore import schema

__all__ = ["VIEW_PREFIX", "SCALE", "CODECS", "codec", "write_view", "view_tensors"]

VIEW_PREFIX = "serving"
SCALE = "-values_scale"


class ViewCodec:
    """How the view stores float32 rows and reads them back."""

    dtype = None   # the manifest's name of the view

    def suffixes(self):
        """Tensor suffixes one EV has in the view bundle."""
        return (schema.VALUES,)

    def encode(self, values):
        """{suffix: tf.Tensor} for float32 rows `values` [N, dim]."""
        raise NotImplementedError

    def decode(self, tensors, dim):
        """float32 [N, dim] from {suffix: np.ndarray}; ValueError if inconsistent."""
        raise NotImplementedError


class _Cast(ViewCodec):
    def __init__(self, dtype):
        self._tf = tf.as_dtype(dtype)
        self.dtype = self._tf.name

    def encode(self, values):
        return {schema.VALUES: tf.cast(values, self._tf)}

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
        values = tf.convert_to_tensor(values, tf.float32)
        scale = tf.reduce_max(tf.abs(values), axis=1) / 127.0
        safe = tf.where(scale > 0, scale, tf.ones_like(scale))
        q = tf.clip_by_value(tf.round(values / safe[:, None]), -127.0, 127.0)
        return {schema.VALUES: tf.cast(q, tf.int8), SCALE: scale}

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


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_view(directory, ev_names, dtype, main_prefix):
    """Writes `directory/serving.*` from the float32 `<ev>-values` of the
    bundle `directory/<main_prefix>` just written; fsyncs the files. Returns
    {file name: {"size", "crc32c"}} for the manifest.

    Memory: the commit's float32 rows of every EV and their encoding are
    held until the view is written (not streamed as the main bundle is)."""
    from evstore import ops
    c = codec(dtype)
    reader = tf.train.load_checkpoint(os.path.join(directory, main_prefix))
    names, tensors = [], []
    for ev in ev_names:
        for suffix, t in c.encode(reader.get_tensor(schema.tensor(ev, schema.VALUES))).items():
            names.append(schema.tensor(ev, suffix))
            tensors.append(t)
    prefix = os.path.join(directory, VIEW_PREFIX)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
    files = sorted(f for f in os.listdir(directory) if f == VIEW_PREFIX + ".index" or
                   f.startswith(VIEW_PREFIX + ".data-"))
    # The files are fsynced concurrently (a filesystem journal commits them
    # together), while their checksums are read from the page cache.
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        synced = [pool.submit(_fsync, os.path.join(directory, f)) for f in files]
        crcs, sizes = ops.ev_file_crc32c([os.path.join(directory, f) for f in files])
        for s in synced:
            s.result()
    return {f: {"size": int(size), "crc32c": int(crc)} for f, crc, size in zip(files, crcs.numpy(), sizes.numpy())}
