"""A tiny Keras model (`evstore.keras.Embedding(collective=True)` + Dense)
trained by `model.fit`, either by W worker processes under
MultiWorkerMirroredStrategy (each worker the slice of every global batch that
the strategy's DATA auto-sharding gives it) or by one process on the global
batches. test_collective_fit.py runs both and compares.

Usage: python fit_model.py OUT.npz single
       python fit_model.py OUT.npz worker --rank R --ports P0,P1 [--default-collective] [--ckpt ROOT]
           [--fit-ckpt ROOT]
       python fit_model.py OUT.npz restore --ckpt ROOT

--ckpt ROOT (workers): after the fit (and the eviction) every worker commits a
full to ROOT with a SyncCheckpointManager and records its shard as `ck_*`;
`restore` builds the model in one process (no
strategy), restores ROOT into it and writes the table and the Dense layer.

--fit-ckpt ROOT (workers): model.fit, compiled with checkpoint.QualityMetric,
commits with checkpoint.CheckpointCallback(ROOT, delta_every=2) (a
SyncCheckpointManager: the tables are collective), over
--epochs N (default 1); a worker given --kill E,S SIGKILLs itself right after
training step S (1-based) of epoch E, before that step's commit.

--default-collective builds the layer without `collective=` (a strategy's
scope makes it collective, as it makes TF variables mirrored) and records
what `evstore.EmbeddingVariable(...)` builds in the scope.
"""
import argparse
import json
import os
import signal

STEPS = 5
GLOBAL_BATCH = 8
DIM = 4
STEPS_TO_LIVE = 2   # after the fit, keys last updated before step STEPS - 2 are evicted


def examples():
    """ids [STEPS * 8, 3] (one hot id in every example), labels [STEPS * 8, 1]."""
    import numpy as np
    rng = np.random.RandomState(7)
    ids = rng.randint(0, 30, size=(STEPS * GLOBAL_BATCH, 3)).astype(np.int64) * 1000003
    ids[:, 0] = 11
    return ids, rng.uniform(-1, 1, size=(STEPS * GLOBAL_BATCH, 1)).astype(np.float32)


def dataset():
    """Global batches of examples(): ids [8, 3], labels [8, 1]."""
    import tensorflow as tf
    ds = tf.data.Dataset.from_tensor_slices(examples()).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def bank_initializer(shape, dtype):
    import tensorflow as tf
    n = shape[0] * shape[1]
    return tf.reshape(tf.sin(tf.range(n, dtype=tf.float32) * 0.37) * 0.1, shape)


def build(collective, metrics=()):
    import keras

    import evstore
    inp = keras.Input(shape=(3,), dtype="int64")
    emb = evstore.keras.Embedding(DIM, embeddings_initializer=bank_initializer, initializer_bank_size=64,
                                  filter=evstore.CounterFilter(2), evict=evstore.GlobalStepEvict(STEPS_TO_LIVE),
                                  collective=collective, name="table")
    x = keras.layers.Flatten()(emb(inp))
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.1), bias_initializer="zeros")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=evstore.optimizers.Adam(learning_rate=0.05), loss="mse", metrics=list(metrics))
    return model, emb


def kill_after(epoch, step):
    """A callback that SIGKILLs this process after training step `step` (1-based) of `epoch`."""
    import keras

    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch + 1) == (epoch, step):
                os.kill(os.getpid(), signal.SIGKILL)
    return Kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("mode", choices=["single", "worker", "restore"])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ports", default="")
    ap.add_argument("--default-collective", action="store_true")
    ap.add_argument("--fit-ckpt", default=None)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--kill", default=None)
    a = ap.parse_args()
    ports = [p for p in a.ports.split(",") if p]
    if ports:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": a.rank}})
    import numpy as np
    import tensorflow as tf
    if a.mode == "restore":
        import checkpoint
        model, emb = build(collective=False)
        checkpoint.CheckpointManager(a.ckpt, model).restore()
        e = emb.ev.export()
        arrays = {k: e[k].numpy() for k in ("keys", "values", "versions", "freqs", "filtered_keys",
                                            "filtered_freqs")}
        arrays.update({f"slot_{s}": v.numpy() for s, v in e["slots"].items()})
        arrays.update(kernel=model.layers[-1].kernel.numpy(), bias=model.layers[-1].bias.numpy())
        np.savez(a.out, **arrays)
        print("done", flush=True)
        return
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ports else tf.distribute.get_strategy()
    kinds, arrays = {}, {}
    with strategy.scope():
        if a.fit_ckpt:   # each commit's quality: a label is positive above 0.5, the output a score
            import checkpoint
        model, emb = build(collective=None if a.default_collective else bool(ports),
                           metrics=[checkpoint.QualityMetric()] if a.fit_ckpt else [])
        if a.default_collective:
            import evstore
            kinds = {"layer_kind": type(emb.ev).__name__,
                     "raw_kind": type(evstore.EmbeddingVariable("raw", 2)).__name__}
            try:
                evstore.UnshardedEmbeddingVariable("direct", 2)
                kinds["direct_error"] = ""
            except ValueError as e:
                kinds["direct_error"] = str(e)
    callbacks = []
    if a.fit_ckpt:
        import checkpoint
        # the kill goes first: the process dies after a step, before that step's commit
        callbacks += [kill_after(*map(int, a.kill.split(",")))] if a.kill else []
        callbacks.append(checkpoint.CheckpointCallback(a.fit_ckpt, delta_every=2))
    model.fit(dataset(), epochs=a.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    if a.fit_ckpt:
        arrays["manager"] = type(callbacks[-1].manager).__name__
        arrays["resumed"] = json.dumps(callbacks[-1].resumed)
    ev = emb.ev.local if ports else emb.ev
    e = ev.export()
    arrays.update({k: e[k].numpy() for k in ("keys", "values", "versions", "freqs", "filtered_keys",
                                             "filtered_freqs")})
    arrays.update({f"slot_{s}": v.numpy() for s, v in e["slots"].items()})
    evicted = emb.ev.evict(model.optimizer.iterations)   # every worker, at the same global step: its shard
    e = ev.export()
    arrays.update(evicted=int(evicted.numpy()), kept_keys=e["keys"].numpy(), kept_values=e["values"].numpy())
    dense = model.layers[-1]
    arrays.update(kernel=dense.kernel.numpy(), bias=dense.bias.numpy(),
                  iterations=int(model.optimizer.iterations.numpy()))
    if a.ckpt:   # every worker: its shard's part (the chief's with the dense variables), one commit
        import checkpoint.sync
        mgr = checkpoint.sync.SyncCheckpointManager(a.ckpt, model)
        mgr.save_full()   # its eviction at the same global step finds nothing more to evict
        mgr.close()
        e = ev.export()
        arrays.update({f"ck_{k}": e[k].numpy() for k in ("keys", "values", "versions", "freqs", "filtered_keys",
                                                         "filtered_freqs")})
        arrays.update({f"ck_slot_{s}": v.numpy() for s, v in e["slots"].items()})
    if a.default_collective and ports:
        try:
            model.save(os.path.join(os.path.dirname(os.path.abspath(a.out)), f"w{a.rank}.keras"))
            kinds["save_error"] = ""
        except NotImplementedError as e:
            kinds["save_error"] = str(e)
    arrays.update(kinds)
    np.savez(a.out, **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    main()
