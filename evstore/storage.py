"""Where an EmbeddingVariable's rows live: all in DRAM (the default) or in a
DRAM cache over a disk tier (`TieredStorage`). See docs/guides/tiered-storage.md.
"""

import atexit
import collections
import errno
import os
import tempfile
import warnings
import weakref

__all__ = ["TieredStorage", "RamTierWarning", "TierSpaceError", "TierNeed", "free_bytes", "check_tier_room",
           "record_bytes"]

_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


class RamTierWarning(UserWarning):
    """A tier path on a file system that lives in RAM (tmpfs, ramfs)."""


def _filesystem_of(path):
    """The type of the file system `path` is (or would be created) on, from /proc/self/mounts; None unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, fs = "", None
    for mount, kind in mounts:
        mount = mount.replace("\\040", " ")
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fs = mount, kind
    return fs


class TierSpaceError(OSError):
    """A tier directory's file system lacks the free space a load into a new tiered table needs
    (errno ENOSPC), found before the load starts: nothing was changed."""


def free_bytes(path, device=None):
    """(bytes the process of `device` may still write on the file system of `path` or, if missing, of
    its nearest existing parent, that file system's id), measured on the host of `device` (a task's,
    as a tiered table there sees its `path`; None: this process) by EvDiskFree (statvfs; root may also
    write the blocks a file system reserves for it)."""
    import tensorflow as tf

    from evstore._ops import gen
    with tf.device(device or None):
        free, fs = gen.ev_disk_free(os.path.abspath(os.fspath(path)))
    return int(free), int(fs)


def record_bytes(dim, slots=0, precision="float32"):
    """The bytes of one row on a tier's disk (one record), as the native core lays it out
    (EvTierRecordBytes: core/row_store.h, core/serving_rows.h): a training table's row of `dim`
    floats and `slots` optimizer slots of as many ("float32"), or a serving table's row packed in
    `precision` ("float32", "bfloat16", "float16" or "int8"; no slots).

    Raises:
      tf.errors.InvalidArgumentError: an unknown precision, or slots with a serving precision.
    """
    from evstore._ops import gen
    return int(gen.ev_tier_record_bytes(dim=int(dim), slots=int(slots), precision=precision))


TierNeed = collections.namedtuple("TierNeed", "name path device rows record dram_bytes held")
TierNeed.__doc__ = """A load into a new tiered table: `rows` of `record` bytes each beyond its cache of `dram_bytes`
go to a tier file under `path` on the task of `device`; `held()`: what the table it replaces holds there."""


def check_tier_room(needs, what):
    """Raises TierSpaceError (ENOSPC, naming `what`) when the TierNeeds `needs` whose tier directories
    share a file system (measured on each one's task: free_bytes) need more than its free space:
    rows x record bytes less each DRAM budget, summed. Nothing is created or written."""
    per_fs = {}
    for n in needs:
        need = n.rows * n.record - n.dram_bytes
        if need <= 0:
            continue
        free, fs_id = free_bytes(n.path, n.device)
        task = _task_name(n.device)
        fs = per_fs.setdefault((task, fs_id), {"free": free, "path": n.path + (f" on {task}" if task else ""),
                                                "need": 0, "held": 0, "tables": []})
        fs["need"] += need
        fs["held"] += n.held()
        fs["tables"].append(f"{n.name!r}: {n.rows:,} rows x {n.record:,} bytes - {n.dram_bytes:,} of DRAM")
    short = [fs for fs in per_fs.values() if fs["need"] > fs["free"]]
    if short:
        raise TierSpaceError(errno.ENOSPC, "; ".join(
            f"{what} needs at least {fs['need']:,} bytes of disk under {fs['path']} for the tier files of its "
            f"new tables ({', '.join(fs['tables'])}), and that file system has {fs['free']:,} bytes free (the "
            f"tables they replace hold {fs['held']:,} there until the swap): nothing was loaded or changed; "
            "free disk space there or raise dram_bytes" for fs in short))


def _task_name(device):
    """"/job:J/task:T" of a device string ("" for this process's)."""
    import tensorflow as tf
    spec = tf.DeviceSpec.from_string(device or "")
    return f"/job:{spec.job}/task:{spec.task or 0}" if spec.job else ""


# Tiered tables still alive, dropped at interpreter exit: a table object that
# a reference cycle or a distribution strategy keeps alive to the end is never
# destroyed otherwise, and its tier directory would stay behind (until the next
# tiered table under the same path clears it as stale).
_LIVE = weakref.WeakValueDictionary()


def _track(ev):
    """Drops `ev`'s table (and so its tier directory) at interpreter exit if it is still alive then."""
    if not _LIVE:
        atexit.unregister(_drop_live)
        atexit.register(_drop_live)
    _LIVE[id(ev)] = ev


def _drop_live():
    for ev in list(_LIVE.values()):
        try:
            ev._destroy_resource()
        except Exception:   # exiting: the runtime may already be partly gone; nothing to report to
            pass


class TieredStorage:
    """Rows in a DRAM cache of `dram_bytes` over a private directory on local disk.

    `EmbeddingVariable(..., storage=evstore.TieredStorage(dram_bytes=..., path=...))`
    keeps the EV's index and per-key metadata (key, frequency, dirty bit,
    version, disk location, cache bookkeeping; docs/guides/tiered-storage.md, "What stays in
    DRAM: the cost per key") in DRAM and its
    rows (embedding + optimizer slots) in a cache of about `dram_bytes`;
    the other rows live in one record file on disk, read back when a lookup,
    apply or import touches them. Which rows stay in DRAM follows the keys'
    lookup frequency and recent updates (core/cache_policy.h). Every EV
    operation, checkpoint and delta works and gives bit for bit what the
    all-DRAM table gives; a full save streams rows from both tiers without
    growing the cache.

    The disk tier is a cache, never a source of truth: each table creates its
    own directory `<path>/evstore-tier-<pid>-<n>/` and removes it when the EV
    is destroyed; a directory left by a killed process is removed by the next
    tiered EV created under the same `path`. Checkpoints stay the only durable
    state: restore them to rebuild the tier.

    A disk that refuses a write (full, or a file size limit) keeps the row in
    DRAM (nothing is lost, the cache then exceeds its budget) and fails the op
    that needed the write with ResourceExhaustedError.

    Args:
      dram_bytes: the row cache's budget in bytes (a positive int), per table:
        each shard of a sharded EV has its own. One batch may exceed it by
        the rows it touches in one index segment while it holds them.
      path: the parent directory of the tables' private directories (created
        if missing); default: the system temp directory. Use a local SSD.

    Raises:
      TypeError / ValueError: `dram_bytes` is not a positive int, or `path`
        is not a non-empty string.
    """

    def __init__(self, dram_bytes, path=None):
        if isinstance(dram_bytes, bool) or not isinstance(dram_bytes, int):
            raise TypeError(f"dram_bytes must be a positive int, got {dram_bytes!r}")
        if dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be a positive int, got {dram_bytes}")
        if path is None:
            path = tempfile.gettempdir()
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"path must be a non-empty directory path, got {path!r}")
        self.dram_bytes = dram_bytes
        self.path = os.path.abspath(os.fspath(path))
        fs = _filesystem_of(self.path)
        if fs in _RAM_FILESYSTEMS:
            warnings.warn(f"evstore: the tier path {self.path} is on a {fs} (RAM): rows moved to the tier still take "
                          "memory; pass TieredStorage(path=...) a directory on a local disk", RamTierWarning,
                          stacklevel=2)

    def _native_attrs(self):
        return {"tier_dram_bytes": self.dram_bytes, "tier_path": self.path}

    def __repr__(self):
        return f"TieredStorage(dram_bytes={self.dram_bytes}, path={self.path!r})"
