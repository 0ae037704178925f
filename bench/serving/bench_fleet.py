"""A serving fleet reads only what it serves: bytes a replica
reads per commit, served model quality of the lower-precision serving views,
the trainer's commit time with a view, and three replicas against one.

    .venv/bin/python -m bench.serving.bench_fleet [--batches 600] [--delta-every 40] [--replica-deltas 12]
    .venv/bin/python -m bench.serving.bench_fleet --data examples/data/movielens --skip-replicas \
        --batches 400 --delta-every 20 --warmup 20
    .venv/bin/python -m bench.serving.bench_fleet --root OUT/checkpoints --export OUT/export   # a demo run's

The demo's model and stream (evstore_app/job: SPEC, ClickStream, Trainer) on a
local root. One training run per view (bfloat16, float16, int8), same seed:
after a warm-up and a full, a delta every --delta-every batches; each commit
is applied by two in-process ServingModels of the same export and root, one
reading float32 rows (use_serving_view=False) and one the view. Each batch is
scored by both before it is trained on (progressive AUC, as the demo does).
Reported per view:
  - bytes read per delta: "today" (every file of the commit, what a replica
    verified and downloaded before checkpoint/fetch.py), float32 (only what
    it serves), the view; ratios to today;
  - progressive AUC of float32 serving and of the view, their difference,
    and the max absolute prediction difference;
  - commit time (save_delta) with the view and without it, interleaved in
    the same run (the view switched on for every other delta), medians and
    their ratio.
Replicas: a trainer with a bfloat16 view and 1, then 3, `evstore serve`
processes polling the root every 0.1 s; --replica-deltas deltas each; per
replica the lag commit -> served (its /metrics gauge) p50 / p99 and bytes
fetched per commit. Prints one JSON line.
"""
import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from bench.harness.paths import ROOT
from evstore_app.cluster import stop as stop_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VIEWS = ("bfloat16", "float16", "int8")


def _today_bytes(m):
    """What a replica read of commit `m` before: every file of the commit."""
    return sum(f["size"] for n, f in m.files.items() if not n.startswith("serving."))


def _stream(data, seed):
    """(spec, batch iterator) of the demo's synthetic stream or MovieLens."""
    if data == "demo":
        from evstore_app.job.synthetic import SPEC, ClickStream
        return dict(SPEC), ClickStream(seed=seed, batch_size=SPEC["batch_size"]).batches()
    from evstore_app.job.source import FileStream
    with open(os.path.join(ROOT, "examples", "movielens.json")) as f:
        spec = json.load(f)
    return spec, FileStream(data, spec).batches()


