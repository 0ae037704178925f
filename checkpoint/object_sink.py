"""Bundles streamed straight into an object store: no local staging.

Why: on a root that is not a local filesystem (s3://, gs://, ...) a task
should hold no checkpoint byte on its own disk: its rows go from memory to
the object store. The native bundle writer (evstore/native/tf/bundle_stream.h)
writes a bundle whose prefix is `ObjectSink.directory + "/" + name`
("evsink://<id>/<name>") through callbacks this module registers in the
process (`install`), never into a local file:
  - a data file is streamed, one 1 MiB buffer at a time, into an fsspec file
    opened for writing under a temporary key of the checkpoint directory
    (`<dir>/.sink-<id>-<name>`; on S3 a multipart upload, so at most one
    upload block per open column is held in memory);
  - an index (a few KB; `*.index`) is kept in memory (`read`): the caller
    merges or uploads it;
  - the writer's renames are recorded, its removals delete what was written.
`publish` then gives each data file its name in the commit (a server-side
copy on object stores: no byte of it through this host) and deletes the
temporary keys; `discard` deletes every temporary key of a failed save (an
unfinished multipart upload of a killed task is left to the bucket's
lifecycle rule, docs/guides/parameter-server.md).

A data file's final name (`ckpt.data-<s>-of-<n>`) is known only once the
writer, and for a multi-part commit every part, has finished; its bytes
cannot wait for it without being staged, hence the temporary key and the
copy. Local roots are written in place and never use a sink.
"""
import ctypes
import io
import logging
import os
import threading
import uuid

from checkpoint import native_callbacks

__all__ = ["ObjectSink", "install", "is_sink", "sink_of", "read"]

log = logging.getLogger("evstore.checkpoint")
SCHEME = "evsink://"          # bundle_stream.h kSinkScheme
_TEMP = ".sink-"              # temporary keys: <dir>/.sink-<sink id>-<writer's name>
_SINKS = {}                   # id -> ObjectSink
_OPEN = {}                    # handle -> (sink, name, file, wrote)
_LOCK = threading.Lock()
_NEXT = [0]
_EMPTY = ""                   # a kept file with no bytes: made at its final name by publish
_CALLBACKS = None             # the ctypes callbacks (kept alive for the process's life)


def is_sink(path):
    return str(path).startswith(SCHEME)


def sink_of(path):
    """The ObjectSink of `path` ("evsink://<id>[/name]"); KeyError if it is closed or never was."""
    return native_callbacks.owner(path, SCHEME, _SINKS, _LOCK)


def read(directory, name):
    """The bytes of small file `name` of a bundle written into `directory` (a local directory or a sink's)."""
    if is_sink(directory):
        return sink_of(directory).memory[name]
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


