"""A `model.fit` job with checkpoint.CheckpointCallback, run as a real process by
test_fit_callback.py: `python fit_job.py ROOT OUT [KILL_EPOCH KILL_STEP]`.

Fits 3 epochs of 12 batches of deterministic input (no shuffling) with a delta
every 4 steps; with KILL_* the process SIGKILLs itself right after training
step KILL_STEP (1-based) of epoch KILL_EPOCH, before any commit of that step.
At the end it writes the final state (EV rows and slots, dense weights,
optimizer iterations) and the callback's `resumed` to OUT (.npz).
"""
import json
import os
import signal
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402

import checkpoint  # noqa: E402

BATCH, STEPS, EPOCHS = 32, 12, 3


def data():
    r = np.random.default_rng(3)
    users = r.integers(0, 400, size=(BATCH * STEPS, 2)).astype(np.int64)
    y = ((users[:, 0] % 3 == 0) | (users[:, 1] % 5 == 0)).astype(np.float32).reshape(-1, 1)
    return users, y


class Kill(keras.callbacks.Callback):
    def __init__(self, epoch, step):
        super().__init__()
        self.epoch, self.step, self.now = epoch, step, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.now = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.now, batch + 1) == (self.epoch, self.step):
            os.kill(os.getpid(), signal.SIGKILL)


def main(root, out, kill=None):
    keras.utils.set_random_seed(0)
    users = keras.Input(shape=(2,), dtype="int64", name="users")
    emb = evstore.keras.Embedding(4, name="user", embeddings_initializer=tf.random_normal_initializer(0, 0.1, seed=1))
    x = keras.layers.Flatten()(emb(users))
    out_layer = keras.layers.Dense(1, activation="sigmoid", name="out",
                                   kernel_initializer=keras.initializers.GlorotUniform(seed=1))
    model = keras.Model(users, out_layer(x))
    model.compile(optimizer=evstore.optimizers.Adam(0.05), loss="binary_crossentropy",
                  metrics=[checkpoint.QualityMetric()])
    cb = checkpoint.CheckpointCallback(root, delta_every=4)
    # The kill goes before the checkpoint callback: it dies after a step, before that step's commit.
    callbacks = ([Kill(*kill)] if kill else []) + [cb]
    u, y = data()
    model.fit(u, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0)
    e = emb.ev.export()
    order = np.argsort(e["keys"].numpy())
    arrays = {"keys": e["keys"].numpy()[order], "values": e["values"].numpy()[order],
              "iterations": int(model.optimizer.iterations.numpy()),
              "resumed": json.dumps(cb.resumed)}
    for name, s in e["slots"].items():
        arrays[f"slot_{name}"] = s.numpy()[order]
    for i, w in enumerate(model.get_weights()):
        arrays[f"w{i}"] = w
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], tuple(int(a) for a in sys.argv[3:5]) if len(sys.argv) > 3 else None)
