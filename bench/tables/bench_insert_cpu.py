"""New-key inserts (and finds): CPU per batch of evstore vs TF's DenseHashTable.

    .venv/bin/python -m bench.tables.bench_insert_cpu --keys 1000000 --dim 64
    .venv/bin/python -m bench.tables.bench_insert_cpu --keys 1000000 --dim 64 --no-thp

bench_lookup's insert phase measures wall time; on a shared machine the wall
time of a batch is mostly time spent waiting for a core. This benchmark also
reports the process's CPU seconds per batch (every thread: the inserting
threads and the block reserve's prefaulter), which is what the load divides,
and the CPU of each thread over the insert phase. Both tables are filled with
the same --keys keys (bench/harness/workload.py). Find phase: batch i of
existing keys (EvFind, DenseHashTable.lookup); insert phase: batch i of
never-seen keys (EvFindOrInsert, DenseHashTable.insert of supplied rows). Each
batch goes to each system in turn (order alternating), --warmup untimed first.
--no-thp disables transparent huge pages for this process
(prctl(PR_SET_THP_DISABLE), Linux), so the row arena's blocks take 4 KiB
pages and no fault waits for the kernel to compact memory (and every random
row read of a find misses the TLB more often: the find phase shows that cost).
Prints a table and one JSON line (the last line of stdout).
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

from bench.harness.args import add_size_args
from bench.harness.timing import on_host
from bench.harness.workload import Batches, fill_chunks

PR_SET_THP_DISABLE = 41


def thread_cpu_ticks():
    """{thread id: user + system clock ticks} of this process (Linux /proc)."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[t] = int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_size_args(ap)
    ap.add_argument("--no-thp", action="store_true", help="disable transparent huge pages for this process")
    args = ap.parse_args()
    if args.no_thp and ctypes.CDLL(None).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        ap.error("prctl(PR_SET_THP_DISABLE) failed")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import evstore
    from evstore import ops

    n = args.warmup + args.batches
    bt = Batches(args.keys, args.batch, n, args.seed)
    new = [tf.constant(k) for k in bt.new_keys]
    ev = evstore.EmbeddingVariable("bench", dim=args.dim, key_dtype=tf.int64)
    dht = tf.lookup.experimental.DenseHashTable(key_dtype=tf.int64, value_dtype=tf.float32,
                                                default_value=tf.zeros([args.dim]), empty_key=-1, deleted_key=-2)
    for _, _, k in fill_chunks(args.keys, args.fill_chunk):
        rows = tf.random.normal([len(k), args.dim], stddev=0.01)
        ev.load(tf.constant(k), rows)
        dht.insert(tf.constant(k), rows)
    no_proxy, supplied = tf.zeros([0]), tf.random.normal([args.batch, args.dim], stddev=0.01)
    existing = [tf.constant(k) for k in bt.keys]
    phases = {
        "find": {"evstore": lambda i: on_host(ops.ev_find(ev.resource_handle, existing[i], dim=args.dim)),
                 "dense_hash": lambda i: on_host(dht.lookup(existing[i]))},
        "insert": {"evstore": lambda i: on_host(ops.ev_find_or_insert(ev.resource_handle, new[i], no_proxy,
                                                                      dim=args.dim)),
                   "dense_hash": lambda i: dht.insert(new[i], supplied)}}
    times = {}
    for phase, run in phases.items():
        times[phase] = {s: [] for s in run}
        ticks0 = thread_cpu_ticks()
        for i in range(n):
            for s in (list(run) if i % 2 == 0 else list(run)[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                run[s](i)
                if i >= args.warmup:
                    times[phase][s].append((time.perf_counter() - t0, time.process_time() - c0))
        ticks1 = thread_cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    threads = sorted(((ticks1[t] - ticks0.get(t, 0)) / hz for t in ticks1 if ticks1[t] > ticks0.get(t, 0)),
                     reverse=True)
    out = {"keys": args.keys, "dim": args.dim, "batch": args.batch, "batches": args.batches, "thp": not args.no_thp,
           "thread_cpu_s": threads}
    print(f"{args.keys} keys x dim {args.dim}, {args.batches} batches of {args.batch} keys, "
          f"huge pages {'off' if args.no_thp else 'as advised'}; medians per batch")
    print("| phase | system | wall ms | CPU ms (all threads) | M keys/s |\n|---|---|---|---|---|")
    for phase, per_system in times.items():
        for s, v in per_system.items():
            wall, cpu = statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)
            out.setdefault(s, {})[phase] = {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "rate": args.batch / wall,
                                            "wall_cpu_ms": [[round(a * 1e3, 1), round(b * 1e3, 1)] for a, b in v]}
            print(f"| {phase} | {s} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {args.batch / wall / 1e6:.2f} |")
    print("CPU seconds per thread over the insert phase (both systems):", ", ".join(f"{t:.2f}" for t in threads[:6]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