class ObjectSink:
    """Where the native writer streams the files of checkpoint directory `dirname` of `storage`.

    Use `directory` as the bundle's directory (`write_bundle(sink.directory, ...)`);
    then `publish` (or `discard`), and `close`.
    """

    def __init__(self, storage, dirname):
        install()
        self.storage, self.dirname = storage, dirname
        self.id = uuid.uuid4().hex[:16]
        self.directory = SCHEME + self.id
        self.objects = {}     # writer's file name -> temporary key (or _EMPTY)
        self.sizes = {}       # writer's file name -> bytes written
        self.memory = {}      # writer's file name -> bytes (indexes)
        self.errors = []
        self.made = False     # the checkpoint directory exists (made before the first data file)
        with _LOCK:
            _SINKS[self.id] = self

    def _temp_key(self, name):
        return self.storage.join(self.dirname, f"{_TEMP}{self.id}-{name}")

    def publish(self, names):
        """Gives written files their names in the commit: `names` {writer's name: name in the checkpoint
        directory}; returns the bytes moved. Raises OSError (or the filesystem's error) on failure."""
        fs = self.storage.fs
        self.storage.makedirs(self.storage.join(self.dirname))
        moves, moved = [], 0
        for name, final in names.items():
            key, target = self.objects.pop(name), self.storage.join(self.dirname, final)
            if key == _EMPTY:
                fs.pipe_file(target, b"")
            else:
                moves.append((key, target))
            moved += self.sizes.get(name, 0)
        if moves:   # server-side copies (no byte through this host), concurrent on s3fs; then one delete
            fs.copy([k for k, _ in moves], [t for _, t in moves])
            fs.rm([k for k, _ in moves])
        return moved

    def discard(self):
        """Deletes every temporary key this sink still holds (a failed save). Never raises."""
        for key in [k for k in self.objects.values() if k != _EMPTY]:
            try:
                self.storage.fs.rm_file(key)
            except Exception:  # noqa: BLE001 - a leftover in an uncommitted directory goes with it
                pass
        self.objects.clear()

    def close(self):
        with _LOCK:
            _SINKS.pop(self.id, None)
            for h in [h for h, v in _OPEN.items() if v[0] is self]:
                _discard_open(_OPEN.pop(h))

    def error(self):
        """The reasons callbacks of this sink failed, joined ('' if none)."""
        return "; ".join(self.errors)

    # ---- the native writer's callbacks ---------------------------------------
    def _open(self, name):
        f = _Held() if name.endswith(".index") else None   # data: opened at its first bytes
        return [self, name, f, 0]

    def _write(self, entry, data):
        if entry[2] is None:
            if not self.made:   # a filesystem with directories (not an object store) needs its parent
                self.storage.makedirs(self.storage.join(self.dirname))
                self.made = True
            entry[2] = self.storage.fs.open(self._temp_key(entry[1]), "wb")
        entry[2].write(data)
        entry[3] += len(data)

    def _close(self, entry):
        _, name, f, wrote = entry
        if isinstance(f, _Held):
            self.memory[name] = f.getvalue()
        elif f is None:
            self.objects[name] = _EMPTY
        else:
            f.close()
            self.objects[name] = self._temp_key(name)
        self.sizes[name] = wrote

    def _rename(self, src, dst):
        for table in (self.objects, self.memory, self.sizes):
            if src in table:
                table[dst] = table.pop(src)

    def _remove(self, name):
        self.memory.pop(name, None)
        self.sizes.pop(name, None)
        key = self.objects.pop(name, None)
        if key:
            self.storage.fs.rm_file(key)


class _Held(io.BytesIO):
    """A file the sink keeps in memory (an index); fsspec's own in-memory files are BytesIO too."""


def _discard_open(entry):
    f = entry[2]
    if f is not None and not isinstance(f, _Held):
        try:
            f.discard()   # an unfinished upload: aborted, nothing kept
        except Exception:  # noqa: BLE001
            pass


def _split(path):
    return native_callbacks.split(path, SCHEME, _SINKS, _LOCK)


def _owner(arg):
    return _OPEN[arg][0] if isinstance(arg, int) and arg in _OPEN else _split(arg)[0]


def _guard(fail):
    return native_callbacks.guard(fail, owner_of=_owner, what="object sink", log=log)


@_guard(-1)
def _cb_open(path):
    sink, name = _split(path)
    with _LOCK:
        h = _NEXT[0]
        _NEXT[0] += 1
        _OPEN[h] = sink._open(name)
    return h


@_guard(1)
def _cb_write(h, data, n):
    entry = _OPEN[h]
    entry[0]._write(entry, ctypes.string_at(data, n))
    return 0


@_guard(1)
def _cb_close(h, keep):
    with _LOCK:
        entry = _OPEN.pop(h, None)
    if entry is None:
        return 0
    if keep:
        entry[0]._close(entry)
    else:
        _discard_open(entry)
    return 0


@_guard(1)
def _cb_rename(src, dst):
    sink, a = _split(src)
    _, b = _split(dst)
    sink._rename(a, b)
    return 0


@_guard(1)
def _cb_remove(path):
    sink, name = _split(path)
    sink._remove(name)
    return 0


def install():
    """Registers this module's callbacks with the native writer of this process (idempotent)."""
    global _CALLBACKS
    if _CALLBACKS is not None:
        return
    from evstore._ops import native_library
    lib = native_library()
    fns = (ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_char_p)(_cb_open),
           ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)(_cb_write),
           ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int)(_cb_close),
           ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)(_cb_rename),
           ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)(_cb_remove))
    lib.evstore_set_object_sink(*fns)
    _CALLBACKS = (lib, fns)
