"""Verified reads of a committed checkpoint: "these tensors of commit m,
verified" (docs/ARCHITECTURE.md, "Checkpoints", "What a reader fetches").

    with fetch(storage, m, {"ckpt": ["user-keys", "user-values"]}) as t:
        keys = t["user-keys"]
    with fetch(storage, m) as t:     # the whole main bundle, as a local directory
        load_ev(t.dir, ...)

Named tensors (a serving replica): the bundle's index is read whole and
checked against the manifest (size and crc32c); the index then gives each
tensor's data file, byte range and crc32c. A data file that holds nothing but
wanted tensors is read whole and checked against the manifest; from a data
file that also holds other tensors (shard 0 holds the dense weights next to
the dense optimizer state) only the wanted tensors' byte ranges are read,
each checked against its index entry. Nothing else is read: optimizer slots
(`<ev>/<slot>-values`, one data file each) and dense optimizer state never
leave the root, and a byte changed in them cannot make the read fail. Bytes
travel once, straight into memory (ranged GETs on object stores).

The whole main bundle (restore): on a local root its files are staged
privately (Storage.stage: hard links); on any other root nothing is written
locally: the files are read through an object source
(checkpoint/object_source.py: ranged reads, read ahead). Either way each is
checked against the manifest before the result is returned: whole (size and
crc32c: a second read by the loader, from memory within a budget on an object
store), or, for a caller that loads into tables nobody reads yet
(verify="index": restores and serving reloads), every size and the index's
crc32c, the data files' tensors by the native loader as it reads them, so
each byte is read once. The result has `dir` for the native loader either way.

Every failure is a CorruptCheckpointError naming the file (and the tensor):
missing, truncated, a checksum mismatch, a wanted tensor the index lacks, a
data file the manifest does not list. Other I/O errors (OSError) pass through:
they may be transient.
"""
import os

import tensorflow as tf

from checkpoint.chain import verify_staged
from checkpoint.errors import CorruptCheckpointError
from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.object_source import ObjectSource
from checkpoint.tensor_read import read_named

__all__ = ["fetch", "Fetched", "bundle_files"]


def bundle_files(manifest, prefix=BUNDLE_PREFIX):
    """The files of bundle `prefix` that `manifest` lists (index and data)."""
    return sorted(n for n in manifest.files if n == prefix + ".index" or n.startswith(prefix + ".data-"))


class Fetched:
    """Verified tensors of one checkpoint. `t[name]` (or `t[prefix, name]` for
    a bundle other than the main one) is a read-only np.ndarray; `bytes_read`
    counts every byte read from the root; `dir` is where the native loader
    reads the whole main bundle (whole fetches only): a private local
    directory, or an object source's. Release with close() or a `with`
    block."""

    def __init__(self, manifest, arrays=None, directory=None, bytes_read=0, release=None, source=None):
        self.manifest = manifest
        self._bytes_read = bytes_read
        self.dir = directory
        self._arrays = arrays or {}
        self._release = release
        self._reader = None
        self._source = source   # an ObjectSource: `dir` is its directory

    @property
    def bytes_read(self):
        """Bytes read from the root so far (an object source's grow as the loader reads)."""
        return self._bytes_read + (self._source.bytes_read if self._source is not None else 0)

    def __getitem__(self, key):
        prefix, name = key if isinstance(key, tuple) else (BUNDLE_PREFIX, key)
        if (prefix, name) in self._arrays:
            return self._arrays[prefix, name]
        if self._source is not None and prefix == BUNDLE_PREFIX:   # its byte range, checked against the index
            self._arrays[prefix, name] = self._source.tensors([name])[name]
            return self._arrays[prefix, name]
        if self.dir is not None and prefix == BUNDLE_PREFIX:
            if self._reader is None:
                self._reader = tf.train.load_checkpoint(os.path.join(self.dir, BUNDLE_PREFIX))
            return self._reader.get_tensor(name)
        raise KeyError(f"{self.manifest.dir}: tensor {name!r} of bundle {prefix!r} was not fetched")

    def close(self):
        self._reader = None
        if self._release is not None:
            self._release()
            self._release = None
        if self._source is not None:
            self._bytes_read += self._source.bytes_read
            self._source.close()
            self._source = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fetch(storage, manifest, tensors=None, verify=True, files=None, index=None, reread=()):
    """These tensors of commit `manifest` from `storage`, verified.

    Args:
      tensors: {bundle prefix: [tensor names]} ("ckpt" is the main bundle; a
        list means the main bundle); None: the whole main bundle, for the
        native loader at `Fetched.dir` (a private local directory of hard
        links on a local root; an object source's directory on any other).
      verify: whole fetches only (named tensors are always checked): True:
        every file's size and crc32c against the manifest before this
        returns; "index": for a caller that loads into tables nobody serves
        yet, which it drops if the load fails: every file's size and the
        index's crc32c before this returns, the data files' bytes by the
        native loader tensor by tensor as it reads them (each byte is then
        read once, on a local root as on a remote one); False: nothing.
      files: whole fetches only: just these files of the main bundle
        (default: all of them), e.g. those of the tensors this process loads.
      index: whole fetches of a remote root only: the main bundle's index,
        already read (and checked against the manifest) by the caller, who
        counts it: not read again.
      reread: with verify="index": files the caller's loads read more than
        once (ObjectSource.verify): kept in memory within its budget.
    Returns: a Fetched (close it).
    Raises:
      CorruptCheckpointError: a file or tensor is missing, truncated or does
        not match the manifest or the index.
      OSError: an I/O error of the filesystem.
    """
    if tensors is None:
        return _fetch_whole(storage, manifest, verify, files, index, reread)
    if not isinstance(tensors, dict):
        tensors = {BUNDLE_PREFIX: list(tensors)}
    arrays, total = {}, 0
    for prefix, names in tensors.items():
        got, n = read_named(storage, manifest, prefix, list(names))
        arrays.update({(prefix, k): v for k, v in got.items()})
        total += n
    return Fetched(manifest, arrays=arrays, bytes_read=total)


def _fetch_whole(storage, manifest, verify, files=None, index=None, reread=()):
    names = bundle_files(manifest) if files is None else sorted(files)
    if not storage.local:
        return _fetch_source(storage, manifest, names, verify, index, reread)
    d = storage.stage(manifest.dir, names)
    try:
        if verify:
            problems = verify_staged(d, manifest, lambda n: storage.display(manifest.dir, n), names=names,
                                     data=verify != "index")
            if problems:
                raise CorruptCheckpointError("; ".join(problems))
    except BaseException:
        storage.unstage(d)
        raise
    size = sum(manifest.files[n]["size"] for n in names)
    return Fetched(manifest, directory=d, bytes_read=size, release=lambda: storage.unstage(d))


def _fetch_source(storage, manifest, names, verify, index=None, reread=()):
    """The whole-bundle fetch of a remote root: an object source over `names`, checked (`verify`);
    `index`: the main bundle's index, read by the caller."""
    source = ObjectSource(storage, manifest, names)
    if index is not None:
        source.keep(BUNDLE_PREFIX + ".index", index)
    try:
        if verify:
            problems = source.verify(data=verify != "index", reread=reread)
            if problems:
                raise CorruptCheckpointError("; ".join(problems))
    except BaseException:
        source.close()
        raise
    return Fetched(manifest, directory=source.directory, source=source)
