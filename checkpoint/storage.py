"""Checkpoint roots on any fsspec filesystem.

Local roots are written in place (bundle files straight into the checkpoint
directory, fsynced). Other filesystems (s3://, gs://, memory://, ...) are
written with no local staging: the native writer streams each file into the
root through an object sink (checkpoint/object_sink.py: a temporary key per
data file, renamed into place by `upload`), and the manifest is uploaded last
(a single object put, atomic on object stores). Reads of a remote root write
nothing locally either: the native loader (a restore, a serving shard
loading a new full, the tools) reads each file through an object source
(checkpoint/object_source.py: ranged reads with read-ahead, the mirror of the
sink; checkpoint/fetch.py opens it and checks the files first), and a serving
replica reads the byte ranges of the tensors it serves into memory
(`read_ranges`). Only a local root is staged (`stage`: hard links).

Bytes read per restore, from any root: the indexes (checked against the
manifest) and every tensor the restore loads, each once, checked (crc32c) by
the native loader as it streams into staging tables; a restore of a local root
reads its hard links so. A serving shard streaming a new full into replacement
tables reads each byte once too (docs/ARCHITECTURE.md, "Restoring: each byte
read once"; what is read more than once is stated there).
"""
import copy
import os
import posixpath
import shutil
import tempfile

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkpoint.fileio import fsync
from checkpoint.manifest import MANIFEST, Manifest, parse_dir_name

__all__ = ["Storage"]


