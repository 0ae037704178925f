"""Bundles read straight from an object store: no local staging (the mirror of object_sink.py).

Why: a task restoring from a root that is not a local filesystem (s3://,
gs://, ...), and a serving shard loading a new full, should write no
checkpoint byte on their own disk. The native loader
(evstore/native/tf/bundle_stream.h, "Object source") reads a bundle whose
prefix is `ObjectSource.directory + "/" + name` ("evsource://<id>/<name>")
through callbacks this module registers in the process (`install`), never
from a local file:
  - open / size: a file of the checkpoint directory, its size from one
    listing of the directory (a missing file fails the open: the loader opens
    every tensor before it changes a table, so nothing is changed); the
    loader names the byte range it will read (one tensor's), and nothing
    outside it is fetched;
  - read_at: one streamed GET of that range (checkpoint/object_stream.py; S3),
    or, where the filesystem has no such stream, ranged reads
    (`fs.cat_file(path, start, end)`) of BLOCK bytes; read ahead either way:
    while the loader applies one block of a column, the next is already being
    read in a thread, and every open column (keys, values, slots, ...: one
    data file each) has its own, so their GETs run concurrently. A stream
    that fails goes on with ranged reads from where it stopped. Memory: two
    blocks per open file.
Indexes (a few KB: one entry per tensor) are read once and kept while the
source is open: the loader opens the index once per table it loads.

Verification (`verify`): a caller that loads in place must refuse a
corrupt, truncated or missing file before it changes anything, so every file
is first read once and its size and crc32c checked against the manifest. A file is kept in
memory while the files every open source of the process keeps stay within
RETAIN_BYTES (read with one GET of the whole object, several files at once);
the loader then reads it from there, so a restore reads each byte of those
files once. A file beyond the budget is streamed through the check in blocks
read ahead, as above, and read a second time by the loader, which checks
each tensor's crc32c against the index again.
Bytes read so: sum(files) + sum(files not kept). A caller that loads into
tables nobody reads yet (CheckpointManager.restore's staging tables, a
serving shard's replacement tables) needs no verify pass (`verify(data=False)`:
the index checked against the manifest, every file's size from the listing):
the loader's own checks (each tensor's size at open, its crc32c at the end)
refuse the same files, a failure drops those tables, and each byte is read
once; see docs/ARCHITECTURE.md "Restoring: each byte read once".
"""
import concurrent.futures
import ctypes
import logging
import os
import posixpath
import re
import threading
import uuid

from checkpoint import native_callbacks
from checkpoint.errors import CorruptCheckpointError
from checkpoint.fileio import crc32c
from checkpoint.index import parse_index
from checkpoint.object_stream import open_stream
from checkpoint.tensor_read import read_index, read_named

__all__ = ["ObjectSource", "install", "is_source", "source_of", "damaged", "BLOCK", "RETAIN_BYTES"]

log = logging.getLogger("evstore.checkpoint")
SCHEME = "evsource://"        # bundle_stream.h kSourceScheme
BLOCK = 8 << 20               # bytes per block read ahead (a ranged read: one GET)
# Verified data files kept in memory by all of a process's sources, for a loader that reads them more
# than once (a part loaded into several shards of one process) or loads in place after a whole check:
# EVSTORE_SOURCE_KEEP_MIB (MiB; a task's environment) or 512 MiB. 0 keeps none: those files are read
# once per load (and once more for the whole check).
RETAIN_BYTES = int(os.environ.get("EVSTORE_SOURCE_KEEP_MIB", "512")) << 20
_SOURCES = {}                 # id -> ObjectSource
_OPEN = {}                    # handle -> _Reader
_LOCK = threading.Lock()
_NEXT = [0]
_CALLBACKS = None             # the ctypes callbacks (kept alive for the process's life)
_KEPT = [0]                   # bytes every open source of this process keeps (under _LOCK)


# What the native loader (bundle_stream.cc, checkpoint_kernels.cc) says of a file that does not hold
# what its index says: a tensor's checksum, a file shorter than a tensor, an index entry or a string
# column that cannot be, tensors of one EV that disagree.
_DAMAGE = ("checksum mismatch", "is truncated", "is corrupt", "short read of tensor", "corrupt checkpoint index",
           "disagree on their row count", "must hold one value")