def quality_run(view, batches, delta_every, warmup, seed, data="demo"):
    import serving_loader
    from evstore_app.job.trainer import Trainer, auc

    out = tempfile.mkdtemp(prefix="bench-fleet-")
    root, export = os.path.join(out, "ckpt"), os.path.join(out, "export")
    spec, stream = _stream(data, seed)
    trainer = Trainer(spec, root, seed=seed, serving_view=view, keep_chains=None)
    serving_loader.ensure_serving_export(trainer.model, export)
    for _ in range(warmup):
        b, (cols, y) = next(stream)
        trainer.train(trainer.inputs(cols), y, b + 1)
    trainer.manager.save_full(metadata=trainer.metadata())
    f32 = serving_loader.ServingModel(export, root, use_serving_view=False)
    low = serving_loader.ServingModel(export, root)
    labels, p32, plow = [], [], []
    bytes_today, bytes_f32, bytes_view, t_view, t_plain = [], [], [], [], []
    for i in range(batches):
        try:
            b, (cols, y) = next(stream)
        except StopIteration:   # a finite data set ends
            break
        x = trainer.inputs(cols)
        labels.append(y.reshape(-1))
        p32.append(f32.predict(x)[0]["outputs"].reshape(-1))
        plow.append(low.predict(x)[0]["outputs"].reshape(-1))
        trainer.train(x, y, b + 1)
        if (i + 1) % delta_every == 0:
            k = (i + 1) // delta_every
            trainer.manager.serving_view = view if k % 2 else None   # interleaved: commit time with / without
            t0 = time.perf_counter()
            trainer.manager.save_delta(metadata=trainer.metadata())
            (t_view if k % 2 else t_plain).append(time.perf_counter() - t0)
            m = trainer.manager.history[-1]
            f32.poll()
            low.poll()
            assert f32.version == low.version == m.seq, (f32.version, low.version, m.seq, low.last_error)
            if m.serving_view:
                bytes_today.append(_today_bytes(m))
                bytes_f32.append(f32.last_fetched_bytes)
                bytes_view.append(low.last_fetched_bytes)
    y, a, v = np.concatenate(labels), np.concatenate(p32), np.concatenate(plow)
    today = statistics.mean(bytes_today)
    res = {"data": data if data == "demo" else os.path.basename(data.rstrip("/")), "view": view,
           "deltas_with_view": len(bytes_view),
           "bytes_per_delta": {"today": round(today), "float32": round(statistics.mean(bytes_f32)),
                               view: round(statistics.mean(bytes_view))},
           "ratio_to_today": {"float32": round(statistics.mean(bytes_f32) / today, 3),
                              view: round(statistics.mean(bytes_view) / today, 3)},
           "auc_float32": round(auc(y, a), 5), f"auc_{view}": round(auc(y, v), 5),
           "auc_diff": round(abs(auc(y, a) - auc(y, v)), 5),
           "max_abs_prediction_diff": float(np.abs(a - v).max()),
           "commit_s_median": {"plain": round(statistics.median(t_plain), 4),
                               "with_view": round(statistics.median(t_view), 4)},
           "commit_ratio": round(statistics.median(t_view) / statistics.median(t_plain), 3),
           "examples_scored": int(len(y))}
    f32.stop()
    low.stop()
    return res


def root_bytes(root, export):
    """Bytes a replica of `export` reads per retained delta of an existing
    root (an `evstore demo --serving-view ...` run's `checkpoints`): float32
    rows and, on commits that hold one, the view, each fetched as a replica
    fetches it (served_tensors.plan + checkpoint.fetch), against every file
    of the commit; and, as the peer in the same run, the same reads with the
    filtered keys too (what a replica reads of a delta whose manifest lacks
    deleted_complete, as every delta did before)."""
    from checkpoint import Storage, scan
    from checkpoint.fetch import fetch
    from checkpoint.shards import logical_entries
    from serving_loader import served_tensors

    with open(os.path.join(export, "assets.extra", "evstore_serving.json")) as f:
        mapping = json.load(f)
    storage = Storage(root)
    deltas = [m for m in scan(storage).manifests.values() if m.kind == "delta"]
    today, f32, view, dtypes = [], [], [], set()
    with_filtered = {False: [], True: []}   # the same, also reading the filtered keys (a delta without deleted_complete)
    for m in deltas:
        parts = logical_entries(m)
        served = {n: parts[n] for n in mapping["evs"]}
        for use_view, out in ((False, f32), (True, view)):
            if use_view and not m.serving_view:
                continue
            for mm, o in ((m, out), (dataclasses.replace(m, deleted_complete=False), with_filtered[use_view])):
                plan = served_tensors.plan(mm, served, list(mapping["dense"]), use_view=use_view)
                with fetch(storage, mm, plan.tensors) as t:
                    o.append(t.bytes_read)
        today.append(_today_bytes(m))
        if m.serving_view:
            dtypes.add(m.serving_view["dtype"])
    t = statistics.mean(today)
    res = {"root": root, "deltas": len(deltas), "bytes_per_delta": {"today": round(t), "float32": round(statistics.mean(f32))},
           "ratio_to_today": {"float32": round(statistics.mean(f32) / t, 3)}}
    res["ratio_to_today"]["float32_reading_filtered_keys"] = round(statistics.mean(with_filtered[False]) / t, 3)
    if view:
        name = "/".join(sorted(dtypes))
        res["bytes_per_delta"][name] = round(statistics.mean(view))
        res["ratio_to_today"][name] = round(statistics.mean(view) / t, 3)
        res["ratio_to_today"][name + "_reading_filtered_keys"] = round(statistics.mean(with_filtered[True]) / t, 3)
    return res


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Replica:
    def __init__(self, export, root, log):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--checkpoints", root,
             "--rest_api_port", str(self.port), "--port", "-1", "--model-name", "m", "--poll-every", "0.1"],
            stdout=subprocess.DEVNULL, stderr=log)

    def get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return r.read().decode()

    def version(self):
        try:
            return int(json.loads(self.get("/v1/models/m"))["model_version_status"][0]["version"])
        except OSError:
            return None

    def metrics(self):
        from prometheus_client.parser import text_string_to_metric_families
        return {s.name: s.value for f in text_string_to_metric_families(self.get("/metrics"))
                for s in f.samples if not s.labels}

    def stop(self):
        stop_process(self.proc, grace=30)


