"""A tiny two-table model trained synchronously by W worker processes
(CollectiveEmbeddingVariables under MultiWorkerMirroredStrategy) or by one
process on the concatenated batches (plain EmbeddingVariables): the scripts
of tests/collective run it and compare.

Usage: python sync_model.py OUT.npz single
       python sync_model.py OUT.npz worker --rank R --ports P0,P1[,...] [--ckpt ROOT]
       python sync_model.py OUT.npz restore --ckpt ROOT [--rank R --ports ...] [--serving DIR]
       --tiered DIR: every table on evstore.TieredStorage under DIR, with a DRAM
       cache of TIERED_ROWS rows (far fewer than a table holds)
"""
import json
import os
import sys

STEPS = 6
GLOBAL_BATCH = 8
DIM_A, DIM_B = 4, 3
TIERED_ROWS = 3


def batch(step, rank, workers):
    """(ids_a [n, 3] int64, ids_b values int32, ids_b row_splits, labels [n]) of one worker."""
    import numpy as np
    rng = np.random.RandomState(100 + step)
    a = rng.randint(0, 40, size=(GLOBAL_BATCH, 3)).astype(np.int64) * 1000003
    a[:, 0] = 7   # one hot id in every example
    lens = rng.randint(0, 3, size=GLOBAL_BATCH)
    b_vals = rng.randint(0, 25, size=int(lens.sum())).astype(np.int32)
    y = rng.uniform(-1, 1, size=GLOBAL_BATCH).astype(np.float32)
    lo, hi = rank * GLOBAL_BATCH // workers, (rank + 1) * GLOBAL_BATCH // workers
    if step == 2 and workers > 1:          # worker 1 has an empty batch, worker 0 all of it
        lo, hi = (0, GLOBAL_BATCH) if rank == 0 else (0, 0)
    if step in (3, 4):   # no ids of table B in the first half of the batch (worker 0), then in none of it
        lens[:GLOBAL_BATCH // 2 if step == 3 else GLOBAL_BATCH] = 0
        b_vals = rng.randint(0, 25, size=int(lens.sum())).astype(np.int32)
    if step == 5:        # an empty batch everywhere
        lo = hi = 0
    splits = np.concatenate([[0], np.cumsum(lens)])
    return (a[lo:hi], b_vals[splits[lo]:splits[hi]], (splits[lo:hi + 1] - splits[lo]).astype(np.int64), y[lo:hi])


def bank_initializer(shape, dtype):
    import tensorflow as tf
    n = shape[0] * shape[1]
    return tf.reshape(tf.sin(tf.range(n, dtype=tf.float32) * 0.37) * 0.1, shape)


class Model:
    """The tables, dense weights and optimizer; `predict` is the forward pass."""

    def __init__(self, collective_tables, tier_dir=None):
        import tensorflow as tf

        import evstore
        from evstore import collective

        def storage(dim):   # rows of dim floats and Adam's two slots
            return None if tier_dir is None else evstore.TieredStorage(dram_bytes=TIERED_ROWS * dim * 3 * 4,
                                                                       path=tier_dir)
        kw_a = dict(initializer=bank_initializer, initializer_bank_size=64, filter=evstore.CounterFilter(2),
                    storage=storage(DIM_A))
        kw_b = dict(initializer=bank_initializer, initializer_bank_size=64, key_dtype=tf.int32,
                    storage=storage(DIM_B))
        make = collective.CollectiveEmbeddingVariable if collective_tables else evstore.EmbeddingVariable
        self.ta = make("table_a", DIM_A, **kw_a)
        self.tb = make("table_b", DIM_B, **kw_b)
        self.evs = [self.ta.local, self.tb.local] if collective_tables else [self.ta, self.tb]   # this worker's
        self.tables = [self.ta, self.tb]   # trained in the ordinary idiom: a collective table like any variable
        self.w = tf.Variable(tf.constant([[0.3], [-0.2], [0.1], [0.05]]), name="w")
        self.v = tf.Variable(tf.constant([[0.2], [0.1], [-0.3]]), name="v")
        self.bias = tf.Variable(tf.constant([0.01]), name="bias")
        self.opt = evstore.optimizers.Adam(learning_rate=0.05)
        if collective_tables:   # slots of the dense weights exist before a restore (EV shards have none in Keras)
            self.opt.build([self.w, self.v, self.bias])

    def checkpointed(self):
        return {"table_a": self.ta, "table_b": self.tb, "w": self.w, "v": self.v, "bias": self.bias,
                "optimizer": self.opt}

    def predict(self, ids_a, b_vals, b_splits, training=True):
        import tensorflow as tf

        import evstore
        ra, rb = evstore.embedding_lookup_group([self.ta, self.tb], [ids_a, b_vals], training=training)
        ea = tf.reduce_mean(ra, axis=1)
        eb = tf.reduce_sum(tf.RaggedTensor.from_row_splits(rb, b_splits), axis=1)
        return tf.squeeze(tf.matmul(ea, self.w) + tf.matmul(eb, self.v), 1) + self.bias

    def step(self, ids_a, b_vals, b_splits, y):
        import tensorflow as tf
        with tf.GradientTape() as tape:
            pred = self.predict(ids_a, b_vals, b_splits)
            loss = tf.reduce_sum(tf.square(pred - y)) / GLOBAL_BATCH
        variables = [*self.tables, self.w, self.v, self.bias]
        grads = tape.gradient(loss, variables)
        self.opt.apply_gradients(zip(grads, variables))
        return loss


def save_npz(out, model, extra=None):
    import numpy as np
    arrays = {"w": model.w.numpy(), "v": model.v.numpy(), "bias": model.bias.numpy(),
              "iterations": int(model.opt.iterations.numpy())}
    for tag, ev in zip(("a", "b"), model.evs):
        e = ev.export()
        for k in ("keys", "values", "versions", "freqs", "filtered_keys", "filtered_freqs"):
            arrays[f"{tag}_{k}"] = e[k].numpy()
        for s, val in e["slots"].items():
            arrays[f"{tag}_slot_{s}"] = val.numpy()
    for tag, ev in zip(("a", "b"), model.evs):   # this process's DRAM cache of each table
        st = ev.stats()
        arrays.update({f"{tag}_{k}": st[k] for k in ("cache_hits", "cache_misses", "cache_rows", "disk_bytes")})
    for tag, table in zip(("a", "b"), (model.ta, model.tb)):   # the whole table, on every worker
        e = table.export()
        for k in ("keys", "values", "versions", "freqs", "filtered_keys", "filtered_freqs"):
            arrays[f"whole_{tag}_{k}"] = e[k].numpy()
        for s, val in e["slots"].items():
            arrays[f"whole_{tag}_slot_{s}"] = val.numpy()
    arrays.update(extra or {})
    np.savez(out, **arrays)


def global_batch(step):
    import numpy as np
    parts = [batch(step, r, 2) for r in range(2)]
    splits = np.concatenate([parts[0][2], parts[1][2][1:] + parts[0][2][-1]])
    return (np.concatenate([parts[0][0], parts[1][0]]), np.concatenate([parts[0][1], parts[1][1]]), splits,
            np.concatenate([parts[0][3], parts[1][3]]))


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("mode", choices=["single", "worker", "restore"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ports", default="")
    ap.add_argument("--ckpt", default=None, help="worker: save a full after step 3 and a delta at the end here; "
                                                 "restore: restore from here")
    ap.add_argument("--serving", default=None, help="restore (one process): export the served model here")
    ap.add_argument("--tiered", default=None, help="the tables' rows on evstore.TieredStorage under this directory")
    a = ap.parse_args()
    ports = [p for p in a.ports.split(",") if p]
    if ports:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": a.rank}})
    workers = max(len(ports), 1)
    import numpy as np
    import tensorflow as tf

    from checkpoint.sync import SyncCheckpointManager

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ports else tf.distribute.get_strategy()
    with strategy.scope():
        model = Model(collective_tables=a.mode != "single", tier_dir=a.tiered)
    sig = [tf.TensorSpec([None, 3], tf.int64, name="ids_a"), tf.TensorSpec([None], tf.int32, name="b_vals"),
           tf.TensorSpec([None], tf.int64, name="b_splits"), tf.TensorSpec([None], tf.float32, name="y")]

    @tf.function(input_signature=sig)
    def train(ids_a, b_vals, b_splits, y):
        return strategy.run(model.step, args=(ids_a, b_vals, b_splits, y))

    mgr = SyncCheckpointManager(a.ckpt, model.checkpointed()) if a.ckpt else None
    extra = {}
    if a.mode == "restore":
        mgr.restore()
        if a.serving:
            extra = export_and_serve(model, a.serving, sig[:3])
    else:
        for step in range(STEPS):
            data = global_batch(step) if a.mode == "single" else batch(step, a.rank, workers)
            train(*[tf.constant(x) for x in data])
            if mgr is not None and step == 2:
                mgr.save_full(metadata={"step": step + 1})
        if mgr is not None:
            mgr.save_delta(metadata={"step": STEPS})
    save_npz(a.out, model, extra)
    print("done", flush=True)


def export_and_serve(model, export_dir, specs):
    """Serving export of the whole tables; returns the model's and the served
    predictions on the batch of every step."""
    import numpy as np
    import tensorflow as tf

    import serving_loader

    class Served(tf.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m
            self.tables, self.weights = [m.ta, m.tb], [m.w, m.v, m.bias]   # tracked: what the export collects

        def __call__(self, x):
            return self.m.predict(*x, training=False)

    served = Served(model)
    serving_loader.export_serving_model(served, export_dir, input_signature=specs)
    loaded = tf.saved_model.load(export_dir)
    want, got = [], []
    for step in range(STEPS):
        ids_a, b_vals, b_splits, _ = global_batch(step)
        want.append(model.predict(tf.constant(ids_a), tf.constant(b_vals), tf.constant(b_splits),
                                  training=False).numpy())
        got.append(loaded.signatures["serving_default"](ids_a=tf.constant(ids_a), b_vals=tf.constant(b_vals),
                                                        b_splits=tf.constant(b_splits))["outputs"].numpy())
    return {"served_want": np.concatenate(want), "served_got": np.concatenate(got)}


if __name__ == "__main__":
    main()
