"""Peer checkpoint benchmark: TFRA 0.8.1 `dynamic_embedding` saved by tf.train.Checkpoint.

Run ONLY with the peer venv's python (bench/checkpoints/bench_checkpoint.py drives it):

    .peer-tfra/bin/python -m bench.peers.peer_tfra_checkpoint --keys 1000000 --dim 16 --dir /tmp/tfra-ckpt

The table: a `de.keras.layers.Embedding(dim)` (one CPU CuckooHashTable shard)
trained one step by `de.DynamicEmbeddingOptimizer(tf_keras Adam)` so its Adam
slots m and v exist (each a de.Variable with its own table), then the same
--keys keys as bench/harness/workload.py inserted into the parameter table and both slot
tables in chunks. `tf.train.Checkpoint(layer=..., optimizer=...)`:
  save     Checkpoint.write(prefix) (TFRA exports each table's keys and values
           as whole tensors, and TF's saver writes them) + fsync of the written
           files and the directory (TF does not fsync): save_s = write_s + fsync_s.
  restore  Checkpoint.read(prefix) into the same objects, their tables cleared
           first (checked: every table has its rows back).
  memory   extra RSS during each (bench/harness/rss.py).
Prints one JSON line.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.workload import fill_chunks
from bench.harness.rss import PeakRss


def fsync_files(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fill-chunk", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()

    import tensorflow as tf
    import tensorflow_recommenders_addons as tfra
    from tensorflow_recommenders_addons import dynamic_embedding as de
    try:
        import tf_keras as tfk
    except ImportError:  # pragma: no cover
        tfk = tf.keras
    out = {"peer": "tfra", "tfra_version": tfra.__version__, "tf_version": tf.__version__, "keys": args.keys,
           "dim": args.dim}
    layer = de.keras.layers.Embedding(args.dim, initializer=tfk.initializers.RandomNormal(0.0, 0.01, seed=1),
                                      name="bench_emb")
    opt = de.DynamicEmbeddingOptimizer(tfk.optimizers.Adam(1e-3))
    ids = tf.constant([1, 2, 3], tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids))
    tv = layer.trainable_variables
    opt.apply_gradients(zip(tape.gradient(loss, tv), tv))
    slot_tables = [v.params.tables[0] for v in opt.variables() if hasattr(v, "params")]
    if len(slot_tables) != 2:
        raise RuntimeError(f"expected Adam slots m and v as de.Variables, found {len(slot_tables)}")
    tables = [layer.params.tables[0]] + slot_tables
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for s, e, k in fill_chunks(args.keys, args.fill_chunk):
        kt = tf.constant(k)
        for t in tables:
            t.insert(kt, tf.constant(rng.standard_normal((e - s, args.dim), dtype=np.float32) * 0.01))
    out["fill_s"] = time.perf_counter() - t0
    out["sizes"] = [int(t.size()) for t in tables]
    print(f"filled {out['sizes']} in {out['fill_s']:.1f}s", file=sys.stderr, flush=True)

    ck = tf.train.Checkpoint(layer=layer, optimizer=opt)
    os.makedirs(args.dir, exist_ok=True)
    saves, writes, mems, path = [], [], [], None
    for r in range(args.repeats):
        if path:
            for f in glob.glob(path + ".*"):
                os.remove(f)
        with PeakRss() as mem:
            t0 = time.perf_counter()
            path = ck.write(os.path.join(args.dir, f"ckpt{r}"))
            t1 = time.perf_counter()
            files = glob.glob(path + ".*")
            fsync_files(files + [args.dir])
            t2 = time.perf_counter()
        writes.append(t1 - t0)
        saves.append(t2 - t0)
        mems.append(mem.as_dict())
        print(f"save {r}: write {t1 - t0:.2f}s + fsync {t2 - t1:.2f}s, extra {mem.extra_mib:.0f} MiB",
              file=sys.stderr, flush=True)
    out["bytes"] = sum(os.path.getsize(f) for f in glob.glob(path + ".*"))
    out.update(save_s=saves, write_s=writes, save_s_median=statistics.median(saves), mem=mems,
               extra_mib_max=max(m["extra_mib"] for m in mems))
    for t in tables:   # restore into empty tables, so the read must bring every row back
        t.clear()
    with PeakRss() as mem:
        t0 = time.perf_counter()
        ck.read(path).expect_partial()   # the empty shadow variables of the lookup are not matched
        out["restore_s"] = time.perf_counter() - t0
    out["restore_mem"] = mem.as_dict()
    out["sizes_after_restore"] = [int(t.size()) for t in tables]
    if out["sizes_after_restore"] != out["sizes"]:
        raise RuntimeError(f"restore brought back {out['sizes_after_restore']} rows, saved {out['sizes']}")
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
