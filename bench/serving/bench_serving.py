"""Serving benchmark: delta apply throughput, freshness, predict latency under application, memory.

Run with the project venv from the repo root (bench/run.py runs it after the checkpoint bench):

    .venv/bin/python -m bench.serving.bench_serving                       # defaults below, ~3 minutes
    .venv/bin/python -m bench.serving.bench_serving --keys 200000 --delta-rows 100000 --live-s 10   # quick

The served model: ids [batch, 8] int64 -> one EmbeddingVariable "emb" (dim 16
or 64) -> mean over the 8 rows -> Dense(1). Its serving export
(serving_loader.export_serving_model) is written while the table is empty, so
every served row comes from checkpoints. Keys are bench/harness/workload.py's keys.

  apply (per --dims)  --keys rows are loaded into the EV (ev.load) and saved
                      as a full; ServingModel(export, root) loads it (the
                      initial reload, timed). Then --apply-rounds times:
                      --delta-rows existing keys get new values (ev.load marks
                      them dirty) and --delta-deletes keys are removed, a delta
                      is saved (untimed), and ServingModel.poll() applies it.
                      Reported: poll() wall time, stage (verify + read the
                      bundle, no lock) and publish (under the write lock:
                      erase + upsert + dense assign) from the model's own
                      apply_latency_s and a timer around its _publish; rows/s =
                      delta rows / time, median over rounds.
  memory (first dim)  extra RSS of the process while poll() applies a delta,
                      against the extra RSS of loading a second ServingModel of
                      the same export and root (what TF Serving does for a new
                      version: the old one serves until the new one has
                      loaded, so both are resident). Sampled every 2 ms
                      (VmRSS) and the kernel's VmHWM.
  live (dim 16)       a trainer process (this script, --trainer) writes a full
                      of --keys rows, then every --every seconds updates
                      --live-rows random rows and saves a delta. The server
                      side loads the chain and predicts batches of
                      --predict-batch examples at a fixed rate (--predict-hz;
                      open loop: a late request is timed from when it was due,
                      so stalls are not hidden) for --live-s seconds twice:
                      idle (the trainer runs and saves, the model does not
                      poll) and under application (ServingModel.start(every_s=
                      --poll-every) applies every delta as it commits).
                      Freshness = commit -> served per applied delta
                      (ServingModel.freshness_s). After loading, the process
                      runs gc.collect(); gc.freeze() as `evstore serve` does
                      (--no-gc-freeze: without; then full garbage collections
                      of the model's heap, each far longer than a predict,
                      land in either window at random and decide both p99s).
Prints one JSON line (the last line of stdout); progress goes to stderr.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.peers import module_cmd
from bench.harness.timing import open_loop
from bench.harness.workload import make_keys
from bench.harness.rss import PeakRss

IDS_PER_EXAMPLE = 8
CHUNK = 1_000_000
TARGETS = {"apply_rows_per_s": 2e6, "p99_ratio": 2.0}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else None


# ---- the model ---------------------------------------------------------------
def build(dim):
    import keras
    import tensorflow as tf

    import evstore

    ids = keras.Input(shape=(IDS_PER_EXAMPLE,), dtype="int64", name="ids")
    e = evstore.keras.Embedding(dim, name="emb", embeddings_initializer=tf.constant_initializer(0.0))(ids)
    x = keras.layers.GlobalAveragePooling1D()(e)
    out = keras.layers.Dense(1, activation="sigmoid", name="out",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=1))(x)
    model = keras.Model(ids, out)
    model(np.zeros((1, IDS_PER_EXAMPLE), np.int64))   # builds the EV (a read: inserts nothing)
    return model, model.get_layer("emb").ev


def fill(ev, n, dim, seed):
    rng = np.random.default_rng(seed)
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        ev.load(make_keys(np.arange(s, e)), rng.standard_normal((e - s, dim), dtype=np.float32) * 0.1)


def touch(ev, n, rows, deletes, dim, rng):
    """`rows` distinct existing keys get new values; `deletes` others are removed (then reinserted later)."""
    idx = rng.choice(n, size=rows + deletes, replace=False)
    ev.load(make_keys(idx[:rows]), rng.standard_normal((rows, dim), dtype=np.float32) * 0.1)
    if deletes:
        ev.remove(make_keys(idx[rows:]))


def make_job(workdir, n, dim, seed):
    """(model, ev, manager, export dir): an empty-table export, then --keys rows saved as a full."""
    import checkpoint
    from serving_loader import export_serving_model

    model, ev = build(dim)
    export = os.path.join(workdir, f"export-{dim}")
    export_serving_model(model, export)
    fill(ev, n, dim, seed)
    mgr = checkpoint.CheckpointManager(os.path.join(workdir, f"ckpt-{dim}"), model)
    t0 = time.perf_counter()
    mgr.save_full()
    log(f"  full of {n} x {dim} saved in {time.perf_counter() - t0:.2f}s")
    return model, ev, mgr, export


# ---- apply + memory ----------------------------------------------------------
def bench_apply(args, dim, workdir, measure_memory):
    from serving_loader import ServingModel

    log(f"apply: {args.keys} keys x dim {dim}, deltas of {args.delta_rows} rows + {args.delta_deletes} deletes")
    model, ev, mgr, export = make_job(workdir, args.keys, dim, args.seed)
    t0 = time.perf_counter()
    sm = ServingModel(export, mgr.root)
    load_s = time.perf_counter() - t0
    assert sm.version == mgr.last_committed.seq and sm.rows()["emb"] == args.keys, (sm.version, sm.rows())
    publish = []
    orig = sm.publisher._publish_one

    def timed_publish(staged):
        t = time.perf_counter()
        orig(staged)
        publish.append(time.perf_counter() - t)

    sm.publisher._publish_one = timed_publish  # an instance attribute: times the publish step of this model only
    rng = np.random.default_rng(args.seed + dim)
    rounds = []
    mem = None
    for r in range(args.apply_rounds):
        touch(ev, args.keys, args.delta_rows, args.delta_deletes, dim, rng)
        seq = mgr.save_delta()
        n_applied = sm.applied
        if measure_memory and r == args.apply_rounds - 1:
            with PeakRss() as p:
                t = time.perf_counter()
                sm.poll()
                wall = time.perf_counter() - t
            mem = {"delta_apply_extra_mib": p.extra_mib, "rss_start_mib": p.start_mib}
        else:
            t = time.perf_counter()
            sm.poll()
            wall = time.perf_counter() - t
        assert sm.version == seq and sm.applied == n_applied + 1, (sm.version, seq, sm.last_error)
        lat = sm.apply_latency_s[-1]
        rounds.append({"poll_s": wall, "apply_s": lat, "publish_s": publish[-1], "stage_s": lat - publish[-1]})
        log(f"  delta {seq}: poll {wall * 1e3:.0f} ms (stage {rounds[-1]['stage_s'] * 1e3:.0f}, publish "
            f"{publish[-1] * 1e3:.0f}) = {args.delta_rows / lat / 1e6:.2f} M rows/s")
    # the served table equals the trainer's: same keys, same rows
    want = ev.export()
    got_k, got_v = sm.publisher.tables["emb"].export()
    got_k, got_v = got_k.numpy().reshape(-1), got_v.numpy().reshape(-1, dim)
    live = got_k > np.iinfo(np.int64).min + 1
    order_g, order_w = np.argsort(got_k[live]), np.argsort(want["keys"].numpy())
    same = bool(np.array_equal(got_k[live][order_g], want["keys"].numpy()[order_w]) and
                np.array_equal(got_v[live][order_g], want["values"].numpy()[order_w]))
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {"dim": dim, "keys": args.keys, "delta_rows": args.delta_rows, "delta_deletes": args.delta_deletes,
           "rounds": rounds, "median": med, "served_equals_trainer": same,
           "apply_rows_per_s": args.delta_rows / med["apply_s"],
           "publish_rows_per_s": args.delta_rows / med["publish_s"],
           "poll_rows_per_s": args.delta_rows / med["poll_s"],
           "initial_load_s": load_s, "initial_load_rows_per_s": args.keys / load_s}
    if measure_memory:
        with PeakRss() as p:
            t = time.perf_counter()
            second = ServingModel(export, mgr.root)
            reload_s = time.perf_counter() - t
        assert second.version == sm.version
        mem.update({"full_reload_extra_mib": p.extra_mib, "full_reload_s": reload_s,
                    "table_bytes_mib": args.keys * dim * 4 / 2**20})
        out["memory"] = mem
        log(f"  memory: delta apply +{mem['delta_apply_extra_mib']:.0f} MiB, second load (TF Serving reload) "
            f"+{mem['full_reload_extra_mib']:.0f} MiB in {reload_s:.1f}s")
        del second
    sm.stop()
    del sm, model, ev
    return out


# ---- live: trainer process + predicting server ------------------------------
def trainer(args):
    """--trainer: the writer process of the live phase."""
    model, ev, mgr, export = make_job(args.workdir, args.keys, 16, args.seed)
    print("ready", mgr.root, export, flush=True)
    rng = np.random.default_rng(args.seed + 1)
    end = time.time() + args.trainer_s
    nxt = time.time() + args.every
    while time.time() < end:
        touch(ev, args.keys, args.live_rows, args.live_rows // 100, 16, rng)
        time.sleep(max(0.0, nxt - time.time()))
        nxt += args.every
        seq = mgr.save_delta()
        print("saved", seq, flush=True)
    return 0


def predict_loop(sm, seconds, hz, batch, n, rng):
    """Open-loop predicts (common.open_loop); returns (latency from due time, call time) lists."""
    return open_loop(seconds, hz, lambda: {"ids": make_keys(rng.integers(0, n, (batch, IDS_PER_EXAMPLE)))},
                     sm.predict)


def bench_live(args, workdir):
    import logging

    from serving_loader import ServingModel

    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # "skipped: max instances" while a poll applies
    windows = max(1, round(args.live_s / args.window_s))
    log(f"live: trainer updates {args.live_rows} rows every {args.every}s; predicts of {args.predict_batch} at "
        f"{args.predict_hz}/s in {windows} idle and {windows} busy windows of {args.window_s}s, alternating")
    cmd = module_cmd(__spec__.name) + ["--trainer", "--workdir", workdir, "--keys", str(args.keys),
           "--live-rows", str(args.live_rows), "--every", str(args.every), "--seed", str(args.seed),
           "--trainer-s", str(2 * windows * (args.window_s + 1) + 120)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    idle, idle_call, busy, busy_call, fresh, lat, publish, busy_pub = [], [], [], [], [], [], [], []
    try:
        line = proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"trainer did not start (exit {proc.poll()})")
        root, export = line[1], line[2]
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        sm = ServingModel(export, root)
        orig = sm.publisher._publish_one

        def timed_publish(staged):
            t = time.perf_counter()
            orig(staged)
            publish.append(time.perf_counter() - t)

        sm.publisher._publish_one = timed_publish
        rng = np.random.default_rng(args.seed + 2)
        predict_loop(sm, 2.0, args.predict_hz, args.predict_batch, args.keys, rng)   # warm-up
        if not args.no_gc_freeze:   # as `evstore serve` does after loading: full collections skip the model
            gc.collect()
            gc.freeze()
        for w in range(windows):
            for mode in (("idle", "busy") if w % 2 == 0 else ("busy", "idle")):
                if mode == "idle":
                    a, c = predict_loop(sm, args.window_s, args.predict_hz, args.predict_batch, args.keys, rng)
                    idle += a
                    idle_call += c
                    continue
                sm.poll()                   # catch up with the deltas saved during the idle window (untimed)
                first, n_pub = sm.applied, len(publish)
                sm.start(every_s=args.poll_every)
                a, c = predict_loop(sm, args.window_s, args.predict_hz, args.predict_batch, args.keys, rng)
                sm.stop()
                busy += a
                busy_call += c
                k = sm.applied - first
                if k:
                    fresh += sm.freshness_s[-k:]
                    lat += sm.apply_latency_s[-k:]
                busy_pub += publish[n_pub:]
    finally:
        proc.kill()
        proc.wait()
    out = {"live_rows": args.live_rows, "every_s": args.every, "poll_every_s": args.poll_every,
           "predict_batch": args.predict_batch, "predict_hz": args.predict_hz, "windows": windows,
           "gc_freeze": not args.no_gc_freeze,
           "window_s": args.window_s, "deltas_applied": len(fresh), "failures": sm.failures,
           "freshness_p50_s": pct(fresh, 50), "freshness_p99_s": pct(fresh, 99), "freshness_max_s": max(fresh or [0]),
           "apply_p50_s": pct(lat, 50), "publish_max_ms": max(busy_pub or [0]) * 1e3,
           "idle_p50_ms": pct(idle, 50) * 1e3, "idle_p99_ms": pct(idle, 99) * 1e3, "idle_n": len(idle),
           "busy_p50_ms": pct(busy, 50) * 1e3, "busy_p99_ms": pct(busy, 99) * 1e3, "busy_n": len(busy),
           "idle_call_p99_ms": pct(idle_call, 99) * 1e3, "busy_call_p99_ms": pct(busy_call, 99) * 1e3}
    out["p99_ratio"] = out["busy_p99_ms"] / out["idle_p99_ms"]
    log(f"  {len(fresh)} deltas applied; freshness p50 {out['freshness_p50_s']:.3f}s p99 "
        f"{out['freshness_p99_s']:.3f}s; predict p99 idle {out['idle_p99_ms']:.2f} ms, under application "
        f"{out['busy_p99_ms']:.2f} ms ({out['p99_ratio']:.2f}x); longest publish {out['publish_max_ms']:.1f} ms")
    return out


def markdown(res):
    lines = ["### Serving", "", "| dim | keys | delta rows (+deletes) | poll ms | stage ms | publish ms | "
             "apply M rows/s | publish M rows/s | initial load M rows/s | served == trainer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in res["apply"]:
        m = a["median"]
        lines.append(f"| {a['dim']} | {a['keys']:,} | {a['delta_rows']:,} (+{a['delta_deletes']:,}) | "
                     f"{m['poll_s'] * 1e3:.0f} | {m['stage_s'] * 1e3:.0f} | {m['publish_s'] * 1e3:.0f} | "
                     f"{a['apply_rows_per_s'] / 1e6:.2f} | {a['publish_rows_per_s'] / 1e6:.2f} | "
                     f"{a['initial_load_rows_per_s'] / 1e6:.2f} | {a['served_equals_trainer']} |")
    mem = next((a["memory"] for a in res["apply"] if "memory" in a), None)
    if mem:
        lines += ["", f"Memory (dim {res['apply'][0]['dim']}, {res['apply'][0]['keys']:,} keys, "
                      f"{mem['table_bytes_mib']:.0f} MiB of rows): delta apply +{mem['delta_apply_extra_mib']:.0f} MiB "
                      f"RSS; a second load of the same model (TF Serving's reload) +{mem['full_reload_extra_mib']:.0f} "
                      f"MiB in {mem['full_reload_s']:.1f} s."]
    lv = res.get("live")
    if lv:
        lines += ["", f"Live (dim 16, {lv['live_rows']:,} rows per delta every {lv['every_s']} s, polled every "
                      f"{lv['poll_every_s']} s, {lv['deltas_applied']} deltas applied, {lv['failures']} failures, "
                      f"gc.freeze() after load: {lv.get('gc_freeze', False)}): "
                      f"freshness p50 {lv['freshness_p50_s']:.3f} s, p99 {lv['freshness_p99_s']:.3f} s. Predict "
                      f"({lv['predict_batch']} examples, {lv['predict_hz']:.0f}/s open loop, {lv['windows']} idle and "
                      f"{lv['windows']} busy windows of {lv['window_s']:.0f} s alternating) p50/p99 idle "
                      f"{lv['idle_p50_ms']:.2f}/{lv['idle_p99_ms']:.2f} ms, under application "
                      f"{lv['busy_p50_ms']:.2f}/{lv['busy_p99_ms']:.2f} ms (p99 ratio {lv['p99_ratio']:.2f}x); "
                      f"p99 of the call alone idle {lv['idle_call_p99_ms']:.2f} ms, under application "
                      f"{lv['busy_call_p99_ms']:.2f} ms; longest publish (write lock held) "
                      f"{lv['publish_max_ms']:.1f} ms."]
    t = res["targets"]
    lines += ["", f"Targets: apply >= 2 M rows/s at dim 16: {t['apply_dim16']}; predict p99 under application <= "
                  f"2x idle: {t['p99_ratio']}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--dims", default="16,64")
    p.add_argument("--delta-rows", type=int, default=500_000)
    p.add_argument("--delta-deletes", type=int, default=5_000)
    p.add_argument("--apply-rounds", type=int, default=3)
    p.add_argument("--live-rows", type=int, default=20_000, help="rows changed per live delta")
    p.add_argument("--every", type=float, default=2.0, help="seconds between live deltas")
    p.add_argument("--poll-every", type=float, default=0.1)
    p.add_argument("--live-s", type=float, default=30.0, help="seconds of predicts per mode (idle, busy)")
    p.add_argument("--window-s", type=float, default=5.0, help="idle and busy windows alternate every this")
    p.add_argument("--predict-batch", type=int, default=256)
    p.add_argument("--predict-hz", type=float, default=100.0)
    p.add_argument("--no-live", action="store_true")
    p.add_argument("--no-gc-freeze", action="store_true", help="live phase without gc.freeze() after loading")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--trainer-s", type=float, default=120, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer:
        return trainer(args)
    workdir = tempfile.mkdtemp(prefix="bench-serving-", dir=args.dir)
    t0 = time.time()
    try:
        dims = [int(d) for d in args.dims.split(",")]
        res = {"apply": [bench_apply(args, d, workdir, measure_memory=(i == 0)) for i, d in enumerate(dims)]}
        if not args.no_live:
            live_dir = os.path.join(workdir, "live")
            os.makedirs(live_dir)
            res["live"] = bench_live(args, live_dir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    d16 = next((a for a in res["apply"] if a["dim"] == 16), None)
    res["targets"] = {
        "apply_dim16": None if d16 is None else ("met" if d16["apply_rows_per_s"] >= TARGETS["apply_rows_per_s"]
                                                 else "not met"),
        "p99_ratio": None if "live" not in res else ("met" if res["live"]["p99_ratio"] <= TARGETS["p99_ratio"]
                                                     else "not met")}
    res["wall_s"] = time.time() - t0
    res["markdown"] = markdown(res)
    log(res["markdown"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
