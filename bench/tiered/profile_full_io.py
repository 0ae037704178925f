"""One tiered full save or restore at a given size, timed by wall and CPU (user, system), optionally
recorded by `perf record -g` (the CPU profile behind BENCHMARKS.md's "Where a tiered full save's and
restore's CPU goes").

    .venv/bin/python -m bench.tiered.profile_full_io save 3000000 /tmp/w [perf.data]   # populate, train, save
    .venv/bin/python -m bench.tiered.profile_full_io restore 3000000 /tmp/w [perf.data]  # restore that full

dim 64 with Adam, 10% of the rows' bytes in DRAM (the `beyond` run's table, bench_tiered_ev.Side); the
tier (save) or the full (restore) is dropped from the page cache first. `save` leaves the full in
WORK/ckpt for `restore`; delete WORK afterwards."""
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

from bench.harness.disk import drop_cache
from bench.tiered.bench_tiered_ev import Side


def timed(phase, fn, perf_out=None):
    """Runs fn, recorded by perf when `perf_out` is given; prints wall, user and system seconds, major faults, load."""
    p = None
    if perf_out:
        p = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-p", str(os.getpid()), "-o", perf_out],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)   # perf attached
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    a = time.perf_counter()
    fn()
    wall = time.perf_counter() - a
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if p:
        p.send_signal(signal.SIGINT)
        p.wait()
    print(f"{phase}: wall {wall:.2f} s user {r1.ru_utime - r0.ru_utime:.2f} sys {r1.ru_stime - r0.ru_stime:.2f} "
          f"majflt {r1.ru_majflt - r0.ru_majflt} load {os.getloadavg()[0]:.1f}", flush=True)


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    phase, keys, work = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    perf_out = sys.argv[4] if len(sys.argv) > 4 else None
    cfg = dict(kind="tiered", keys=keys, dim=64, dram_bytes=int(0.1 * keys * 64 * 12),
               tier_dir=os.path.join(work, "tier"), ckpt=os.path.join(work, "ckpt"), seed=0, zipf=1.1, batch=4096)
    os.makedirs(cfg["tier_dir"], exist_ok=True)
    side = Side(cfg)
    if phase == "save":
        side.populate()
        for _ in range(10):
            side.train_step()
        shutil.rmtree(cfg["ckpt"], ignore_errors=True)
        mgr = side.manager()
        drop_cache(cfg["tier_dir"])
        timed(phase, mgr.save_full, perf_out)
    else:
        mgr = side.manager()
        seq = mgr.chain()[0].seq
        drop_cache(cfg["ckpt"])
        timed(phase, lambda: mgr.restore(seq=seq), perf_out)


if __name__ == "__main__":
    main()