class Storage:
    """A checkpoint root: `Storage("/data/ckpt")`, `Storage("memory://job")`, `Storage("s3://b/p")`."""

    def __init__(self, root, storage_options=None):
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ValueError(f"checkpoint root must be a path or an fsspec URL, got {root!r}")
        self.url = str(root)
        self.options = dict(storage_options or {})   # what a task's checkpoint service opens the root with
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError as e:   # e.g. s3:// without s3fs: fsspec names the package to install
            extra = " (pip install 'evstore[s3]')" if self.url.startswith(("s3://", "s3a://")) else ""
            raise ValueError(f"checkpoint root {self.url}: {e}{extra}") from None
        # Exactly the local filesystem: a subclass (another protocol over local
        # disk) may change what writes do, so it goes through the fsspec calls.
        self.local = type(self.fs) is LocalFileSystem
        if self.local:
            self.path = os.path.abspath(self.path)
        self._manifests = {}

    def __repr__(self):
        return f"Storage({self.url!r})"

    def join(self, *parts):
        return posixpath.join(self.path, *parts) if not self.local else os.path.join(self.path, *parts)

    def makedirs(self, path):
        self.fs.makedirs(path, exist_ok=True)

    def list_dirs(self):
        """{seq: (kind, dirname)} of every checkpoint-shaped directory, committed or not."""
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return {}
        out = {}
        for full in names:
            name = posixpath.basename(str(full).rstrip("/"))
            parsed = parse_dir_name(name)
            if parsed:
                out[parsed[1]] = (parsed[0], name)
        return out

    def has_manifest(self, dirname, cached=True):
        """Whether `dirname` is committed (`cached=False`: ask the filesystem now)."""
        if not cached:
            try:
                self.fs.invalidate_cache(self.join(dirname))
            except Exception:  # noqa: BLE001 - not every filesystem caches listings
                pass
            return self.fs.exists(self.join(dirname, MANIFEST))
        return dirname in self._manifests or self.fs.exists(self.join(dirname, MANIFEST))

    def read_manifest(self, dirname):
        # A committed manifest never changes, so each is read once per Storage
        # (a scan before every save would otherwise re-read the whole history).
        if dirname in self._manifests:
            return self._manifests[dirname]
        path = self.join(dirname, MANIFEST)
        with self.fs.open(path, "rb") as f:
            text = f.read()
        m = Manifest.from_json(text, where=self._display(path))
        kind_seq = parse_dir_name(dirname)
        if kind_seq != (m.kind, m.seq):
            from checkpoint.errors import CorruptCheckpointError
            raise CorruptCheckpointError(f"{self._display(path)}: manifest says {m.kind} {m.seq}, "
                                         f"but it lives in directory {dirname}")
        self._manifests[dirname] = m
        return m

    def write_manifest(self, dirname, manifest):
        """Writes MANIFEST.json atomically and durably: the commit point."""
        data = manifest.to_json().encode()
        path = self.join(dirname, MANIFEST)
        if self.local:
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync(os.path.dirname(path), best_effort=True)
        else:
            self.fs.pipe_file(path, data)
        # What was just written, whole, is what a read would return: the next
        # scan need not read it back and validate it again.
        self._manifests[dirname] = copy.deepcopy(manifest)

    def remove_manifest(self, dirname):
        self._manifests.pop(dirname, None)
        try:
            self.fs.rm_file(self.join(dirname, MANIFEST))
        except FileNotFoundError:
            pass
        if self.local:
            fsync(self.join(dirname), best_effort=True)

    def remove_dir(self, dirname):
        self._manifests.pop(dirname, None)
        path = self.join(dirname)
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def file_size(self, dirname, name):
        return self.fs.size(self.join(dirname, name))

    def open(self, dirname, name):
        return self.fs.open(self.join(dirname, name), "rb")

    def read_ranges(self, dirname, ranges):
        """[bytes] of checkpoint `dirname`'s byte ranges [(file, start, end)]:
        only those bytes are read (ranged GETs, concurrently, on object
        stores). A range past a file's end comes back short; a missing file
        raises FileNotFoundError."""
        if self.local:
            out = []
            for name, start, end in ranges:
                with open(self.join(dirname, name), "rb") as f:
                    parts, pos = [], start
                    while pos < end:   # one pread returns at most ~2 GiB
                        b = os.pread(f.fileno(), end - pos, pos)
                        if not b:
                            break
                        parts.append(b)
                        pos += len(b)
                    out.append(parts[0] if len(parts) == 1 else b"".join(parts))
            return out
        paths = [self.join(dirname, name) for name, _, _ in ranges]
        out = self.fs.cat_ranges(paths, [s for _, s, _ in ranges], [e for _, _, e in ranges], on_error="return")
        for b in out:
            if isinstance(b, BaseException):
                raise b
        return out

    # ---- writing: where the native writer puts the bundle -------------------
    def staging_dir(self, dirname):
        """Where the native writer writes the bundle of `dirname`: the checkpoint
        directory itself (local roots), or an object sink's directory (others:
        streamed into the root, checkpoint/object_sink.py)."""
        if self.local:
            path = self.join(dirname)
            os.makedirs(path, exist_ok=True)
            fsync(self.path, best_effort=True)
            return path
        from checkpoint.object_sink import ObjectSink
        return ObjectSink(self, dirname).directory

    def upload(self, staging, dirname, names):
        """Puts the written files `names` in place in the root: a remote root's
        data files are renamed from their temporary keys, its indexes (kept in
        memory) uploaded (no-op for local roots)."""
        if self.local:
            return
        from checkpoint.object_sink import sink_of
        sink = sink_of(staging)
        held = [n for n in names if n in sink.memory]
        sink.publish({n: n for n in names if n not in sink.memory})
        for n in held:   # the index last: every file it points to is in place
            self.fs.pipe_file(self.join(dirname, n), sink.memory[n])

    def discard_staging(self, staging):
        if not self.local:
            from checkpoint.object_sink import sink_of
            try:
                sink = sink_of(staging)
            except KeyError:
                return
            sink.discard()
            sink.close()

    # ---- reading: where the native loader reads a checkpoint's files ---------
    def stage(self, dirname, names):
        """A private local view of checkpoint `dirname`'s files `names` (local
        roots only), which nothing else writes or deletes (a restore reads and
        checks exactly these bytes): hard links in `<root>/.evstore-restore-*`
        (no copy; a concurrent retention unlinks only its own names), copies
        into a temporary directory when links cannot be made. A file that does
        not exist is left out (the check step reports it). Release with
        `unstage(path)`. Other roots are read in place through an object
        source (checkpoint/object_source.py; checkpoint/fetch.py chooses)."""
        if not self.local:
            raise ValueError(f"{self.url}: stage() is for local roots; remote ones are read through an object source")
        try:
            dst = tempfile.mkdtemp(prefix=".evstore-restore-", dir=self.path)
        except OSError:   # read-only root: copies
            dst = None
        if dst is None:
            dst = tempfile.mkdtemp(prefix=f"evstore-restore-{dirname}-")
        try:
            for name in names:
                src = self.join(dirname, name)
                try:
                    os.link(src, os.path.join(dst, name))
                except FileNotFoundError:
                    pass
                except OSError:
                    shutil.copyfile(src, os.path.join(dst, name))
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        return dst

    @staticmethod
    def unstage(path):
        shutil.rmtree(path, ignore_errors=True)

    def _display(self, path):
        if self.local:
            return path
        proto = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        return f"{proto}://{path.lstrip('/')}" if proto not in ("file", "local") else path

    def display(self, dirname, name=None):
        return self._display(self.join(dirname, name) if name else self.join(dirname))

