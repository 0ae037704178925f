"""Sharded serving: predict latency at batch 1 and 64 of one tiered replica, and of a front over 2 and 4
shards, in the same run, while a delta lands every second; and the bytes each shard reads per delta.

    nice -n 5 .venv/bin/python -m bench.serving.bench_sharded_serving         # ~4 minutes

The model: ids [batch, 8] int64 -> one EV "emb" (--dim) -> mean -> Dense(1), exported with
tables="evstore". Per configuration a chain is written by a writer whose EV has as many shards as the
fleet (1 for the replica; the trainer's route matches, so each shard reads its own part): a full of
--keys rows, then --deltas deltas of --delta-rows rows (Zipf ids) and 1% as many deletions.

  1 host    ServingModel (tiered: --dram-fraction of the rows' bytes in DRAM) in this process;
  N shards  N `evstore serve --shard i/N` processes (each tiered with --dram-fraction of its
            partition's bytes) and a FrontModel in this process.

All configurations are up at once and measured in turns: --rounds rounds, each a window of
--window-s seconds per batch size and configuration (the order rotated each round), of open-loop
predicts (--hz) through `run` (as `evstore serve` calls the model), while that configuration's root
gets the next delta every --every seconds and its model polls every 0.2 s (every delta published on
all shards). Reported per configuration and batch: p50 / p99 (ms,
from each request's due time), deltas published, failures; per configuration the mean bytes read
from the root per delta by the replica / by each shard. The last line is JSON.
"""
import argparse
import gc
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.args import add_numbers
from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd
from bench.harness.timing import open_loop
from bench.harness.workload import make_keys
from bench.tiered.bench_tiered_serving import IDS, Feed, build, freqs, signature


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pct(xs, q):
    return round(float(np.percentile(np.asarray(xs), q)) * 1e3, 3) if len(xs) else None


def add_delta_args(ap, dim):
    """The flags of the deltas `next_delta` writes, which both sharded-serving
    benchmarks serve (this one and bench_sharded_budget)."""
    add_numbers(ap, (("--dim", dim, "embedding dim"),
                     ("--delta-rows", 5_000, "rows per delta (Zipf ids)"),
                     ("--every", 1.0, "seconds between commits landing"),
                     ("--zipf", 1.1, "Zipf exponent of the delta and request ids"),
                     ("--seed", 0, "RNG seed")))


