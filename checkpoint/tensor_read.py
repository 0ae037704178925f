"""Verified reads of a committed checkpoint's indexes and named tensors, by byte range: the bottom
of the read side, beneath checkpoint/fetch.py (which opens whole bundles for the native loader) and
checkpoint/object_source.py (whose dense-tensor and signature reads come here through its own ranged
reads, `read_ranges`).

    index = read_index(storage, manifest)                       # checked against the manifest
    arrays, nbytes = read_named(storage, manifest, "ckpt", ["dense/kernel"])

Every failure is a CorruptCheckpointError naming the file (and the tensor): missing, truncated, a
checksum mismatch, a wanted tensor the index lacks, a data file the manifest does not list. Other I/O
errors (OSError) pass through.
"""
import numpy as np
import tensorflow as tf

from checkpoint.errors import CorruptCheckpointError
from checkpoint.fileio import crc32c as _crc
from checkpoint.index import data_file, parse_index
from checkpoint.manifest import BUNDLE_PREFIX

__all__ = ["read_index", "read_named"]


def read_index(storage, manifest, prefix=BUNDLE_PREFIX, read_ranges=None):
    """The index of bundle `prefix` (default the main one) of commit `manifest`, checked against the
    manifest; read by `read_ranges(dir, ranges)` (default the storage's)."""
    name = prefix + ".index"
    want = manifest.files.get(name)
    where = storage.display(manifest.dir, name)
    if want is None:
        raise CorruptCheckpointError(f"{where}: not listed in the manifest")
    try:
        (data,) = (read_ranges or storage.read_ranges)(manifest.dir, [(name, 0, want["size"])])
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    if len(data) != want["size"] or _crc(data) != want["crc32c"]:
        raise CorruptCheckpointError(f"{where}: size or crc32c does not match the manifest (corrupt)")
    return data


def _listed(storage, manifest, name):
    want = manifest.files.get(name)
    if want is None:
        raise CorruptCheckpointError(f"{storage.display(manifest.dir, name)}: not listed in the manifest")
    return want


def _read(storage, manifest, ranges, read_ranges=None):
    """[bytes] of [(file, start, end)] (read by `read_ranges(dir, ranges)`, default the storage's),
    each checked for length."""
    try:
        out = (read_ranges or storage.read_ranges)(manifest.dir, ranges)
    except FileNotFoundError as e:
        missing = next((n for n, _, _ in ranges if n in str(e)), ranges[0][0])
        raise CorruptCheckpointError(f"{storage.display(manifest.dir, missing)}: missing") from None
    for (name, start, end), b in zip(ranges, out):
        if len(b) != end - start:
            raise CorruptCheckpointError(f"{storage.display(manifest.dir, name)}: {len(b)} bytes at offset {start}, "
                                         f"the index says {end - start} (truncated)")
    return out


