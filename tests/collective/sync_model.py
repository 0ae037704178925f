"""A tiny two-table model trained synchronously by W worker processes
(CollectiveEmbeddingVariables under MultiWorkerMirroredStrategy) or by one
process on the concatenated batches (plain EmbeddingVariables): the scripts
of tests/collective run it and compare.

Usage: python sync_model.py OUT.npz single
       python sync_model.py OUT.npz worker RANK PORT,PORT,...
"""
import json
import os
import sys

STEPS = 6
GLOBAL_BATCH = 8
DIM_A, DIM_B = 4, 3


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


def main():
    out, mode = sys.argv[1], sys.argv[2]
    rank, workers = 0, 1
    if mode == "worker":
        rank, ports = int(sys.argv[3]), sys.argv[4].split(",")
        workers = len(ports)
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf

    import evstore
    from evstore import collective

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if mode == "worker" else tf.distribute.get_strategy()
    kw_a = dict(initializer=bank_initializer, initializer_bank_size=64, filter=evstore.CounterFilter(2))
    kw_b = dict(initializer=bank_initializer, initializer_bank_size=64, key_dtype=tf.int32)
    with strategy.scope():
        if mode == "worker":
            ta = collective.CollectiveEmbeddingVariable("table_a", DIM_A, **kw_a)
            tb = collective.CollectiveEmbeddingVariable("table_b", DIM_B, **kw_b)
            evs = [ta.local, tb.local]
        else:
            ta = evstore.EmbeddingVariable("table_a", DIM_A, **kw_a)
            tb = evstore.EmbeddingVariable("table_b", DIM_B, **kw_b)
            evs = [ta, tb]
        w = tf.Variable(tf.constant([[0.3], [-0.2], [0.1], [0.05]]), name="w")
        v = tf.Variable(tf.constant([[0.2], [0.1], [-0.3]]), name="v")
        bias = tf.Variable(tf.constant([0.01]), name="bias")
        opt = evstore.optimizers.Adam(learning_rate=0.05)

    def step_fn(ids_a, b_vals, b_splits, y):
        with tf.GradientTape() as tape:
            ra, rb = evstore.embedding_lookup_group([ta, tb], [ids_a, b_vals])
            ea = tf.reduce_mean(ra, axis=1)
            eb = tf.reduce_sum(tf.RaggedTensor.from_row_splits(rb, b_splits), axis=1)
            pred = tf.squeeze(tf.matmul(ea, w) + tf.matmul(eb, v), 1) + bias
            loss = tf.reduce_sum(tf.square(pred - y)) / GLOBAL_BATCH
        variables = [*evs, w, v, bias]
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    sig = [tf.TensorSpec([None, 3], tf.int64), tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int64),
           tf.TensorSpec([None], tf.float32)]

    @tf.function(input_signature=sig)
    def train(ids_a, b_vals, b_splits, y):
        return strategy.run(step_fn, args=(ids_a, b_vals, b_splits, y))

    for step in range(STEPS):
        if mode == "worker":
            train(*[tf.constant(x) for x in batch(step, rank, workers)])
        else:
            parts = [batch(step, r, 2) for r in range(2)]
            splits = np.concatenate([parts[0][2], parts[1][2][1:] + parts[0][2][-1]])
            train(tf.constant(np.concatenate([parts[0][0], parts[1][0]])),
                  tf.constant(np.concatenate([parts[0][1], parts[1][1]])), tf.constant(splits),
                  tf.constant(np.concatenate([parts[0][3], parts[1][3]])))
    arrays = {"w": w.numpy(), "v": v.numpy(), "bias": bias.numpy(), "iterations": int(opt.iterations.numpy())}
    for tag, ev in zip(("a", "b"), evs):
        e = ev.export()
        for k in ("keys", "values", "versions", "freqs", "filtered_keys", "filtered_freqs"):
            arrays[f"{tag}_{k}"] = e[k].numpy()
        for s, val in e["slots"].items():
            arrays[f"{tag}_slot_{s}"] = val.numpy()
    np.savez(out, **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    main()
