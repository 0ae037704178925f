"""Serving a tiered model: predict latency at batch 1 with 10% of the rows in DRAM, idle and while
deltas apply, against the all-DRAM (stock) export of the same model, in the same run.

    .venv/bin/python -m bench.tiered.bench_tiered_serving                        # 1M keys x 64, ~4 minutes
    .venv/bin/python -m bench.tiered.bench_tiered_serving --keys 10000000 --dir /mnt/ssd/b   # bigger
    .venv/bin/python -m bench.tiered.bench_tiered serving --keys 1000000         # the same, as bench_tiered's mode

The model: ids [batch, 8] int64 -> one EmbeddingVariable "emb" (--dim) -> mean -> Dense(1), exported
twice: the stock export (every row in a DenseHashTable) and `tables="evstore"` served with
`storage=evstore.TieredStorage(dram_bytes=--dram-fraction of the rows' bytes)`.

  chain    a writer EV (all DRAM, or tiered with --writer-dram-bytes for sizes that do not fit)
           gets --keys rows, with the frequencies Zipf(--zipf) ids would give them, saved as a full;
           then --deltas deltas, each giving --delta-rows keys drawn from the same Zipf ids (what a
           stretch of training touches) new values and removing 1% as many random keys (root
           "source").
  serving  each model reads its own root, fed from "source": the full at start, then one delta
           every --every seconds during its "busy" windows (files hard-linked, the manifest last:
           a commit as a writer makes it). Predicts of one example (8 ids drawn from Zipf(--zipf)
           over the keys, the ids CTR models see) at --predict-hz, open loop (a late request is
           timed from when it was due), through ServingModel.run as `evstore serve` calls it.
           Windows of --window-s alternate idle (no polling) and busy (polling every 0.1 s,
           applying each delta as it lands), and the two models alternate too.

Reported per model: p50 / p99 of predict latency idle and busy, deltas applied, apply time
(stage + publish) median, publish time (under the write lock: predictions wait) p50 and max, the tiered table's DRAM hit rate over the idle windows' predicts (a
delta's upserts count as reads too), and the RSS the model added.
`run(...)` is the callable form (tscale's larger runs): it returns the dict printed as the last line.
"""
import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.rss import rss_mib
from bench.harness.timing import open_loop
from bench.harness.workload import make_keys

IDS = 8
CHUNK = 1_000_000


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) * 1e3 if len(xs) else None


def build(dim, storage=None, shards=1, bias=0.0):
    """(model, ev): the model the serving benchmarks serve, a tf.Module: the
    mean of the rows of an example's IDS ids, one dense unit, a sigmoid.
    `storage` makes the writer's EV "emb" tiered, `shards` > 1 a
    ShardedEmbeddingVariable; `bias` is the unit's initial bias."""
    import tensorflow as tf

    import evstore

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            init = tf.zeros_initializer()
            self.emb = (evstore.ShardedEmbeddingVariable("emb", dim, shards=shards, initializer=init) if shards > 1
                        else evstore.EmbeddingVariable("emb", dim, initializer=init, storage=storage))
            self.kernel = tf.Variable(tf.keras.initializers.GlorotUniform(seed=1)([dim, 1]), name="out_kernel")
            self.bias = tf.Variable(tf.constant([float(bias)]), name="out_bias")

        def __call__(self, ids):
            x = tf.reduce_mean(evstore.embedding_lookup(self.emb, ids), axis=1)
            return tf.sigmoid(tf.matmul(x, self.kernel) + self.bias)

    model = Model()
    return model, model.emb


def signature():
    """The served signature: int64 ids [batch, IDS] named "ids"."""
    import tensorflow as tf

    return [tf.TensorSpec([None, IDS], tf.int64, name="ids")]


def freqs(idx, zipf):
    """What training would have counted for key index i: its share of Zipf(zipf) ids, the rank i + 1."""
    return np.maximum(1, np.round(1e6 / (np.asarray(idx, np.float64) + 1) ** zipf)).astype(np.int64)