def read_named(storage, manifest, prefix, names, read_ranges=None):
    """({name: np.ndarray}, bytes read) of tensors `names` of bundle `prefix` of commit `manifest`,
    each verified (the module docstring, "Named tensors"); `read_ranges(dir, [(file, start, end)])`
    reads the bytes (default: the storage's). Raises CorruptCheckpointError."""
    index_name = prefix + ".index"
    where = storage.display(manifest.dir, index_name)
    want = _listed(storage, manifest, index_name)
    (index,) = _read(storage, manifest, [(index_name, 0, want["size"])], read_ranges)
    if _crc(index) != want["crc32c"]:
        raise CorruptCheckpointError(f"{where}: crc32c does not match the manifest (corrupt)")
    num_shards, entries = parse_index(index, where)
    missing = [n for n in names if n not in entries]
    if missing:
        raise CorruptCheckpointError(f"{where}: the bundle holds no tensor {missing}")
    by_file = {}
    for e in entries.values():
        if e.size:
            by_file.setdefault(e.shard_id, []).append(e)
    wanted = set(names)
    whole, ranged = [], []
    for shard, held in sorted(by_file.items()):
        mine = [e for e in held if e.name in wanted]
        if not mine:
            continue
        f = data_file(prefix, shard, num_shards)
        info = _listed(storage, manifest, f)
        if len(mine) == len(held):
            whole.append((f, info, mine))
        else:
            for e in mine:
                if e.offset + e.size > info["size"]:
                    raise CorruptCheckpointError(f"{storage.display(manifest.dir, f)}: tensor {e.name!r} lies "
                                                 f"outside the file's {info['size']} bytes")
                ranged.append((f, e))
    reads = [(f, 0, info["size"]) for f, info, _ in whole] + [(f, e.offset, e.offset + e.size) for f, e in ranged]
    blobs = _read(storage, manifest, reads, read_ranges) if reads else []
    raw = {}
    for (f, info, mine), b in zip(whole, blobs):
        if _crc(b) != info["crc32c"]:
            raise CorruptCheckpointError(f"{storage.display(manifest.dir, f)}: crc32c does not match the manifest "
                                         "(corrupt)")
        view = memoryview(b)
        for e in mine:
            raw[e.name] = view[e.offset:e.offset + e.size]
    for (f, e), b in zip(ranged, blobs[len(whole):]):
        raw[e.name] = memoryview(b)
        if _entry_crc(e, b) != e.crc32c:
            raise CorruptCheckpointError(f"{storage.display(manifest.dir, f)}: tensor {e.name!r} crc32c does not "
                                         "match the index (corrupt)")
    out = {}
    for n in names:
        e = entries[n]
        try:
            out[n] = _decode(e, raw.get(n, b""))
        except ValueError as err:
            raise CorruptCheckpointError(f"{where}: tensor {n!r} cannot be decoded ({err})") from None
    return out, len(index) + sum(len(b) for b in blobs)


def _entry_crc(e, data):
    """The crc32c an index entry records for `data`: of the bytes as stored,
    except for strings, whose crc covers each length as a uint32 instead of
    its varint (TensorFlow's BundleWriter)."""
    if e.dtype != tf.string.as_datatype_enum:
        return _crc(data)
    lengths, start = _string_lengths(data, int(np.prod(e.shape, dtype=np.int64)))
    return _crc(data[start:], _crc(lengths.astype("<u4").tobytes()))


def _string_lengths(data, n):
    """(lengths, offset of the length checksum) of a string tensor's bytes."""
    b = np.frombuffer(data, np.uint8, count=min(len(data), 10 * n))
    ends = np.flatnonzero(b < 0x80)[:n]
    if len(ends) < n:
        raise ValueError("truncated string lengths")
    starts = np.concatenate([[0], ends[:-1] + 1])
    if np.any(ends - starts > 9):
        raise ValueError("bad string length")
    pos = np.arange(ends[-1] + 1) if n else np.zeros(0, np.int64)
    group = np.repeat(np.arange(n), ends - starts + 1)
    shift = (pos - starts[group]) * 7
    vals = (b[:len(pos)].astype(np.uint64) & np.uint64(0x7F)) << shift.astype(np.uint64)
    lengths = np.zeros(n, np.uint64)
    np.add.at(lengths, group, vals)
    return lengths, (int(ends[-1]) + 1 if n else 0)


def _decode(e, data):
    dtype = tf.dtypes.as_dtype(e.dtype)
    if dtype == tf.string:
        n = int(np.prod(e.shape, dtype=np.int64))
        if n == 0:
            return np.empty(e.shape, object)
        lengths, start = _string_lengths(data, n)
        body = data[start + 4:]
        cuts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        if cuts[-1] != len(body):
            raise ValueError(f"string bytes {len(body)}, lengths say {cuts[-1]}")
        raw = bytes(body)
        return np.array([raw[cuts[i]:cuts[i + 1]] for i in range(n)], dtype=object).reshape(e.shape)
    npd = np.dtype(dtype.as_numpy_dtype)
    count = int(np.prod(e.shape, dtype=np.int64))
    if len(data) != count * npd.itemsize:
        raise ValueError(f"{len(data)} bytes for {count} elements of {dtype.name}")
    return np.frombuffer(data, npd, count=count).reshape(e.shape)
