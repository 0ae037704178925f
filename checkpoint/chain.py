"""Reading a root: committed checkpoints, chain resolution, checksum verification.

A checkpoint exists for readers iff its MANIFEST.json exists and parses. The
chain to restore ends at the newest committed checkpoint (or the newest at or
before `upto`) and is found by following `parent` links back to its full, so a
branch abandoned by a restore-in-the-past is ignored and a missing delta is a
clear ChainError rather than a silently older state.
"""
import dataclasses
import os

from checkpoint.errors import ChainError, CorruptCheckpointError, NoCheckpointError
from checkpoint.fileio import crc32c

__all__ = ["Scan", "scan", "resolve_chain", "withdrawn", "WITHDRAWN_RESCANS", "verify_files", "verify_staged",
           "crc32c_stream"]

# Scans a reader makes when a writer's retention keeps removing what it reads.
WITHDRAWN_RESCANS = 3

_CHUNK = 8 << 20


@dataclasses.dataclass
class Scan:
    manifests: dict          # seq -> Manifest (committed)
    uncommitted: dict        # seq -> dirname (no manifest: in flight or abandoned)
    corrupt: dict            # seq -> error message (manifest present but invalid)

    @property
    def max_seq(self):
        seqs = list(self.manifests) + list(self.uncommitted) + list(self.corrupt)
        return max(seqs) if seqs else 0


def scan(storage):
    """Every checkpoint directory of a root, classified."""
    s = Scan({}, {}, {})
    for seq, (kind, dirname) in sorted(storage.list_dirs().items()):
        if not storage.has_manifest(dirname, cached=False):   # a withdrawn manifest disappears
            s.uncommitted[seq] = dirname
            continue
        try:
            s.manifests[seq] = storage.read_manifest(dirname)
        except CorruptCheckpointError as e:
            s.corrupt[seq] = str(e)
        except FileNotFoundError:  # removed between ls and read (retention)
            s.uncommitted[seq] = dirname
    return s


def withdrawn(storage, manifests):
    """Directories of `manifests` that are no longer committed: their manifest
    is gone from the filesystem (asked now, not from the cache). A writer's
    retention removes a checkpoint's manifest before its files, so a reader
    whose read of a checkpoint failed, or raced, asks this to tell a withdrawn
    checkpoint (scan again) from a broken one (an error)."""
    return [m.dir for m in manifests if not storage.has_manifest(m.dir, cached=False)]


def resolve_chain(sc, upto=None, where="checkpoint root"):
    """[full, delta, delta, ...] ending at the newest committed checkpoint <= upto."""
    cands = [q for q in sc.manifests if upto is None or q <= upto]
    if not cands:
        what = "no committed checkpoint" if upto is None else f"no committed checkpoint at or before seq {upto}"
        raise NoCheckpointError(f"{where} holds {what}")
    seq = max(cands)
    if upto is not None and upto in sc.corrupt:
        raise CorruptCheckpointError(sc.corrupt[upto])
    newer_corrupt = [q for q in sc.corrupt if q > seq and (upto is None or q <= upto)]
    if newer_corrupt:
        raise CorruptCheckpointError(sc.corrupt[max(newer_corrupt)] + " (it is newer than every valid checkpoint; "
                                     f"restore(seq={seq}) explicitly to go back to the last valid one)")
    chain = [sc.manifests[seq]]
    while chain[-1].kind == "delta":
        m = chain[-1]
        parent = sc.manifests.get(m.parent)
        if parent is None:
            why = (sc.corrupt[m.parent] if m.parent in sc.corrupt else
                   "it has no manifest" if m.parent in sc.uncommitted else "it does not exist")
            raise ChainError(f"{where}: {m.dir} follows checkpoint {m.parent}, which cannot be read ({why}); "
                             "the chain has a gap. Restore an earlier sequence with restore(seq=...), or start "
                             "a new chain with save_full().")
        if m.parent_checksum and parent.checksum and m.parent_checksum != parent.checksum:
            raise ChainError(f"{where}: {m.dir} follows checkpoint {m.parent} with content {m.parent_checksum}, but "
                             f"{parent.dir} holds other content ({parent.checksum}): its parent was withdrawn and "
                             "the sequence number reused")
        if parent.base != m.base:
            raise ChainError(f"{where}: {m.dir} names base {m.base} but its parent {parent.dir} belongs to the "
                             f"chain of full {parent.base}: the manifest points at a wrong parent")
        chain.append(parent)
    chain.reverse()
    if chain[0].seq != chain[-1].base:
        raise ChainError(f"{where}: the chain of {chain[-1].dir} starts at {chain[0].dir}, "
                         f"not at its base full {chain[-1].base}")
    return chain


def crc32c_stream(f):
    """crc32c (unmasked) and size of a binary file object, read in chunks."""
    crc, size = 0, 0
    while True:
        b = f.read(_CHUNK)
        if not b:
            return crc, size
        crc = crc32c(b, crc)
        size += len(b)


def _size_problem(where, size, want):
    return f"{where}: size {size} bytes, manifest says {want} (truncated or overwritten)"


def _crc_problem(where, crc, want):
    return f"{where}: crc32c {crc:#010x}, manifest says {want:#010x} (corrupt)"


def verify_files(storage, manifest, checksums=True):
    """Problems (strings naming the file) with a committed checkpoint's files; empty if sound."""
    def display(name):
        return storage.display(manifest.dir, name)

    if storage.local and checksums:   # one native call reads every file: sizes and crcs together
        return verify_staged(storage.join(manifest.dir), manifest, display)
    problems = []
    for name, want in sorted(manifest.files.items()):
        try:
            size = storage.file_size(manifest.dir, name)
        except FileNotFoundError:
            problems.append(f"{display(name)}: missing")
            continue
        if size != want["size"]:
            problems.append(_size_problem(display(name), size, want["size"]))
        elif checksums:
            with storage.open(manifest.dir, name) as f:
                crc, _ = crc32c_stream(f)
            if crc != want["crc32c"]:
                problems.append(_crc_problem(display(name), crc, want["crc32c"]))
    return problems


def verify_staged(local_dir, manifest, display, names=None, data=True):
    """Problems with a local copy of a checkpoint's files (`local_dir`; `names`:
    those files, default every file of the manifest): sizes and crc32c against
    the manifest, every file read in one op call. `data=False`: the data
    files' sizes only (os.stat; a loader that checks each tensor's crc32c as it
    reads, into tables it drops on failure, checks their bytes), the indexes
    read and checked whole. `display(name)` names a file in errors."""
    from evstore import ops
    names = sorted(manifest.files if names is None else names)
    present = [n for n in names if os.path.exists(os.path.join(local_dir, n))]
    read = [n for n in present if data or n.endswith(".index")]
    found = {n: (None, os.stat(os.path.join(local_dir, n)).st_size) for n in present}
    if read:
        crcs, sizes = ops.ev_file_crc32c([os.path.join(local_dir, n) for n in read])
        found.update(zip(read, zip(crcs.numpy().tolist(), sizes.numpy().tolist())))
    problems = []
    for name in names:
        want = manifest.files[name]
        if name not in found:
            problems.append(f"{display(name)}: missing")
            continue
        crc, size = found[name]
        if size != want["size"]:
            problems.append(_size_problem(display(name), size, want["size"]))
        elif crc is not None and crc != want["crc32c"]:
            problems.append(_crc_problem(display(name), crc, want["crc32c"]))
    return problems
