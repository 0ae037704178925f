"""Two or more builds of evstore's op library compared on the tiered EV's training, interleaved
(bench_tiered `ev` children, --no-save): which build trains the tier faster, on the same machine at
the same time, without swapping files in the worktree.

    cp evstore/native/_evstore_ops*.so /tmp/new.so          # this build
    git stash; make install; cp evstore/native/_evstore_ops*.so /tmp/old.so; git stash pop; make install
    .venv/bin/python -m bench.tiered.ab_oplib --lib old=/tmp/old.so --lib new=/tmp/new.so \\
        --keys 3000000 --rounds 4 --dir <a directory on the disk>

Each build runs in its own child processes, which import evstore from a private copy of this tree's
Python package holding that build's library (nothing in the worktree changes; the copies are removed
at the end). Every round runs one all-DRAM child (with the first build's library: the yardstick of
that round) and one tiered child per build, the builds' order reversed every other round. Per round
and build: the tiered child's CPU a training key (user + system), its ratio to the round's all-DRAM
child, the bytes written a key and how much of them grew the tier file; at the end the median per
build of its CPU a key and of its ratio. The builds must have been compiled against this
TensorFlow. At 10M keys run it under the big-memory lock (BRIEF).
"""
import argparse
import glob
import os
import shutil
import statistics
import tempfile

from bench.harness.paths import ROOT
from bench.tiered import bench_tiered_ev


def overlay(lib, into):
    """A copy of this tree's evstore package under `into` whose op library is `lib`; returns `into`."""
    pkg = os.path.join(ROOT, "evstore")
    dest = os.path.join(into, "evstore")
    shutil.copytree(pkg, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    name = os.path.basename(glob.glob(os.path.join(pkg, "native", "_evstore_ops*.so"))[0])
    shutil.copy(lib, os.path.join(dest, "native", name))
    return into


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH",
                    help="a build of the op library (_evstore_ops*.so), named; give two or more")
    ap.add_argument("--keys", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dram-fraction", type=float, default=0.1)
    ap.add_argument("--dir", default=None, help="where the tier files go (a disk, not a tmpfs)")
    bench_tiered_ev.add_arguments(ap)
    args = ap.parse_args()
    libs = dict(x.split("=", 1) for x in args.lib)
    if len(libs) < 2 or not all(os.path.isfile(p) for p in libs.values()):
        ap.error("--lib NAME=PATH at least twice, each an existing file")
    args.no_save = True
    scratch = tempfile.mkdtemp(prefix="ab-oplib-", dir=args.dir)
    try:
        trees = {n: overlay(p, os.path.join(scratch, n)) for n, p in libs.items()}
        names = list(libs)
        per = {n: {"cpu": [], "ratio": []} for n in names}

        def child(kind, name):
            work = tempfile.mkdtemp(prefix="ev-", dir=scratch)
            try:
                cfg = bench_tiered_ev._cfg(args, kind, "train-save", work)
                cfg.update(overlay=trees[name], find1_calls=10, find1k_calls=10)
                return bench_tiered_ev._run_child(cfg, quiet=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)

        for r in range(args.rounds):
            d = child("dram", names[0])
            print(f"round {r + 1}, load {os.getloadavg()[0]:.1f}: "
                  f"{bench_tiered_ev._train_line('all-DRAM (' + names[0] + ')', d)}", flush=True)
            for n in (names if r % 2 == 0 else names[::-1]):
                t = child("tiered", n)
                ratio = d["train_cpu_us_per_key"] / t["train_cpu_us_per_key"]
                per[n]["cpu"].append(t["train_cpu_us_per_key"])
                per[n]["ratio"].append(ratio)
                print(f"  {ratio:.2f}x  {bench_tiered_ev._train_line(n, t)}; load (populate) "
                      f"{t['populate_cpu_us_per_key']:.2f} us CPU a key, tier file {t['disk_mb']:,.0f} MiB", flush=True)
        print(f"\n{args.keys:,} keys, {args.rounds} rounds, medians:")
        for n in names:
            print(f"  {n}: tiered {statistics.median(per[n]['cpu']):.3f} us CPU a key, "
                  f"{statistics.median(per[n]['ratio']):.2f}x the all-DRAM child by CPU "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in per[n]['ratio'])})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
