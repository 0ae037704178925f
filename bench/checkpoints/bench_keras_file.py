""".keras file benchmark: Keras's `model.save` / `keras.models.load_model` of
an evstore table vs a CheckpointManager full save / restore of the same model.

Run with the project venv from the repo root:

    .venv/bin/python -m bench.checkpoints.bench_keras_file                   # 200k keys x dim 16, Adam slots
    .venv/bin/python -m bench.checkpoints.bench_keras_file --keys 20000 --repeats 1   # quick

The model: `evstore.keras.Embedding(--dim)` + Dense, compiled with
evstore's Adam; its table is filled with --keys keys (bench/harness/workload.py's keys)
with values, Adam slots m and v, versions and freqs (`ev.load`). Interleaved,
--repeats times, in one directory under --dir:

  keras save      model.save("m.keras")  (evstore/keras_saving.py: a full
                  bundle per table in a temporary directory, copied into
                  Keras's HDF5 store inside the zip)
  ckpt full       CheckpointManager(root, model).save_full()  (the peer: the
                  same bundle streamed to its final place, fsynced, manifest)
  keras load      keras.models.load_model("m.keras")  (a new model: config,
                  compile, the table replaced and loaded)
  ckpt restore    a new model built in code + CheckpointManager.restore()

Reported: median seconds of each, the ratios keras / ckpt, file bytes, and
the RSS high-water above the RSS before each save and load
(bench/harness/rss.py). Prints one JSON line (the last line of stdout).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import checkpoint
import evstore
from bench.harness.workload import fill_chunks
from bench.harness.rss import PeakRss


def build(dim):
    ids = keras.Input(shape=(1,), dtype="int64")
    emb = evstore.keras.Embedding(dim, name="table")
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.Flatten(name="flat")(emb(ids))))
    model.compile(optimizer=evstore.optimizers.Adam(0.01), loss="mse")
    return model


def fill(model, n, dim, chunk=65536):
    ev = model.get_layer("table").ev
    rng = np.random.default_rng(0)
    for s, e, keys in fill_chunks(n, chunk):
        m = e - s
        ev.load(keys, rng.normal(size=(m, dim)).astype(np.float32),
                versions=np.full(m, 5, np.int64), freqs=np.full(m, 3, np.int64),
                slots={"m": rng.normal(size=(m, dim)).astype(np.float32),
                       "v": rng.random((m, dim)).astype(np.float32)})


def timed_mem(fn):
    with PeakRss() as p:
        t0 = time.perf_counter()
        out = fn()
        secs = time.perf_counter() - t0
    return out, secs, p.peak_mib - p.start_mib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where files go (default: a temporary directory)")
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-keras-", dir=a.dir)
    model = build(a.dim)
    model.predict(np.zeros([1, 1], np.int64), verbose=0)
    fill(model, a.keys, a.dim)
    res = {k: [] for k in ("keras_save", "ckpt_full", "keras_load", "ckpt_restore")}
    mem = {k: [] for k in res}
    sizes = {}
    try:
        for r in range(a.repeats):
            path = os.path.join(base, f"m{r}.keras")
            root = os.path.join(base, f"ckpt{r}")
            _, s, m = timed_mem(lambda: model.save(path))
            res["keras_save"].append(s)
            mem["keras_save"].append(m)
            mgr = checkpoint.CheckpointManager(root, model, lease=False)
            _, s, m = timed_mem(mgr.save_full)
            res["ckpt_full"].append(s)
            mem["ckpt_full"].append(m)
            loaded, s, m = timed_mem(lambda: keras.models.load_model(path))
            res["keras_load"].append(s)
            mem["keras_load"].append(m)
            assert int(loaded.get_layer("table").ev.size()) == a.keys
            del loaded

            def restore():
                fresh = build(a.dim)
                fresh.predict(np.zeros([1, 1], np.int64), verbose=0)
                checkpoint.CheckpointManager(root, fresh, lease=False).restore()
                return fresh
            fresh, s, m = timed_mem(restore)
            res["ckpt_restore"].append(s)
            mem["ckpt_restore"].append(m)
            assert int(fresh.get_layer("table").ev.size()) == a.keys
            del fresh
            sizes = {"keras_file_bytes": os.path.getsize(path),
                     "ckpt_bytes": sum(os.path.getsize(os.path.join(dp, f))
                                       for dp, _, fs in os.walk(root) for f in fs)}
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in res.items()), file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"keys": a.keys, "dim": a.dim, "repeats": a.repeats,
           "median_s": {k: round(v, 4) for k, v in med.items()},
           "ratio_save_keras_over_ckpt": round(med["keras_save"] / med["ckpt_full"], 2),
           "ratio_load_keras_over_ckpt": round(med["keras_load"] / med["ckpt_restore"], 2),
           "peak_extra_rss_mib": {k: round(max(v), 1) for k, v in mem.items()}, **sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