def replica_run(n, deltas, delta_batches, seed):
    import serving_loader
    from evstore_app.job.synthetic import SPEC, ClickStream
    from evstore_app.job.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench-fleet-replicas-")
    root, export = os.path.join(out, "ckpt"), os.path.join(out, "export")
    trainer = Trainer(dict(SPEC), root, seed=seed, serving_view="bfloat16")
    serving_loader.ensure_serving_export(trainer.model, export)
    stream = ClickStream(seed=seed, batch_size=SPEC["batch_size"]).batches()

    def train(k):
        for _ in range(k):
            b, (cols, y) = next(stream)
            trainer.train(trainer.inputs(cols), y, b + 1)

    train(60)
    trainer.manager.save_full(metadata=trainer.metadata())
    log = open(os.path.join(out, "replicas.log"), "w")
    reps = [_Replica(export, root, log) for _ in range(n)]
    lags, fetched = [[] for _ in reps], [[] for _ in reps]
    try:
        deadline = time.time() + 300
        while any(r.version() != 1 for r in reps):
            assert time.time() < deadline and all(r.proc.poll() is None for r in reps), "replicas did not start"
            time.sleep(0.1)
        for _ in range(deltas):
            train(delta_batches)
            seq = trainer.manager.save_delta(metadata=trainer.metadata())
            deadline = time.time() + 120
            while any(r.version() != seq for r in reps):
                assert time.time() < deadline, "a replica did not apply the delta"
                time.sleep(0.01)
            for i, r in enumerate(reps):
                s = r.metrics()
                lags[i].append(s["evstore_serving_last_commit_lag_seconds"])
                fetched[i].append(s["evstore_serving_last_commit_fetched_bytes"])
    finally:
        for r in reps:
            r.stop()
        log.close()
    return {"replicas": n, "deltas": deltas,
            "lag_p50_s": [round(float(np.percentile(x, 50)), 3) for x in lags],
            "lag_p99_s": [round(float(np.percentile(x, 99)), 3) for x in lags],
            "fetched_bytes_per_delta": [round(statistics.mean(x)) for x in fetched]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--delta-every", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--replica-deltas", type=int, default=12)
    ap.add_argument("--replica-delta-batches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--views", default=",".join(VIEWS))
    ap.add_argument("--skip-replicas", action="store_true")
    ap.add_argument("--data", default="demo", help="demo (the synthetic stream) or a MovieLens directory "
                    "(examples/movielens.json), e.g. examples/data/movielens")
    ap.add_argument("--root", default=None, help="only measure the bytes per delta of this existing root "
                    "(with --export, e.g. an `evstore demo --serving-view bfloat16` run's checkpoints and export)")
    ap.add_argument("--export", default=None)
    args = ap.parse_args()
    if args.root:
        print(json.dumps(root_bytes(args.root, args.export)))
        return
    res = {"quality": [quality_run(v, args.batches, args.delta_every, args.warmup, args.seed, args.data)
                       for v in args.views.split(",") if v]}
    if not args.skip_replicas:
        res["replicas"] = [replica_run(n, args.replica_deltas, args.replica_delta_batches, args.seed)
                           for n in (1, 3)]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
