"""A small Keras model of two evstore tables (admission, eviction, string keys,
an unseeded initializer) for the `.keras` tests, usable in-process and as a
fresh process (`python keras_file_model.py FILE.keras OUT.npz`: load the file
with nothing but `import evstore`, dump the state, train on, dump again).

Batch i is a pure function of i; new ids keep arriving, so training after a
load admits keys (filter counts, Bloom counters), draws new rows (the
initializer bank) and evicts (versions, the clock).
"""
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402

BATCH = 32
TABLES = ("user", "tag")


def make_model(optimizer=None):
    """The model, compiled with `optimizer` (default evstore.optimizers.Adam(0.05))."""
    users = keras.Input(shape=(2,), dtype="int64", name="users")
    tags = keras.Input(shape=(1,), dtype="string", name="tags")
    u = evstore.keras.Embedding(8, filter=evstore.CounterFilter(2), evict=evstore.GlobalStepEvict(3),
                                name="user")(users)          # the default initializer: unseeded
    t = evstore.keras.Embedding(4, key_dtype="string", filter=evstore.BloomFilter(2, capacity=1000),
                                initializer_bank_size=16, default_value=0.5,
                                embeddings_initializer=keras.initializers.RandomUniform(-0.1, 0.1), name="tag")(tags)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(u), keras.layers.Flatten()(t)])
    out = keras.layers.Dense(1, activation="sigmoid", name="out")(x)
    model = keras.Model([users, tags], out)
    model.compile(optimizer=optimizer or evstore.optimizers.Adam(0.05), loss="binary_crossentropy")
    return model


def batch(i):
    r = np.random.default_rng(500 + i)
    users = (np.minimum(r.zipf(1.5, size=(BATCH, 2)), 60) + 7 * i).astype(np.int64)
    tags = tf.constant([[f"tag-{t}".encode()] for t in r.integers(0, 20 + 2 * i, size=BATCH)])
    y = (users[:, :1] % 2 == 0).astype(np.float32)
    return [users, tags], y


def probe():
    """Seen and unseen ids of both tables."""
    users = np.array([[8, 9], [10, 400], [2**40, 11], [15, 16]], np.int64)
    tags = tf.constant([[b"tag-1"], [b"tag-3"], [b"never"], [b"tag-19"]])
    return [users, tags]


def train(model, start, stop):
    for i in range(start, stop):
        x, y = batch(i)
        model.train_on_batch(x, y)
        model.get_layer("user").ev.evict(int(model.optimizer.iterations.numpy()))


def _plain(keys):
    return keys.astype("S") if keys.dtype == object else keys   # string keys: savez without pickles


def dump(model):
    """Everything a trained model is: predictions, every table (rows, slots,
    versions, freqs, filtered keys and counts, stats) and every dense and
    optimizer variable."""
    out = {"predictions": model.predict_on_batch(probe())}
    for name in TABLES:
        ev = model.get_layer(name).ev
        e = ev.export()
        keys = _plain(e["keys"].numpy())
        o = np.argsort(keys, kind="stable")
        out[f"{name}/keys"] = keys[o]
        for field in ("values", "versions", "freqs"):
            out[f"{name}/{field}"] = e[field].numpy()[o]
        for slot, v in e["slots"].items():
            out[f"{name}/slot/{slot}"] = v.numpy()[o]
        fk = _plain(e["filtered_keys"].numpy())
        fo = np.argsort(fk, kind="stable")
        out[f"{name}/filtered_keys"] = fk[fo]
        out[f"{name}/filtered_freqs"] = e["filtered_freqs"].numpy()[fo]
        stats = ev.stats()
        # A BloomFilter's "filtered" is an estimate from a per-process count of
        # admissions, which no checkpoint restore brings back: compared only where exact.
        exact = ("size", "admitted") + (() if isinstance(ev.filter, evstore.BloomFilter) else ("filtered",))
        out[f"{name}/stats"] = np.array([stats[k] for k in exact])
    for v in model.layers[-1].weights:
        out[f"dense/{v.path}"] = v.numpy()
    for v in model.optimizer.variables:
        out[f"optimizer/{v.path}"] = v.numpy()
    return out


def main():
    path, out = sys.argv[1], sys.argv[2]
    start, stop = int(sys.argv[3]), int(sys.argv[4])
    model = keras.models.load_model(path)      # no custom_objects: importing evstore registers its classes
    loaded = dump(model)
    train(model, start, stop)
    trained = dump(model)
    np.savez(out, **{f"loaded:{k}": v for k, v in loaded.items()}, **{f"trained:{k}": v for k, v in trained.items()})
    print("done", flush=True)


if __name__ == "__main__":
    main()
