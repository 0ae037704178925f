"""One streamed GET of a byte range of an object, read block by block: how an
object source (checkpoint/object_source.py) reads a column of a bundle.

Why: a column of a restore is read once, front to back. One GET of its whole
byte range, read as the loader consumes it, costs one request where ranged
reads of BLOCK bytes cost one each (and an S3-compatible server that reads
the whole object for every ranged GET, as moto's does, pays for the object
each time).

`open_stream(fs, path, start, end)` gives such a stream for a filesystem that
can make one (s3fs: its `_call_s3("get_object", Range=...)`, the call its own
`cat_file` makes), else None, and the caller reads ranges instead. The
stream's `read(n)` returns the next n bytes (fewer only at the end of the
range); a failure raises, and the caller goes on with ranged reads from where
the stream stopped.
"""
import fsspec.asyn

__all__ = ["open_stream"]


class _S3RangeStream:
    def __init__(self, fs, path, start, end):
        bucket, key, version = fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        self._loop = fs.loop
        resp = fsspec.asyn.sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key,
                                Range=f"bytes={start}-{end - 1}", **extra)
        self._body = resp["Body"]

    def read(self, n):
        return fsspec.asyn.sync(self._loop, _read_exactly, self._body, n)

    def close(self):
        try:
            self._body.close()
        except Exception:  # noqa: BLE001 - closing a stream that failed: nothing more to do
            pass


async def _read_exactly(body, n):
    parts, got = [], 0
    while got < n:
        b = await body.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def open_stream(fs, path, start, end):
    """A stream of bytes [start, end) of object `path` of `fs` (one GET), or None where `fs` has none."""
    if end <= start or not callable(getattr(fs, "_call_s3", None)) or not callable(getattr(fs, "split_path", None)):
        return None
    return _S3RangeStream(fs, path, start, end)