def next_delta(emb, rng, keys, dim, delta_rows, zipf):
    """One delta's changes to EV `emb` of ids 0 .. keys-1: about `delta_rows`
    Zipf-drawn ids get new rows, 1% as many others are removed. Returns (ids
    written, their rows, ids removed)."""
    touched = np.unique((rng.zipf(zipf, size=20 * delta_rows) - 1) % keys)
    idx = rng.choice(touched, size=min(delta_rows, len(touched)), replace=False)
    gone = np.setdiff1d(rng.choice(keys, size=max(1, delta_rows // 100), replace=False), idx)
    rows = rng.standard_normal((len(idx), dim), dtype=np.float32) * 0.1
    emb.load(make_keys(idx), rows, freqs=freqs(idx, zipf))
    emb.remove(make_keys(gone))
    return idx, rows, gone


def write_chain(workdir, shards, keys, dim, deltas, delta_rows, zipf, seed):
    """(export, source root) of a writer whose EV "emb" has `shards` shards."""
    import checkpoint
    from serving_loader import export_serving_model

    model, _ = build(dim, shards=shards)
    export = os.path.join(workdir, "export")
    export_serving_model(model, export, input_signature=signature(), tables="evstore")
    rng = np.random.default_rng(seed)
    idx = np.arange(keys)
    model.emb.load(make_keys(idx), rng.standard_normal((keys, dim), dtype=np.float32) * 0.1, freqs=freqs(idx, zipf))
    mgr = checkpoint.CheckpointManager(os.path.join(workdir, "source"), model)
    mgr.save_full()
    for _ in range(deltas):
        next_delta(model.emb, rng, keys, dim, delta_rows, zipf)
        mgr.save_delta()
    return export, mgr.root


class ShardProcess:
    def __init__(self, export, root, i, n, dram_bytes, tier, log_path, extra=()):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(module_cmd("evstore_app.cli", "serve", "--export", export, "--checkpoints", root,
                                                "--shard", f"{i}/{n}", "--port", 0, "--tiered-dram-bytes", dram_bytes,
                                                "--tier-path", tier, *extra),
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        while True:
            line = lines.get(timeout=300)
            if line.startswith("shard "):
                self.address = f"127.0.0.1:{int(line.rsplit(':', 1)[1])}"
                return

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()


def window(sm, feed, b, seconds, hz, keys, zipf, every, rng):
    """Open-loop predicts of batch `b` for `seconds` while `feed` commits a delta every `every` s and
    `sm` polls every 0.2 s: the latencies (s)."""
    stop = threading.Event()

    def feeder():
        while not stop.wait(every) and feed.next():
            pass

    t = threading.Thread(target=feeder)
    t.start()
    sm.start(every_s=0.2)
    try:
        lat, _ = open_loop(seconds, hz, lambda: {"ids": make_keys((rng.zipf(zipf, size=(b, IDS)) - 1) % keys)},
                           lambda feed_: sm.run(sm.signature, feed_))
    finally:
        stop.set()
        t.join()
        sm.stop()
    return lat


class Config:
    """One configuration: its chain, root, shard processes and model."""

    def __init__(self, n, workdir, args):
        import evstore
        from serving_loader import ServingModel
        from serving_loader.front import FrontModel

        self.n = n
        d = os.path.join(workdir, f"n{n}")
        os.makedirs(d)
        export, source = write_chain(d, n, args.keys, args.dim, args.deltas, args.delta_rows, args.zipf, args.seed)
        self.feed = Feed(source, os.path.join(d, "root"))
        self.feed.next()   # the full
        row_bytes = args.dim * 4
        self.shards = []
        if n == 1:
            self.sm = ServingModel(export, self.feed.dest, storage=evstore.TieredStorage(
                int(args.keys * row_bytes * args.dram_fraction), path=os.path.join(d, "tier")))
        else:
            for i in range(n):
                self.shards.append(ShardProcess(export, self.feed.dest, i, n,
                                                int(args.keys * row_bytes * args.dram_fraction / n), d,
                                                os.path.join(d, f"shard{i}.log")))
            self.sm = FrontModel(export, self.feed.dest, [s.address for s in self.shards])
        self.lat = {}
        self.versions = {}

    def read_bytes(self):
        if self.n == 1:
            return [(self.sm.fetched_bytes_total, self.sm.applied)]
        return [(st["fetched_bytes_total"], st["applied"]) for st, _ in self.sm.fleet.status()]

    def close(self):
        self.sm.close()
        for s in self.shards:
            s.stop()


def run(args):
    """Every configuration up at once; windows interleaved round-robin (the order rotated each round),
    so all of them share the machine's load alike."""
    workdir = tempfile.mkdtemp(prefix="shard-bench-")
    configs = []
    try:
        for n in args.shards:
            configs.append(Config(n, workdir, args))
        rng = np.random.default_rng(args.seed + 1)
        for c in configs:   # warm-up
            open_loop(2.0, 50, lambda: {"ids": make_keys((rng.zipf(args.zipf, size=(1, IDS)) - 1) % args.keys)},
                      lambda f, c=c: c.sm.run(c.sm.signature, f))
        gc.collect()
        before = {c.n: c.read_bytes() for c in configs}
        hz = {1: args.hz, 64: args.hz_64}
        for r in range(args.rounds):
            for b in args.batches:
                for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                    first = c.sm.version
                    c.lat.setdefault(b, []).extend(window(c.sm, c.feed, b, args.window_s, hz[b], args.keys,
                                                          args.zipf, args.every, rng))
                    c.versions.setdefault(b, [first, None])[1] = c.sm.version
        out = {}
        for c in configs:
            after = c.read_bytes()
            per_delta = [(b1 - b0) / max(1, a1 - a0) for (b0, a0), (b1, a1) in zip(before[c.n], after)]
            lat = {b: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99), "n": len(v), "versions": c.versions[b]}
                   for b, v in c.lat.items()}
            out[f"n{c.n}"] = {"latency": lat, "bytes_per_delta": [int(x) for x in per_delta],
                              "failures": c.sm.failures, "last_error": c.sm.last_error,
                              "applied": after[0][1] - before[c.n][0][1]}
            log(f"{c.n} {'host' if c.n == 1 else 'shards'}: " + "; ".join(
                f"batch {b}: p50 {r_['p50_ms']} ms p99 {r_['p99_ms']} ms ({r_['n']} predicts)"
                for b, r_ in lat.items()) + f"; bytes/delta {out[f'n{c.n}']['bytes_per_delta']}; "
                f"failures {c.sm.failures}")
        return out
    finally:
        for c in configs:
            c.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_delta_args(ap, dim=32)
    add_numbers(ap, (("--keys", 200_000, "rows of each configuration's full"),
                     ("--deltas", 40, "deltas written per configuration (>= its windows' s)"),
                     ("--window-s", 5.0, "seconds of one measuring window"),
                     ("--rounds", 3, "windows per configuration and batch size"),
                     ("--hz", 20.0, "predicts per second at batch 1"),
                     ("--hz-64", 10.0, "predicts per second at batch 64"),
                     ("--dram-fraction", 0.1, "a replica's or shard's DRAM / its rows' bytes")))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="1: the single tiered replica")
    args = ap.parse_args()
    import logging

    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    t0 = time.time()
    out = {"keys": args.keys, "dim": args.dim, "delta_rows": args.delta_rows, "every_s": args.every,
           "window_s": args.window_s, "rounds": args.rounds, "hz": args.hz, "hz_64": args.hz_64,
           "load": os.getloadavg()[0]}
    out.update(run(args))
    out["load_after"] = os.getloadavg()[0]
    log(f"({time.time() - t0:.0f} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
