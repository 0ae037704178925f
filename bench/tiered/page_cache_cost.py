"""What a write into the page cache costs the writer, by kind of page: appending (a new page-cache
page for every 4 KiB) against overwriting pages already cached, after the file was filled to
--fill-mib. The tier's write-back is one or the other: a log that grows takes new pages, one that
reuses its free extents overwrites cached ones (evstore/native/core/log_space.h).

    .venv/bin/python -m bench.tiered.page_cache_cost --dir <a directory on the disk> --fill-mib 7000

Prints system CPU microseconds per 4 KiB page of each phase (192 KiB pwrite calls: one extent of
256 records of 768 bytes, the tier's write batch at dim 64 with Adam). On a VM whose balloon hands
free memory back to the host (free page reporting), a new page's first touch costs the host's fault
as well, which the guest counts as the writer's system time. Run it under the big-memory lock at
sizes of several GiB (BRIEF); the file is removed at the end.
"""
import argparse
import os

WRITE = 192 << 10


def _writes(fd, buf, start, nbytes):
    """System CPU seconds of pwrite calls covering [start, start + nbytes)."""
    t0 = os.times()
    for off in range(start, start + nbytes, WRITE):
        os.pwrite(fd, buf, off)
    return os.times().system - t0.system


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the file goes (a disk, not a tmpfs)")
    ap.add_argument("--fill-mib", type=int, default=1024, help="the file's size before the measured phases")
    ap.add_argument("--phase-mib", type=int, default=512, help="bytes written by each measured phase")
    args = ap.parse_args()
    fill, phase = args.fill_mib << 20, args.phase_mib << 20
    buf = os.urandom(WRITE)
    path = os.path.join(args.dir, f"page-cache-cost-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    per_page = lambda s, n: s / (n / 4096) * 1e6  # noqa: E731
    try:
        s = _writes(fd, buf, 0, fill)
        print(f"fill {args.fill_mib} MiB (new pages): {per_page(s, fill):.2f} us system CPU a 4 KiB page", flush=True)
        rows = [("append (new pages)", _writes(fd, buf, fill, phase)),
                ("overwrite cached pages, head", _writes(fd, buf, 0, phase)),
                ("overwrite cached pages, middle", _writes(fd, buf, fill // 2, phase))]
        for label, s in rows:
            print(f"{label}: {per_page(s, phase):.2f} us system CPU a 4 KiB page", flush=True)
        print(f"load {os.getloadavg()[0]:.1f}")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
