"""Tiered storage: the disk engine choice and the EV-level figures.

    .venv/bin/python -m bench.tiered.bench_tiered engine --keys 1000000 --rounds 3
    .venv/bin/python -m bench.tiered.bench_tiered ev --keys 10000000 --dram-mib 768 --rounds 1
    .venv/bin/python -m bench.tiered.bench_tiered ev-pair --keys 3000000 --warmup 100 --steps 200
    .venv/bin/python -m bench.tiered.bench_tiered beyond --keys 17500000 --dim 128 --dram-mib 1536
    .venv/bin/python -m bench.tiered.bench_tiered beyond --keys 10000000 --steps 20 --warmup 10 --rounds 2
    .venv/bin/python -m bench.tiered.bench_tiered serving --keys 1000000   # bench/tiered/bench_tiered_serving.py

`engine`: builds bench/tiered/tiered_engine_bench.cc (core only, no TensorFlow) and
runs, alternately and each in a fresh process, the same workload on three row
stores: all-DRAM (RowArena), the DRAM cache over RowFile (shipped) and the
same cache over RocksDB (the peer; only where Debian's librocksdb-dev is
installed, found by pkg-config: otherwise the run says so and measures the
other two). dim 64 with Adam (768 bytes a row), a cache budget of
--dram-fraction of the rows' bytes, Zipf(1.1) ids. Prints medians over rounds
and the ratios tiered / all-DRAM and RowFile / RocksDB. `make bench` runs a
short one (bench/run.py, --no-tiered skips it). CPU time per key is the
figure to compare on a shared machine (wall-time rates include waiting for a
core). rss_mb is VmRSS, of which rss_file_mb are mapped file pages (for the
tier, the pages of its file that reads mapped: the page cache's, not the
process's own) and rss_anon_mb the process's own; rss_base_mb is the
process's own memory before any table, bench_buffers_mb the benchmark's own
arrays, rss_other_mb what remains of rss_anon_mb beyond those and the
table's reported index, metadata and row bytes.

`ev`: the same comparison through TensorFlow: an EmbeddingVariable with
evstore.TieredStorage vs an all-DRAM one, each in its own process: populate
rate, training lookup + Adam apply rate (and the DRAM hit rate), read-only
lookups at batch 1 and 1,024, RSS against the budget, full save and restore
time, delta size. Each round runs the two children back to back (the first side
alternating) and prints its training ratio by CPU and by wall, each child's CPU
split into user and system time and what the kernel's memory manager did over
its training steps (direct compaction stalls, direct and kswapd reclaim, huge
page faults, dirty pages at the start and the end: bench/harness/vmstat.py);
the verdict on a training target is the median of the rounds' own ratios
(printed last), not one round. `--perf PREFIX` records each child's training
steps with `perf record -g` (PREFIX-<side>-<round>.data).
`beyond`: a tiered table larger than this machine's memory
trains, saves a full, and restores it bit for bit in a new process.
Both: bench/tiered/bench_tiered_ev.py.

`ev-pair`: both EVs in one process, each Zipf batch trained on one and then
the other (the first side alternating), every window timed by CPU (user and
system), wall time and page faults (minor, major); the cleaner thread's CPU
counted on the tiered side; read-only lookups at batch 1,024 alternating
likewise; `--perf PREFIX` records each side's windows with perf.
bench/tiered/bench_tiered_ev_pair.py.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.tiered import bench_tiered_ev, bench_tiered_ev_pair

from bench.harness.paths import ROOT



def build_engine_bench(out):
    """Builds the engine benchmark; returns (command, whether the RocksDB peer is in it)."""
    import importlib.util
    tf_inc = os.path.join(importlib.util.find_spec("tensorflow").submodule_search_locations[0], "include")
    try:
        rocks = subprocess.run(["pkg-config", "--cflags", "--libs", "rocksdb"], capture_output=True, text=True)
        has_rocks = rocks.returncode == 0
    except FileNotFoundError:
        has_rocks = False
    extra = rocks.stdout.split() if has_rocks else ["-DEVSTORE_BENCH_NO_ROCKSDB"]
    cmd = ["g++", "-std=c++17", "-O3", "-pthread", "-I", os.path.join(ROOT, "evstore/native/core"), "-I", tf_inc,
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiered_engine_bench.cc"), "-o", out, *extra]
    subprocess.run(cmd, check=True)
    return " ".join(cmd), has_rocks


def parse(line):
    toks = line.split()
    out = {}
    for k, v in zip(toks[::2], toks[1::2]):
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return out


def engine(args):
    exe = os.path.join(tempfile.gettempdir(), f"tiered_engine_bench-{os.getpid()}")
    cmd, has_rocks = build_engine_bench(exe)
    print("build:", cmd, flush=True)
    if not has_rocks:
        print("RocksDB not found by pkg-config (apt-get install librocksdb-dev): the RocksDB peer is skipped",
              flush=True)
    runs = {"dram": [], "rowfile": [], "rocksdb": []} if has_rocks else {"dram": [], "rowfile": []}
    order = list(runs)
    try:
        for r in range(args.rounds):
            for store in (order if r % 2 == 0 else order[::-1]):
                with tempfile.TemporaryDirectory(dir=args.dir) as d:
                    p = subprocess.run(["nice", "-n", "10", exe, store, str(args.keys), str(args.dram_fraction), d],
                                       capture_output=True, text=True)
                if p.returncode != 0:
                    sys.exit(f"{store} failed: {p.stderr[-2000:]}")
                fig = parse(p.stdout.strip().splitlines()[-1])
                runs[store].append(fig)
                print(json.dumps(fig), flush=True)
    finally:
        if os.path.exists(exe):
            os.unlink(exe)
    fields = ["train_keys_per_s", "train_cpu_ns_per_key", "hit_rate", "find1_keys_per_s", "find1_p99_us",
              "find1k_keys_per_s", "find1k_cpu_ns_per_key", "find1k_p99_ms", "fill_s", "export_s", "export_cpu_s", "cold_export_s", "seq_write_s",
              "seq_read_s", "writebacks", "write_batches", "compacted", "misses", "read_calls", "rss_mb", "rss_anon_mb", "rss_file_mb", "index_mb", "meta_mb", "row_mb", "disk_mb",
              "rss_base_mb", "bench_buffers_mb", "rss_other_mb"]
    med = {s: {f: statistics.median(x[f] for x in v) for f in fields} for s, v in runs.items()}
    print(f"\n{args.keys:,} keys x dim 64 + Adam slots, DRAM budget {args.dram_fraction:.0%} of row bytes, "
          f"{args.rounds} rounds, medians" + ("" if has_rocks else " (RocksDB peer not installed)"))
    ratio = lambda x, y: f"{x / y:.2f}x" if y else "-"  # noqa: E731
    if has_rocks:
        print("| figure | all-DRAM | tiered, RowFile | tiered, RocksDB | RowFile / all-DRAM | RowFile / RocksDB |")
        print("|---|---|---|---|---|---|")
    else:
        print("| figure | all-DRAM | tiered, RowFile | RowFile / all-DRAM |")
        print("|---|---|---|---|")
    for f in fields:
        a, b = med["dram"][f], med["rowfile"][f]
        if has_rocks:
            c = med["rocksdb"][f]
            print(f"| {f} | {a:.4g} | {b:.4g} | {c:.4g} | {ratio(b, a)} | {ratio(b, c)} |")
        else:
            print(f"| {f} | {a:.4g} | {b:.4g} | {ratio(b, a)} |")


def main():
    if sys.argv[1:2] == ["serving"]:   # serving a tiered model: its own script and flags
        from bench.tiered import bench_tiered_serving
        sp = argparse.ArgumentParser(prog="bench_tiered.py serving", description=bench_tiered_serving.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        bench_tiered_serving.add_args(sp)
        sys.exit(bench_tiered_serving.main(sp.parse_args(sys.argv[2:])))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["engine", "ev", "ev-pair", "beyond"])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dram-fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the tier's files go (default: the temp directory)")
    bench_tiered_ev.add_arguments(ap)
    bench_tiered_ev_pair.add_arguments(ap)
    args = ap.parse_args()
    t0 = time.time()
    {"engine": engine, "ev": bench_tiered_ev.ev_level, "ev-pair": bench_tiered_ev_pair.run,
     "beyond": bench_tiered_ev.beyond}[args.what](args)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
