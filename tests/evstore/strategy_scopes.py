"""What building an EV in each single-process tf.distribute strategy's scope
does, run as its own process (two logical CPU devices must be configured
before TensorFlow starts). Prints one JSON line:

  {"<strategy>": {"built": kind or null, "error": message or null,
                  "layer_error": ..., "max_diff": |fit - fit with no strategy|}}
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import evstore  # noqa: E402


def fit(strategy):
    """A small model trained with model.fit in `strategy`'s scope; the EV's rows by key."""
    r = np.random.default_rng(0)
    x = r.integers(0, 27, size=(64, 3)).astype(np.int64)
    y = r.normal(size=(64, 1)).astype(np.float32)
    with strategy.scope():
        ids = keras.Input(shape=(3,), dtype="int64")
        e = evstore.keras.Embedding(4, name="emb", embeddings_initializer=keras.initializers.RandomNormal(0, .1, seed=3))
        out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
            keras.layers.Flatten()(e(ids)))
        model = keras.Model(ids, out)
        model.compile(optimizer=evstore.optimizers.Adam(0.05), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ex = e.ev.export()
    return ex["values"].numpy()[np.argsort(ex["keys"].numpy())]


def main():
    reference = fit(tf.distribute.get_strategy())
    strategies = {
        "MirroredStrategy(2 devices)": lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
        "MirroredStrategy(1 device)": lambda: tf.distribute.MirroredStrategy(["/cpu:0"]),
        "CentralStorageStrategy(2 devices)": lambda: tf.distribute.experimental.CentralStorageStrategy(
            ["/cpu:0", "/cpu:1"]),
        "OneDeviceStrategy": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    }
    result = {}
    for name, make in strategies.items():
        strategy = make()
        entry = {"built": None, "error": None, "layer_error": None, "max_diff": None}
        try:
            with strategy.scope():
                entry["built"] = type(evstore.EmbeddingVariable("scoped", 2)).__name__
        except ValueError as e:
            entry["error"] = str(e)
        try:
            with strategy.scope():
                evstore.UnshardedEmbeddingVariable("direct", 2)
            entry["direct_error"] = None
        except ValueError as e:
            entry["direct_error"] = str(e)
        try:
            entry["max_diff"] = float(np.abs(fit(strategy) - reference).max())
        except ValueError as e:
            entry["layer_error"] = str(e)
        result[name] = entry
    # A MultiWorkerMirroredStrategy of this one process (no TF_CONFIG): one worker.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    entry = {}
    with strategy.scope():
        entry["built"] = type(evstore.EmbeddingVariable("mw", 2)).__name__
        entry["layer_built"] = type(evstore.keras.Embedding(2, name="mw_layer").ev).__name__
        entry["direct_built"] = type(evstore.UnshardedEmbeddingVariable("mw_direct", 2)).__name__   # one worker
        for what, make in (("shards_error", lambda: evstore.EmbeddingVariable("mw_sharded", 2, shards=2)),
                           ("layer_not_collective_error", lambda: evstore.keras.Embedding(2, collective=False))):
            try:
                make()
                entry[what] = None
            except ValueError as e:
                entry[what] = str(e)
    result["MultiWorkerMirroredStrategy(1 worker)"] = entry
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