def damaged(error, directories):
    """What a failed load (tf.errors.OpError `error`) means for the caller: a CorruptCheckpointError
    naming the file when the loader found one damaged, else `error`. `directories` ({source or local
    directory: how the root names it}) turn the loader's paths into the root's."""
    text = re.sub(r"\s*\[Op:\w+\]$", "", re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", error.message))
    for d, shown in directories.items():
        text = text.replace(d + "/", shown + "/")
    if any(m in text for m in _DAMAGE):
        return CorruptCheckpointError(text)
    return error


def is_source(path):
    return str(path).startswith(SCHEME)


def source_of(path):
    """The ObjectSource of `path` ("evsource://<id>[/name]"); KeyError if it is closed or never was."""
    return native_callbacks.owner(path, SCHEME, _SOURCES, _LOCK)


class ObjectSource:
    """Files `names` of committed checkpoint `manifest` in `storage`, readable by the native loader.

    Use `directory` as the bundle's directory (`load_ev(source.directory, ...)`);
    `close()` when done (a `with` block). `bytes_read` counts every byte read
    from the root.
    """

    def __init__(self, storage, manifest, names=None):
        install()
        self.storage, self.manifest = storage, manifest
        self.names = sorted(manifest.files if names is None else names)
        self.id = uuid.uuid4().hex[:16]
        self.directory = SCHEME + self.id
        self.kept = {}          # name -> bytes (verified, read from memory by the loader)
        self._budgeted = 0      # bytes of `kept` counted in the process's RETAIN_BYTES (not the indexes)
        self.bytes_read = 0
        self.errors = []
        self._sizes = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="evstore-source")
        with _LOCK:
            _SOURCES[self.id] = self

    def path(self, name):
        return self.storage.join(self.manifest.dir, name)

    def sizes(self):
        """{name: bytes} of the checkpoint directory's files (one listing, then cached)."""
        with self._lock:
            if self._sizes is None:
                path = self.storage.join(self.manifest.dir)
                try:
                    self.storage.fs.invalidate_cache(path)
                except Exception:  # noqa: BLE001 - not every filesystem caches listings
                    pass
                try:
                    listing = self.storage.fs.ls(path, detail=True)
                except FileNotFoundError:
                    listing = []
                self._sizes = {posixpath.basename(str(i["name"]).rstrip("/")): int(i.get("size") or 0)
                               for i in listing if i.get("type") != "directory"}
            return self._sizes

    def fetch(self, name, start, end):
        """Bytes [start, end) of file `name` (shorter at the file's end); counted in bytes_read."""
        b = self.storage.fs.cat_file(self.path(name), start=start, end=end) if end > start else b""
        return self._counted(b)

    def _counted(self, b):
        with self._lock:
            self.bytes_read += len(b)
        return b

    def blocks(self, name, size, start=0):
        """Blocks of file `name` from `start` to `size`, in order, the next one read ahead."""
        ahead = None
        pos = start
        while pos < size:
            cur = ahead if ahead is not None else self._pool.submit(self.fetch, name, pos, min(size, pos + BLOCK))
            nxt = pos + BLOCK
            ahead = self._pool.submit(self.fetch, name, nxt, min(size, nxt + BLOCK)) if nxt < size else None
            b = cur.result()
            if not b:
                return
            yield b
            pos += len(b)

    def keep(self, name, data):
        """Keeps `data` as file `name` (an index its caller read and checked against the manifest),
        so neither `verify` nor the loader reads it again."""
        self.kept[name] = data

    def verify(self, data=True, display=None, reread=()):
        """Problems (strings naming the file) with this source's files against the manifest: missing,
        size, crc32c; empty if sound. Each file is read once (concurrently, blocks read ahead); a data
        file is kept in memory while the process's kept files stay within RETAIN_BYTES, an index always.
        `data=False`: the data files' sizes only (from the listing; the loader checks their tensors'
        crc32c as it reads them), the indexes whole, and the files of `reread` (files the loader reads
        more than once) read whole, checked and kept while they fit the budget (the others the loader
        reads, and checks, each time)."""
        display = display or (lambda n: self.storage.display(self.manifest.dir, n))
        sizes = self.sizes()
        problems = {}

        def check(name):
            want = self.manifest.files[name]
            if name not in sizes:
                problems[name] = f"{display(name)}: missing"
                return
            if sizes[name] != want["size"]:
                problems[name] = (f"{display(name)}: size {sizes[name]} bytes, manifest says {want['size']} "
                                  "(truncated or overwritten)")
                return
            index = name.endswith(".index")
            if not data and not index and name not in reread:
                return
            if name in self.kept:   # given by the caller (keep): checked below, not read again
                whole = self.kept[name]
                crc, got = crc32c(whole), len(whole)
                if got != want["size"] or crc != want["crc32c"]:
                    del self.kept[name]
                    problems[name] = f"{display(name)}: size or crc32c does not match the manifest (corrupt)"
                return
            budgeted = not index    # an index (one entry per tensor) is kept whatever the budget
            with _LOCK:
                keep = index or _KEPT[0] + want["size"] <= RETAIN_BYTES
                if keep and budgeted:
                    _KEPT[0] += want["size"]
            if not keep and not data:   # read more than once, beyond the budget: each read is checked
                return
            try:
                if keep:   # one GET of the whole object: it is kept whole anyway
                    whole = self.fetch(name, 0, want["size"])
                    crc, got = crc32c(whole), len(whole)
                else:      # streamed: blocks read ahead, nothing kept
                    crc, got = 0, 0
                    for b in self.blocks(name, want["size"]):
                        crc = crc32c(b, crc)
                        got += len(b)
            except BaseException as e:
                if keep and budgeted:
                    with _LOCK:
                        _KEPT[0] -= want["size"]
                if isinstance(e, FileNotFoundError):   # removed since the listing (a writer's retention)
                    problems[name] = f"{display(name)}: missing"
                    return
                raise
            if got != want["size"]:
                problems[name] = f"{display(name)}: {got} bytes read, manifest says {want['size']} (truncated)"
            elif crc != want["crc32c"]:
                problems[name] = f"{display(name)}: crc32c {crc:#010x}, manifest says {want['crc32c']:#010x} (corrupt)"
            elif keep:
                self.kept[name] = whole
                if budgeted:
                    with self._lock:
                        self._budgeted += want["size"]
                return
            if keep and budgeted:   # not kept after all: its share of the budget goes back
                with _LOCK:
                    _KEPT[0] -= want["size"]

        # One thread per file at a time (each reads its blocks ahead on the source's pool).
        with concurrent.futures.ThreadPoolExecutor(min(4, max(1, len(self.names)))) as pool:
            for f in [pool.submit(check, n) for n in self.names if n in self.manifest.files]:
                f.result()
        for n in self.names:
            if n not in self.manifest.files:
                problems[n] = f"{display(n)}: not listed in the manifest"
        return [problems[n] for n in sorted(problems)]

    def tensors(self, names, prefix="ckpt"):
        """{name: np.ndarray} of whole tensors `names` of bundle `prefix` (dense weights: their byte
        ranges only, each checked against the index, which is checked against the manifest)."""
        got, _ = read_named(self.storage, self.manifest, prefix, list(names), read_ranges=self._ranges)
        return got

    def _ranges(self, dirname, ranges):
        """[bytes] of [(file, start, end)] of this source's directory: from the kept copy when there is
        one, else read (and counted); a missing file raises FileNotFoundError."""
        out = []
        for name, start, end in ranges:
            if name in self.kept:
                out.append(self.kept[name][start:end])
            elif name in self.sizes():
                out.append(self.fetch(name, start, min(end, self.sizes()[name])))
            else:
                raise FileNotFoundError(self.path(name))
        return out

    def signature(self, prefix="ckpt"):
        """({name: shape list}, {name: tf.DType}) of every tensor of bundle `prefix` (from its index,
        checked against the manifest)."""
        import tensorflow as tf

        _, entries = parse_index(read_index(self.storage, self.manifest, prefix, read_ranges=self._ranges),
                                 self.storage.display(self.manifest.dir, prefix + ".index"))
        return ({n: list(e.shape) for n, e in entries.items()},
                {n: tf.dtypes.as_dtype(e.dtype) for n, e in entries.items()})

    def close(self):
        with _LOCK:
            _SOURCES.pop(self.id, None)
            for h in [h for h, r in _OPEN.items() if r.source is self]:
                _OPEN.pop(h).close()
            _KEPT[0] -= self._budgeted
            self._budgeted = 0
            self.kept.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def error(self):
        """The reasons callbacks of this source failed, joined ('' if none)."""
        return "; ".join(self.errors)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Reader:
    """One open file of a source: positioned reads served from the block read now and the one after it
    (read ahead) within the byte range [start, end) its opener named, or from the copy in memory."""

    def __init__(self, source, name, start=0, end=-1):
        self.source, self.name = source, name
        self.kept = source.kept.get(name)
        sizes = source.sizes()
        if self.kept is None and name not in sizes:
            raise FileNotFoundError(source.path(name))
        self.size = len(self.kept) if self.kept is not None else sizes[name]
        self.end = self.size if end < 0 else min(end, self.size)   # blocks are never fetched past it
        self.cur = (0, b"")          # (start, bytes)
        self.ahead = None            # (start, future) of the next block
        self.stream = None           # one GET of [stream_at, end) (object_stream.py), while reads follow it
        self.stream_at = 0
        self.streamed = False        # a stream was opened (never a second one)

    def _limit(self, pos):
        """Where a block at `pos` ends: BLOCK bytes on, not past the named range (nor the file)."""
        return min(self.end if pos < self.end else self.size, pos + BLOCK)

    def _block_at(self, pos):
        start, data = self.cur
        if start <= pos < start + len(data):
            return
        if self.ahead is not None and self.ahead[0] == pos:
            start, fut = self.ahead
            data = fut.result()
        else:
            if self.ahead is not None:
                self.ahead[1].cancel()
            start, data = pos, self._read(pos)
        self.cur = (start, data)
        nxt = start + len(data)
        self.ahead = (nxt, self.source._pool.submit(self._read, nxt)) if data and nxt < self.end else None

    def _read(self, pos):
        """The block at `pos`: the next bytes of the column's stream when it is at `pos` (opened at the
        first block of a range longer than one), else one ranged read."""
        limit = self._limit(pos)
        if self.stream is None and not self.streamed and limit < self.end:
            self.streamed = True
            try:
                self.stream = open_stream(self.source.storage.fs, self.source.path(self.name), pos, self.end)
                self.stream_at = pos
            except Exception as e:  # noqa: BLE001 - ranged reads say what is wrong, if anything is
                log.debug("object source: no stream of %s (%s); ranged reads", self.name, e)
        if self.stream is not None and self.stream_at == pos and limit <= self.end:
            try:
                b = self.source._counted(self.stream.read(limit - pos))
                self.stream_at += len(b)
                if len(b) == limit - pos:
                    return b
            except Exception as e:  # noqa: BLE001 - a failed stream: ranged reads go on from here
                log.debug("object source: the stream of %s failed (%s); ranged reads", self.name, e)
                b = b""
            self._drop_stream()
            return b + self.source.fetch(self.name, pos + len(b), limit)
        if self.stream is not None:   # read elsewhere than the stream is: it is not followed any more
            self._drop_stream()
        return self.source.fetch(self.name, pos, limit)

    def _drop_stream(self):
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()

    def read_into(self, dst, pos, n):
        """Copies up to n bytes at `pos` to address `dst`; returns the count (0 at the end)."""
        if pos >= self.size or n <= 0:
            return 0
        n = min(n, self.size - pos)
        if self.kept is not None:
            ctypes.memmove(dst, _addr(self.kept, pos), n)
            return n
        done = 0
        while done < n:
            self._block_at(pos + done)
            start, data = self.cur
            off = pos + done - start
            take = min(n - done, len(data) - off)
            if take <= 0:
                break
            ctypes.memmove(dst + done, _addr(data, off), take)
            done += take
        return done

    def close(self):
        if self.ahead is not None:
            self.ahead[1].cancel()
        self.cur, self.ahead = (0, b""), None
        self._drop_stream()


