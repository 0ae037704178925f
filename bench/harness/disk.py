"""The disk as a baseline: its sequential rate for a number of bytes, measured in the benchmark's own
run, and files dropped from the page cache so that a timed read comes from the disk."""
import os
import time

CHUNK = 8 << 20   # bytes per write / read call of the sequential probe


def drop_cache(path):
    """Writes back and drops from the page cache every file under `path` (a file or a directory)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue   # gone meanwhile
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_rate(directory, nbytes):
    """Seconds the disk under `directory` takes to write `nbytes` sequentially (8 MiB writes, then
    fsync) and to read them back from the disk (dropped from the page cache first, 8 MiB reads):
    {"seq_write_s", "seq_read_s", "seq_bytes"}. The probe file is removed."""
    path = os.path.join(directory, f"sequential-probe-{os.getpid()}")
    buf = os.urandom(1 << 20) * (CHUNK >> 20)
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    try:
        a = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(buf)[:min(CHUNK, nbytes - done)])
        os.fsync(fd)
        write_s = time.perf_counter() - a
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        a = time.perf_counter()
        at = 0
        while True:
            got = os.pread(fd, CHUNK, at)
            if not got:
                break
            at += len(got)
        read_s = time.perf_counter() - a
    finally:
        os.close(fd)
        os.unlink(path)
    return {"seq_write_s": write_s, "seq_read_s": read_s, "seq_bytes": nbytes}