def write_chain(workdir, keys, dim, deltas, delta_rows, seed, zipf, writer_dram_bytes=None, view=None):
    """Exports (stock, evstore) and the source root: a full of `keys` rows and `deltas` deltas, the rows'
    frequencies those Zipf(zipf) ids would give (the tier's cache policy weighs them); `view`: every
    commit with a serving view of that dtype."""
    import checkpoint
    import evstore
    from serving_loader import export_serving_model

    storage = None
    if writer_dram_bytes:
        storage = evstore.TieredStorage(dram_bytes=writer_dram_bytes, path=os.path.join(workdir, "writer-tier"))
    model, ev = build(dim, storage)
    stock, tables = os.path.join(workdir, "export-stock"), os.path.join(workdir, "export-evstore")
    export_serving_model(model, stock, input_signature=signature())
    export_serving_model(model, tables, input_signature=signature(), tables="evstore")
    rng = np.random.default_rng(seed)
    for s in range(0, keys, CHUNK):
        e = min(keys, s + CHUNK)
        idx = np.arange(s, e)
        ev.load(make_keys(idx), rng.standard_normal((e - s, dim), dtype=np.float32) * 0.1, freqs=freqs(idx, zipf))
    mgr = checkpoint.CheckpointManager(os.path.join(workdir, "source"), model, serving_view=view)
    t0 = time.perf_counter()
    mgr.save_full()
    log(f"  full of {keys} x {dim} saved in {time.perf_counter() - t0:.1f} s")
    deletes = max(1, delta_rows // 100)
    for _ in range(deltas):
        # The keys a stretch of training touched (Zipf ids), and a few cold ones removed (evicted).
        touched = np.unique((rng.zipf(zipf, size=20 * delta_rows) - 1) % keys)
        idx = rng.choice(touched, size=min(delta_rows, len(touched)), replace=False)
        gone = np.setdiff1d(rng.choice(keys, size=deletes, replace=False), idx)
        ev.load(make_keys(idx), rng.standard_normal((len(idx), dim), dtype=np.float32) * 0.1, freqs=freqs(idx, zipf))
        ev.remove(make_keys(gone))
        mgr.save_delta()
    log(f"  {deltas} deltas of {delta_rows} rows (+{deletes} deletions) saved")
    root = mgr.root
    del model, ev, mgr
    gc.collect()
    return stock, tables, root


class Feed:
    """Copies the source root's commits into `dest` one at a time (hard links, manifest last)."""

    def __init__(self, source, dest):
        from checkpoint.manifest import MANIFEST

        self.manifest = MANIFEST
        self.source, self.dest = source, dest
        os.makedirs(dest, exist_ok=True)
        self.pending = sorted((d for d in os.listdir(source) if os.path.exists(os.path.join(source, d, MANIFEST))),
                              key=lambda d: int(d.rsplit("-", 1)[1]))   # by sequence number

    def next(self):
        """Commits the next checkpoint; False when none is left."""
        if not self.pending:
            return False
        d = self.pending.pop(0)
        src, dst = os.path.join(self.source, d), os.path.join(self.dest, d)
        os.makedirs(dst)
        names = sorted(os.listdir(src), key=lambda n: n == self.manifest)
        for n in names:
            os.link(os.path.join(src, n), os.path.join(dst, n))
        return True


def predict_loop(sm, seconds, hz, n, zipf, rng):
    """Open-loop predicts of one example (common.open_loop); latency (s) from each request's due time."""
    return open_loop(seconds, hz, lambda: {"ids": make_keys((rng.zipf(zipf, size=(1, IDS)) - 1) % n)},
                     lambda feed: sm.run(sm.signature, feed))[0]


def run(keys=1_000_000, dim=64, dram_fraction=0.1, deltas=30, delta_rows=20_000, every=1.0, windows=3,
        window_s=5.0, predict_hz=200.0, zipf=1.1, seed=0, workdir=None, writer_dram_bytes=None, peer=True,
        warm=True, view=None):
    """The benchmark; returns its result dict. `peer=False` skips the all-DRAM model (sizes it cannot hold);
    `warm=False` publishes deltas without first reading their rows into the cache (ServingModel._warm)."""
    import logging

    import evstore
    from serving_loader import ServingModel

    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tserve-bench-")
    os.makedirs(workdir, exist_ok=True)
    try:
        stock, tables, source = write_chain(workdir, keys, dim, deltas, delta_rows, seed, zipf, writer_dram_bytes,
                                            view)
        dram_bytes = max(1, int(keys * dim * 4 * dram_fraction))
        rss0 = rss_mib()
        models = {}
        for name in (("tiered", "dram") if peer else ("tiered",)):
            feed = Feed(source, os.path.join(workdir, f"root-{name}"))
            feed.next()   # the full
            t0 = time.perf_counter()
            if name == "tiered":
                sm = ServingModel(tables, feed.dest, storage=evstore.TieredStorage(
                    dram_bytes=dram_bytes, path=os.path.join(workdir, "serve-tier")))
            else:
                sm = ServingModel(stock, feed.dest)
            load_s = time.perf_counter() - t0
            models[name] = {"sm": sm, "feed": feed, "load_s": load_s, "rss_mib": rss_mib() - rss0,
                            "idle": [], "busy": [], "publish": []}

            def timed_publish(staged, orig=sm.publisher._publish_one, out=models[name]["publish"]):   # under the write lock
                t = time.perf_counter()
                orig(staged)
                out.append(time.perf_counter() - t)

            sm.publisher._publish_one = timed_publish
            if not warm:   # the comparison: a delta's rows read from disk under the write lock
                sm.publisher.warm = lambda staged: None
            rss0 = rss_mib()
            log(f"  {name}: loaded the full in {load_s:.1f} s, +{models[name]['rss_mib']:.0f} MiB RSS")
        gc.collect()
        gc.freeze()
        rng = np.random.default_rng(seed + 1)
        for m in models.values():
            predict_loop(m["sm"], 2.0, predict_hz, keys, zipf, rng)   # warm-up (and the tier's hot set)
        reads = {"hits": 0, "misses": 0}   # the tiered table's, during idle windows: predicts only
        for w in range(windows):
            for name, m in (models.items() if w % 2 == 0 else reversed(list(models.items()))):
                sm = m["sm"]
                before = sm.tier_stats().get("emb")
                m["idle"] += predict_loop(sm, window_s, predict_hz, keys, zipf, rng)
                if before is not None:
                    after = sm.tier_stats()["emb"]
                    reads["hits"] += after["cache_hits"] - before["cache_hits"]
                    reads["misses"] += after["cache_misses"] - before["cache_misses"]
                stop = threading.Event()

                def feeder(feed=m["feed"], stop=stop):
                    while not stop.wait(every) and feed.next():
                        pass

                first = sm.applied
                t = threading.Thread(target=feeder)
                t.start()
                sm.start(every_s=0.1)
                m["busy"] += predict_loop(sm, window_s, predict_hz, keys, zipf, rng)
                stop.set()
                t.join()
                sm.stop()
                m.setdefault("applied", []).extend(sm.apply_latency_s[-(sm.applied - first):] if sm.applied > first
                                                   else [])
        out = {"keys": keys, "dim": dim, "dram_fraction": dram_fraction, "dram_bytes": dram_bytes,
               "delta_rows": delta_rows, "every_s": every, "windows": windows, "window_s": window_s,
               "predict_hz": predict_hz, "zipf": zipf, "warm": warm, "view": view or "float32"}
        for name, m in models.items():
            sm = m["sm"]
            r = {"idle_p50_ms": pct(m["idle"], 50), "idle_p99_ms": pct(m["idle"], 99), "idle_n": len(m["idle"]),
                 "busy_p50_ms": pct(m["busy"], 50), "busy_p99_ms": pct(m["busy"], 99), "busy_n": len(m["busy"]),
                 "deltas_applied": len(m.get("applied", [])), "failures": sm.failures,
                 "apply_p50_s": float(np.median(m["applied"])) if m.get("applied") else None,
                 "publish_p50_ms": pct(m["publish"][1:], 50), "publish_max_ms": max(m["publish"][1:] or [0]) * 1e3,
                 "load_s": m["load_s"], "rss_mib": m["rss_mib"]}
            if name == "tiered":
                st = sm.tier_stats()["emb"]
                r.update(idle_hit_rate=reads["hits"] / max(1, reads["hits"] + reads["misses"]),
                         cache_rows=st["cache_rows"], cache_capacity=st["cache_capacity"],
                         disk_bytes=st["disk_bytes"])
            out[name] = r
            sm.close()
        if peer:
            for mode in ("idle", "busy"):
                out[f"{mode}_p99_ratio"] = out["tiered"][f"{mode}_p99_ms"] / out["dram"][f"{mode}_p99_ms"]
        return out
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def add_args(p):
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dram-fraction", type=float, default=0.1, help="share of the rows' bytes in DRAM (0.1)")
    p.add_argument("--deltas", type=int, default=30, help="deltas written for the busy windows (30)")
    p.add_argument("--delta-rows", type=int, default=20_000)
    p.add_argument("--every", type=float, default=1.0, help="seconds between deltas while busy (1)")
    p.add_argument("--windows", type=int, default=3, help="idle + busy window pairs per model (3)")
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--predict-hz", type=float, default=200.0)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a new temp directory, removed)")
    p.add_argument("--writer-dram-bytes", type=int, default=None,
                   help="the chain's writer EV tiered with this budget (sizes whose rows do not fit in DRAM)")
    p.add_argument("--no-peer", action="store_true", help="skip the all-DRAM model (sizes it cannot hold)")
    p.add_argument("--view", choices=["bfloat16", "float16", "int8"], default=None,
                   help="commits with a serving view of this dtype: both models serve it (the tiered one keeps its "
                        "rows in it: more rows in the same --dram-fraction)")
    p.add_argument("--no-warm", action="store_true",
                   help="publish deltas without reading their rows into the cache first (for comparison)")


def main(args):
    t0 = time.time()
    res = run(keys=args.keys, dim=args.dim, dram_fraction=args.dram_fraction, deltas=args.deltas,
              delta_rows=args.delta_rows, every=args.every, windows=args.windows, window_s=args.window_s,
              predict_hz=args.predict_hz, zipf=args.zipf, seed=args.seed, workdir=args.dir,
              writer_dram_bytes=args.writer_dram_bytes, peer=not args.no_peer, warm=not args.no_warm,
              view=args.view)
    log(f"({time.time() - t0:.0f} s)")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    sys.exit(main(ap.parse_args()))
