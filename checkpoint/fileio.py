"""Bytes on disk, the two helpers every writer and reader of a checkpoint shares:
`fsync` of a file or directory, and `crc32c` of bytes as a manifest records it
(unmasked crc32c, computed by evstore's op library)."""
import os

__all__ = ["fsync", "crc32c"]


def fsync(path, best_effort=False):
    """Flushes the file or directory `path` to stable storage. Raises OSError,
    unless `best_effort` (a directory on a filesystem that cannot sync one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if best_effort:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not best_effort:
            raise
    finally:
        os.close(fd)


_CRC_CHUNK = 16 << 20   # the op copies its input into a tensor: a large buffer goes in slices


def crc32c(data, crc=0):
    """crc32c (unmasked) of `data` (bytes-like), extending `crc`."""
    import tensorflow as tf

    from evstore import ops
    view = memoryview(data).cast("B")
    for at in range(0, max(len(view), 1), _CRC_CHUNK):
        crc = int(ops.ev_crc32c_extend(tf.constant(crc, tf.int64), tf.constant(bytes(view[at:at + _CRC_CHUNK]))))
    return crc
