"""Reading a tensor bundle's index (`<prefix>.index`) without TensorFlow's reader.

The index is TensorFlow's table format (a LevelDB-style SSTable, written
without compression by evstore's native writer and by TensorFlow's
BundleWriter): data blocks of prefix-compressed entries, an index block
pointing at them, a 48-byte footer. Its entries map a tensor name to a
`BundleEntryProto` (dtype, shape, data file `shard_id`, `offset`, `size`,
masked `crc32c`); the entry under the empty name is the `BundleHeaderProto`
(number of data files, endianness).

Why parse it here: a serving replica needs each tensor's byte range before it
reads any data file, so it can read only the tensors it serves
(checkpoint/fetch.py). The caller verifies the index bytes against the
manifest first; the ranges and checksums in it are then trusted.
"""
import dataclasses
import struct

from checkpoint.errors import CorruptCheckpointError

__all__ = ["Entry", "parse_index", "data_file", "unmask_crc", "mask_crc", "build_index"]

_MAGIC = 0xdb4775248b80fb57
_FOOTER = 48
_TRAILER = 5          # block type byte + masked crc32c
_MASK_DELTA = 0xa282ead8


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: int            # tensorflow DataType enum value
    shape: tuple
    shard_id: int
    offset: int
    size: int
    crc32c: int           # unmasked


def mask_crc(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc(masked):
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def data_file(prefix, shard_id, num_shards):
    """The data file name TensorFlow gives shard `shard_id` of `num_shards`."""
    return f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}"


def _varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _block(buf, offset, size):
    if offset + size + _TRAILER > len(buf):
        raise ValueError("block outside the file")
    if buf[offset + size] != 0:
        raise ValueError("compressed block (this reader reads uncompressed tables)")
    return buf[offset:offset + size]


def _entries(block):
    """(key, value) of a block, in order."""
    if len(block) < 4:
        raise ValueError("block too short")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 * (restarts + 1)
    if end < 0:
        raise ValueError("bad restart count")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + vlen > end:
            raise ValueError("bad entry")
        key = key[:shared] + bytes(block[pos:pos + unshared])
        pos += unshared
        yield key, bytes(block[pos:pos + vlen])
        pos += vlen


def parse_index(buf, where):
    """(num_shards, {tensor name: Entry}) of index bytes `buf`; `where` names
    the file in errors. Raises CorruptCheckpointError for anything that is
    not a readable, little-endian bundle index."""
    from tensorflow.core.protobuf import tensor_bundle_pb2

    buf = memoryview(buf)
    try:
        if len(buf) < _FOOTER:
            raise ValueError("shorter than a table footer")
        (magic,) = struct.unpack_from("<Q", buf, len(buf) - 8)
        if magic != _MAGIC:
            raise ValueError("no table magic number")
        pos = len(buf) - _FOOTER
        _, pos = _varint(buf, pos)        # metaindex handle (unused)
        _, pos = _varint(buf, pos)
        ioff, pos = _varint(buf, pos)
        isize, pos = _varint(buf, pos)
        header, entries = None, {}
        for _, handle in _entries(_block(buf, ioff, isize)):
            boff, p = _varint(handle, 0)
            bsize, _ = _varint(handle, p)
            for key, value in _entries(_block(buf, boff, bsize)):
                if key == b"":
                    header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
                    continue
                e = tensor_bundle_pb2.BundleEntryProto.FromString(value)
                if e.slices:
                    raise ValueError(f"tensor {key.decode()!r} is saved in slices")
                name = key.decode()
                entries[name] = Entry(name, int(e.dtype), tuple(d.size for d in e.shape.dim), int(e.shard_id),
                                      int(e.offset), int(e.size), unmask_crc(e.crc32c))
        if header is None:
            raise ValueError("no header entry")
        if header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
            raise ValueError("big-endian bundle")
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt index
        raise CorruptCheckpointError(f"{where}: not a readable tensor bundle index ({e})") from None
    return int(header.num_shards), entries


def _put_varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _finish_block(entries, crc32c):
    """An uncompressed table block of (key, value) pairs (a restart point at
    every entry: no key prefix sharing) and its 5-byte trailer."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += _put_varint(0) + _put_varint(len(key)) + _put_varint(len(value)) + key + value
    if not restarts:
        restarts = [0]
    body += struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack("<I", len(restarts))
    return bytes(body) + b"\x00" + struct.pack("<I", mask_crc(crc32c(bytes(body) + b"\x00")))


def build_index(entries, num_shards, crc32c):
    """The bytes of a bundle index (TensorFlow's table format, as BundleWriter
    writes it) holding the header and `entries` [(name, dtype enum, shape,
    shard_id, offset, size, unmasked crc32c)]; `crc32c(bytes)` computes a
    crc32c (for the blocks' trailers)."""
    from tensorflow.core.protobuf import tensor_bundle_pb2

    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=num_shards,
                                                 endianness=tensor_bundle_pb2.BundleHeaderProto.LITTLE)
    header.version.producer = 1
    kv = [(b"", header.SerializeToString())]
    for name, dtype, shape, shard, offset, size, crc in sorted(entries, key=lambda e: e[0].encode()):
        e = tensor_bundle_pb2.BundleEntryProto(dtype=dtype, shard_id=shard, offset=offset, size=size,
                                               crc32c=mask_crc(crc))
        for d in shape:
            e.shape.dim.add(size=int(d))
        kv.append((name.encode(), e.SerializeToString()))
    data = _finish_block(kv, crc32c)
    meta = _finish_block([], crc32c)
    index = _finish_block([(kv[-1][0], _put_varint(0) + _put_varint(len(data) - _TRAILER))], crc32c)
    footer = (_put_varint(len(data)) + _put_varint(len(meta) - _TRAILER)
              + _put_varint(len(data) + len(meta)) + _put_varint(len(index) - _TRAILER))
    footer += b"\x00" * (_FOOTER - 8 - len(footer)) + struct.pack("<Q", _MAGIC)
    return data + meta + index + footer
