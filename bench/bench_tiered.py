"""Tiered storage: the disk engine choice and the EV-level figures.

    .venv/bin/python bench/bench_tiered.py engine --keys 1000000 --rounds 3
    .venv/bin/python bench/bench_tiered.py ev --keys 300000 --rounds 2

`engine`: builds bench/tiered_engine_bench.cc (core only, no TensorFlow) and
runs, alternately and each in a fresh process, the same workload on three row
stores: all-DRAM (RowArena), the DRAM cache over RowFile (shipped) and the
same cache over RocksDB (the peer; only where Debian's librocksdb-dev is
installed, found by pkg-config: otherwise the run says so and measures the
other two). dim 64 with Adam (768 bytes a row), a cache budget of
--dram-fraction of the rows' bytes, Zipf(1.1) ids. Prints medians over rounds
and the ratios tiered / all-DRAM and RowFile / RocksDB. `make bench` runs a
short one (bench/run.py, --no-tiered skips it). CPU time per key is the
figure to compare on a shared machine (wall-time rates include waiting for a
core). rss_base_mb is the process before any table, bench_buffers_mb the
benchmark's own arrays, rss_other_mb what remains beyond those and the
table's reported index, metadata and row bytes.

`ev`: the same comparison through TensorFlow: an EmbeddingVariable with
evstore.TieredStorage vs an all-DRAM one, each in its own process: training
lookup + Adam apply rate (and the DRAM hit rate), read-only lookups at batch
1 and 1,024, RSS after training, full save and restore time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


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
           os.path.join(HERE, "tiered_engine_bench.cc"), "-o", out, *extra]
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
              "find1k_keys_per_s", "find1k_p99_ms", "fill_s", "export_s", "export_cpu_s", "rss_mb", "index_mb", "meta_mb", "row_mb", "disk_mb",
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


EV_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, tensorflow as tf
sys.path.insert(0, {root!r})
import evstore, checkpoint
sys.path.insert(0, {here!r})
from peak_rss import rss_mib
kind, nkeys, frac, tier_dir, ckpt = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
DIM, B = 64, 4096
storage = evstore.TieredStorage(dram_bytes=int(frac * nkeys * DIM * 3 * 4), path=tier_dir) if kind == "tiered" else None
ev = evstore.EmbeddingVariable("t", DIM, storage=storage)
opt = evstore.optimizers.Adam(0.001)
keys = (np.arange(nkeys, dtype=np.int64) * 0x9E3779B1) % (1 << 40)
rng = np.random.default_rng(0)
def zipf(n):
    return keys[np.minimum(rng.zipf(1.1, size=n), nkeys) - 1]
# Fill: one training lookup of every key, then slots exist (a first Adam step).
for lo in range(0, nkeys, 65536):
    evstore.embedding_lookup(ev, keys[lo:lo + 65536])
def step():
    ids = zipf(B)
    with tf.GradientTape() as tape:
        e = evstore.embedding_lookup(ev, ids)
        loss = tf.reduce_sum(e * e)
    opt.apply_gradients(zip(tape.gradient(loss, ev.trainable_variables), ev.trainable_variables))
for _ in range(20):
    step()
s0 = ev.stats()
t0 = time.perf_counter()
steps = 100
for _ in range(steps):
    step()
train = steps * B / (time.perf_counter() - t0)
s1 = ev.stats()
acc = (s1["cache_hits"] - s0["cache_hits"]) + (s1["cache_misses"] - s0["cache_misses"])
hit = (s1["cache_hits"] - s0["cache_hits"]) / acc if acc else 1.0
lat1 = []
for _ in range(2000):
    ids = zipf(1)
    a = time.perf_counter(); evstore.embedding_lookup(ev, ids, training=False); lat1.append(time.perf_counter() - a)
lat1k = []
for _ in range(200):
    ids = zipf(1024)
    a = time.perf_counter(); evstore.embedding_lookup(ev, ids, training=False); lat1k.append(time.perf_counter() - a)
rss = rss_mib()
mgr = checkpoint.CheckpointManager(ckpt, {{"t": ev}}, lease=False)
a = time.perf_counter(); mgr.save_full(); save = time.perf_counter() - a
fresh = evstore.EmbeddingVariable("t", DIM, storage=storage)
a = time.perf_counter(); checkpoint.CheckpointManager(ckpt, {{"t": fresh}}, lease=False).restore(); restore = time.perf_counter() - a
st = ev.stats()
print(json.dumps(dict(kind=kind, train_keys_per_s=train, hit_rate=hit, find1_keys_per_s=len(lat1) / sum(lat1),
      find1_p99_us=sorted(lat1)[int(0.99 * len(lat1))] * 1e6, find1k_keys_per_s=1024 * len(lat1k) / sum(lat1k),
      find1k_p99_ms=sorted(lat1k)[int(0.99 * len(lat1k))] * 1e3, rss_mb=rss, save_s=save, restore_s=restore,
      index_mb=st["index_bytes"] / 2**20, meta_mb=st["meta_bytes"] / 2**20, row_mb=st["row_bytes"] / 2**20,
      disk_mb=st["disk_bytes"] / 2**20)))
"""


def ev_level(args):
    script = EV_CHILD.format(root=ROOT, here=HERE)
    runs = {"dram": [], "tiered": []}
    for r in range(args.rounds):
        for kind in (["dram", "tiered"] if r % 2 == 0 else ["tiered", "dram"]):
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                p = subprocess.run(["nice", "-n", "10", sys.executable, "-c", script, kind, str(args.keys),
                                    str(args.dram_fraction), os.path.join(d, "tier"), os.path.join(d, "ckpt")],
                                   capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                sys.exit(f"{kind} failed: {p.stderr[-3000:]}")
            fig = json.loads(p.stdout.strip().splitlines()[-1])
            runs[kind].append(fig)
            print(json.dumps(fig), flush=True)
    fields = ["train_keys_per_s", "hit_rate", "find1_keys_per_s", "find1_p99_us", "find1k_keys_per_s",
              "find1k_p99_ms", "rss_mb", "save_s", "restore_s", "index_mb", "meta_mb", "row_mb", "disk_mb"]
    med = {k: {f: statistics.median(x[f] for x in v) for f in fields} for k, v in runs.items()}
    print(f"\nEV level: {args.keys:,} keys x dim 64 + Adam, DRAM budget {args.dram_fraction:.0%} of row bytes, "
          f"{args.rounds} rounds, medians")
    print("| figure | all-DRAM EV | tiered EV | tiered / all-DRAM |")
    print("|---|---|---|---|")
    for f in fields:
        a, b = med["dram"][f], med["tiered"][f]
        print(f"| {f} | {a:.4g} | {b:.4g} | {b / a:.2f}x |" if a else f"| {f} | {a:.4g} | {b:.4g} | - |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["engine", "ev"])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dram-fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the tier's files go (default: the temp directory)")
    args = ap.parse_args()
    t0 = time.time()
    (engine if args.what == "engine" else ev_level)(args)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