def _addr(data, off):
    """The address of byte `off` of bytes object `data` (no copy; `data` must stay alive)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value + off


def _split(path):
    return native_callbacks.split(path, SCHEME, _SOURCES, _LOCK)


def _owner(arg):
    return _OPEN[arg].source if isinstance(arg, int) and arg in _OPEN else _split(arg)[0]


def _guard(fail):
    return native_callbacks.guard(fail, owner_of=_owner, what="object source", log=log,
                                  quiet=(FileNotFoundError,))


@_guard(-1)
def _cb_open(path, start, end):
    source, name = _split(path)
    reader = _Reader(source, name, start, end)
    with _LOCK:
        h = _NEXT[0]
        _NEXT[0] += 1
        _OPEN[h] = reader
    return h


@_guard(-1)
def _cb_size(h):
    return _OPEN[h].size


@_guard(-1)
def _cb_read(h, offset, dst, n):
    return _OPEN[h].read_into(dst, offset, n)


@_guard(None)
def _cb_close(h):
    with _LOCK:
        reader = _OPEN.pop(h, None)
    if reader is not None:
        reader.close()


def install():
    """Registers this module's callbacks with the native loader of this process (idempotent)."""
    global _CALLBACKS
    if _CALLBACKS is not None:
        return
    from evstore._ops import native_library
    lib = native_library()
    fns = (ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64)(_cb_open),
           ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(_cb_size),
           ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)(_cb_read),
           ctypes.CFUNCTYPE(None, ctypes.c_int64)(_cb_close))
    lib.evstore_set_object_source(*fns)
    _CALLBACKS = (lib, fns)
