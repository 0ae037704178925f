"""A model whose index and rows exceed every shard's DRAM and disk budgets, served by a sharded fleet and
kept fresh: answers checked against the chain while deltas (and a second full) land.

    nice -n 5 .venv/bin/python -m bench.serving.bench_sharded_budget       # ~5 minutes

The model: ids [batch, 8] int64 -> one EV "emb" of --keys rows x --dim -> mean -> Dense(1), exported with
tables="evstore"; its writer's EV has --shards shards (the fleet's route, so each shard reads its part).
The chain: a full, --deltas deltas of --delta-rows rows (Zipf ids; 1% as many deletions), a second
full, --deltas more deltas.

The budgets, each a fraction of the model's (all smaller than it):
  DRAM  --dram-fraction of the model's index + rows (its all-DRAM table's accounted bytes); a shard's
        row cache (--tiered-dram-bytes) is --cache-fraction of its partition's rows, and its index
        and metadata take the rest;
  disk  --disk-fraction of the model's row bytes (--tier-disk-bytes), which must hold a shard's served
        partition and, while the second full streams in, the new one.

--shards `evstore serve --shard i/N` processes and a FrontModel in this process. Commits land every
--every seconds; probe predicts (batch --batch of --probe-keys keys, hot and cold) run back to back,
each answer checked against the numpy prediction at the version it names (its rows from the chain).
Reported: per shard, its tables' DRAM (index + metadata + cache) and disk (the tier files), its
partition's row bytes, its peak RSS growth from before its first full to the end (VmHWM - RSS before,
the streamed-full bound; /proc/<pid>/clear_refs resets the peak); the model's; answers checked, mismatches, versions seen, failures. The last
line is JSON.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.args import add_numbers
from bench.harness.workload import make_keys
from bench.serving.bench_sharded_serving import ShardProcess, add_delta_args, next_delta
from bench.tiered.bench_tiered_serving import IDS, Feed, build, freqs, signature

INDEX_BYTES_PER_KEY = 52   # a tiered table's index + metadata per int64 key (docs/guides/tiered-storage.md)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def write_chain(workdir, args, probe_idx):
    """(export, source root, {seq: expected rows of the probe keys}, kernel, bias)."""
    import checkpoint
    from serving_loader import export_serving_model

    dim = args.dim
    model, _ = build(dim, shards=args.shards, bias=0.1)
    export = os.path.join(workdir, "export")
    export_serving_model(model, export, input_signature=signature(), tables="evstore")
    rng = np.random.default_rng(args.seed)
    where = {int(k): j for j, k in enumerate(probe_idx)}
    probe = np.zeros([len(probe_idx), dim], np.float32)

    def put(idx, rows):
        for i, r in zip(idx.tolist(), rows):
            j = where.get(i)
            if j is not None:
                probe[j] = r

    for s in range(0, args.keys, 1_000_000):
        idx = np.arange(s, min(args.keys, s + 1_000_000))
        rows = rng.standard_normal((len(idx), dim), dtype=np.float32) * 0.1
        model.emb.load(make_keys(idx), rows, freqs=freqs(idx, args.zipf))
        put(idx, rows)
    mgr = checkpoint.CheckpointManager(os.path.join(workdir, "source"), model, keep_chains=None)
    expected = {mgr.save_full(): probe.copy()}
    for phase in range(2):
        for _ in range(args.deltas):
            idx, rows, gone = next_delta(model.emb, rng, args.keys, dim, args.delta_rows, args.zipf)
            put(idx, rows)
            put(gone, np.zeros([len(gone), dim], np.float32))
            expected[mgr.save_delta()] = probe.copy()
        if phase == 0:
            expected[mgr.save_full()] = probe.copy()
    return export, mgr.root, expected, model.kernel.numpy(), model.bias.numpy()


def vm(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run(args):
    import logging

    import evstore  # noqa: F401 - the op library
    from serving_loader.front import FrontModel

    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    workdir = tempfile.mkdtemp(prefix="shard-budget-", dir=args.workdir)
    shards, front = [], None
    try:
        rng = np.random.default_rng(args.seed + 7)
        hot = np.arange(args.probe_keys // 2)
        cold = rng.choice(np.arange(args.probe_keys, args.keys), size=args.probe_keys - len(hot), replace=False)
        probe_idx = np.concatenate([hot, cold])
        t0 = time.time()
        export, source, expected, kernel, bias = write_chain(workdir, args, probe_idx)
        log(f"chain of {len(expected)} commits written in {time.time() - t0:.0f} s")
        model_rows = args.keys * args.dim * 4
        model_index = args.keys * INDEX_BYTES_PER_KEY
        dram_budget = int(args.dram_fraction * (model_rows + model_index))
        disk_budget = int(args.disk_fraction * model_rows)
        part_rows = model_rows // args.shards
        cache = int(args.cache_fraction * part_rows)
        feed = Feed(source, os.path.join(workdir, "root"))
        feed.next()   # the first full
        for i in range(args.shards):
            shards.append(ShardProcess(export, feed.dest, i, args.shards, cache, workdir,
                                       os.path.join(workdir, f"shard{i}.log"),
                                       extra=["--tier-disk-bytes", disk_budget]))
        rss0 = []
        for s in shards:   # before any row: the process, TF, the export; the peak counted from here
            with open(f"/proc/{s.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            rss0.append(vm(s.proc.pid, "VmRSS"))
        t0 = time.time()
        front = FrontModel(export, feed.dest, [s.address for s in shards], wait_s=120)
        log(f"fleet serving {front.version} in {time.time() - t0:.1f} s")

        stop, answers, bad, versions = threading.Event(), [0], [], set()
        qrng = np.random.default_rng(args.seed + 9)

        def prober():
            while not stop.is_set():
                pos = qrng.integers(0, len(probe_idx), size=(args.batch, IDS))
                out, version = front.predict({"ids": make_keys(probe_idx[pos])})
                rows = expected[version][pos]
                want = 1 / (1 + np.exp(-(rows.mean(axis=1) @ kernel + bias)))
                if not np.allclose(np.asarray(out["outputs"]), want, rtol=1e-5, atol=1e-6):
                    bad.append(version)
                answers[0] += 1
                versions.add(version)

        th = threading.Thread(target=prober)
        th.start()
        try:
            while feed.next():
                time.sleep(args.every)
                front.poll()
            for _ in range(20):   # the last commit published
                if front.version == max(expected):
                    break
                time.sleep(args.every)
                front.poll()
        finally:
            stop.set()
            th.join()
        status = [st for st, _ in front.fleet.status()]
        per_shard = []
        for s, st, r0 in zip(shards, status, rss0):
            t = st["tables"]["emb"]
            dram = t["index_bytes"] + t["meta_bytes"] + t["cache_rows"] * (args.dim * 4 + 8)
            per_shard.append({"rows": st["rows"]["emb"], "row_bytes": st["row_bytes"], "dram_bytes": dram,
                              "index_meta_bytes": t["index_bytes"] + t["meta_bytes"],
                              "disk_bytes": t["disk_bytes"], "rss_before": r0,
                              "peak_rss_growth": vm(s.proc.pid, "VmHWM") - r0, "version": st["version"]})
        out = {"keys": args.keys, "dim": args.dim, "shards": args.shards, "model_row_bytes": model_rows,
               "model_index_bytes_est": model_index, "dram_budget": dram_budget, "cache_bytes": cache,
               "disk_budget": disk_budget, "commits": len(expected), "answers": answers[0],
               "mismatches": len(bad), "versions_seen": len(versions), "final_version": front.version,
               "last_commit": max(expected), "failures": front.failures, "last_error": front.last_error,
               "per_shard": per_shard}
        for i, p in enumerate(per_shard):
            log(f"shard {i}: {p['rows']:,} rows ({p['row_bytes']:,} B), DRAM {p['dram_bytes']:,} B "
                f"(budget {dram_budget:,}), disk {p['disk_bytes']:,} B (budget {disk_budget:,}), peak RSS growth "
                f"{p['peak_rss_growth']:,} B")
        log(f"model: rows {model_rows:,} B, index ~{model_index:,} B; {answers[0]} answers checked, {len(bad)} "
            f"mismatches, {len(versions)} versions seen, final {front.version} of {max(expected)}, "
            f"failures {front.failures}")
        return out
    finally:
        if front is not None:
            front.close()
        for s in shards:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_delta_args(ap, dim=64)
    add_numbers(ap, (("--keys", 2_000_000, "rows of the model's EV"),
                     ("--shards", 4, "`evstore serve --shard i/N` processes"),
                     ("--deltas", 15, "deltas after each of the two fulls"),
                     ("--dram-fraction", 0.3, "a shard's DRAM budget / the model's"),
                     ("--cache-fraction", 0.1, "a shard's row cache / its partition's rows"),
                     ("--disk-fraction", 0.6, "a shard's disk budget / the model's rows"),
                     ("--probe-keys", 512, "keys the probe predicts draw from, hot and cold"),
                     ("--batch", 16, "examples per probe predict")))
    ap.add_argument("--workdir", default=None, help="parent of the run's directory (default: the temp directory)")
    args = ap.parse_args()
    t0 = time.time()
    out = {"load": os.getloadavg()[0]}
    out.update(run(args))
    out["load_after"] = os.getloadavg()[0]
    log(f"({time.time() - t0:.0f} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
