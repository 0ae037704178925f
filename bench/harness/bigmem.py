"""One big-memory run at a time on a shared machine: the lock file named by $EVSTORE_BENCH_BIGMEM_LOCK.

People sharing a machine serialize their big runs with `flock <file> <command>`. A benchmark driver
takes the same lock (flock(2) on the same file, so the two exclude each other) around each part whose
estimated peak memory exceeds $EVSTORE_BENCH_BIGMEM_MIB (default 6144), and only when the variable
names a file: unset, nothing is locked and nothing waits.

    with big_memory(need_mib, "10000000x64") as held:   # held: None, or {"lock", "waited_s"}
        ...                                            # MemAvailable is worth checking here, not before

The lock is released when the block ends or the process dies (the kernel drops a dead holder's flock).
"""
import contextlib
import fcntl
import os
import time

LOCK_ENV = "EVSTORE_BENCH_BIGMEM_LOCK"
MIB_ENV = "EVSTORE_BENCH_BIGMEM_MIB"
DEFAULT_MIB = 6144


def threshold_mib():
    """Estimated peak (MiB) above which a part takes the lock."""
    return float(os.environ.get(MIB_ENV) or DEFAULT_MIB)


@contextlib.contextmanager
def big_memory(need_mib, what):
    """Holds the lock named by $EVSTORE_BENCH_BIGMEM_LOCK for the block when `need_mib` exceeds
    threshold_mib(); yields None when it does not (or no lock is named), else the lock's path and
    the seconds waited for it. Says on stdout that it waits, so a stalled driver explains itself."""
    path = os.environ.get(LOCK_ENV)
    if not path or need_mib <= threshold_mib():
        yield None
        return
    with open(path, "a") as f:
        print(f"{what}: estimated peak {need_mib:.0f} MiB > {threshold_mib():.0f}: waiting for {path} ...",
              flush=True)
        t0 = time.time()
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield {"lock": path, "waited_s": round(time.time() - t0, 1)}
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
