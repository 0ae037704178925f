"""A small deterministic training job for checkpoint tests, usable in-process
and as a real subprocess (`python ckpt_model.py ...`, see main()).

Model: two EVs (int64 "user" with CounterFilter(2) and Adam slots, int32
"item"), a dense layer, Keras Adam; batch i is a pure function of i, so two
processes that train the same steps from the same state agree bit for bit.
"""
import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402

import checkpoint  # noqa: E402
from checkpoint.collect import collect  # noqa: E402

BATCH = 64


def make_model(user_shards=None):
    """The test model; `user_shards` makes the "user" table a sharded EV of that many shards."""
    users = keras.Input(shape=(2,), dtype="int64", name="users")
    items = keras.Input(shape=(1,), dtype="int32", name="items")
    bank = np.random.default_rng(7).normal(0, 0.1, size=(64, 8)).astype(np.float32)
    u = evstore.keras.Embedding(8, filter=evstore.CounterFilter(2), name="user", initializer_bank_size=64,
                                embeddings_initializer=tf.constant_initializer(bank), shards=user_shards)(users)
    ibank = np.random.default_rng(8).normal(0, 0.1, size=(32, 4)).astype(np.float32)
    i = evstore.keras.Embedding(4, key_dtype="int32", name="item", initializer_bank_size=32,
                                embeddings_initializer=tf.constant_initializer(ibank))(items)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(u), keras.layers.Flatten()(i)])
    out = keras.layers.Dense(1, activation="sigmoid", name="out",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=1))(x)
    model = keras.Model([users, items], out)
    model.compile(optimizer=evstore.optimizers.Adam(0.05), loss="binary_crossentropy")
    return model


def batch(i):
    r = np.random.default_rng(1000 + i)
    users = np.minimum(r.zipf(1.3, size=(BATCH, 2)), 400).astype(np.int64) + 10 * (i // 5)
    items = r.integers(0, 50, size=(BATCH, 1)).astype(np.int32)
    y = ((users[:, :1] % 3 == 0) ^ (items % 2 == 0)).astype(np.float32)
    return [users, items], y


def train(model, start, stop):
    for i in range(start, stop):
        x, y = batch(i)
        model.train_on_batch(x, y)


def ev(model, name):
    return model.get_layer(name).ev


def state(model, logical=False):
    """Everything a checkpoint must reproduce, as numpy arrays (keys sorted).
    `logical`: a sharded EV as one table (to compare across shard counts)."""
    col = collect(model)
    out = {}
    for name, e in (col.logical_evs() if logical else col.evs).items():
        x = e.export()
        k, f = np.argsort(x["keys"].numpy()), np.argsort(x["filtered_keys"].numpy())
        for n in ("keys", "values", "versions", "freqs"):
            out[f"{name}:{n}"] = x[n].numpy()[k]
        for n in ("filtered_keys", "filtered_freqs"):
            out[f"{name}:{n}"] = x[n].numpy()[f]
        for s, v in x["slots"].items():
            out[f"{name}:slot:{s}"] = v.numpy()[k]
    for name, v in col.dense.items():
        out[f"dense:{name}"] = np.asarray(tf.convert_to_tensor(v))
    return out


def assert_same_state(got, want):
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def save_state(model, path):
    np.savez(path, **state(model))


def load_state(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def probe_inputs():
    """A fixed batch for comparing predictions across processes."""
    users = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [10, 11], [12, 13], [999, 5], [2, 3]], np.int64)
    items = np.array([[1], [2], [3], [4], [5], [6], [7], [8]], np.int32)
    return users, items


def main(argv=None):
    """Subprocess driver. Steps: a JSON list of actions run in order:
      ["train", a, b]         train batches a..b-1
      ["full"|"delta", pos]   save with metadata {"pos": pos}, after dumping the
                              live state to <dump>/live-<seq>.npz
      ["failpoint", name]     set EVSTORE_FAILPOINT for what follows
      ["restore"]             restore the newest chain; prints the metadata
      ["dump", tag]           live state to <dump>/<tag>.npz
      ["sleep", seconds]      wait (lets a server poll between saves)
      ["await", path]         wait until `path` exists (a server has seen a commit), at most 120 s
    """
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("dump")
    p.add_argument("steps")
    a = p.parse_args(argv)
    model = make_model()
    mgr = checkpoint.CheckpointManager(a.root, model)
    for step in json.loads(a.steps):
        op = step[0]
        if op == "train":
            train(model, step[1], step[2])
        elif op in ("full", "delta"):
            latest = mgr.storage.list_dirs()
            nxt = max(latest) + 1 if latest else 1
            save_state(model, os.path.join(a.dump, f"live-{nxt}.npz"))
            np.save(os.path.join(a.dump, f"probe-{nxt}.npy"), model.predict(list(probe_inputs()), verbose=0))
            seq = (mgr.save_full if op == "full" else mgr.save_delta)(metadata={"pos": step[1]})
            assert seq == nxt, (seq, nxt)
            print("saved", seq, flush=True)
        elif op == "failpoint":
            os.environ["EVSTORE_FAILPOINT"] = step[1]
        elif op == "restore":
            print("restored", json.dumps(mgr.restore()), flush=True)
        elif op == "sleep":
            import time
            time.sleep(step[1])
        elif op == "await":
            import time
            deadline = time.time() + 120
            while not os.path.exists(step[1]) and time.time() < deadline:
                time.sleep(0.02)
        elif op == "dump":
            save_state(model, os.path.join(a.dump, f"{step[1]}.npz"))
        else:
            raise ValueError(op)
    return 0


if __name__ == "__main__":
    sys.exit(main())
