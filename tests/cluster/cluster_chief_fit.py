"""A chief that runs `model.fit` with checkpoint.CheckpointCallback under a
ParameterServerStrategy with a ClusterCoordinator, run as a real subprocess by
test_cluster_fit_callback.py: `python cluster_chief_fit.py --cluster FILE --root ROOT`.

Prints `RESULT <json>`: the table's class, the error `model.fit` raised
(class and message), whether the callback's `on_train_begin` ran, and the
optimizer's step count after it.
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402

import checkpoint  # noqa: E402
from evstore_app.cluster import load_cluster  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(load_cluster(args.cluster)), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        ids = keras.Input(shape=(2,), dtype="int64")
        emb = evstore.keras.Embedding(4, name="user")
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(emb(ids)))
        model = keras.Model(ids, out)
        model.compile(optimizer=evstore.optimizers.Adam(0.05), loss="binary_crossentropy")
    x = np.random.default_rng(0).integers(0, 50, size=(64, 2)).astype(np.int64)
    y = (x[:, :1] % 2 == 0).astype(np.float32)
    result = {"table": type(emb.ev).__name__, "error": None}
    cb = checkpoint.CheckpointCallback(args.root, delta_every=2)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    except Exception as e:  # noqa: BLE001 - the class and message are what the test checks
        result["error"] = [type(e).__name__, str(e)]
    result["began"] = cb.manager is not None
    result["iterations"] = int(model.optimizer.iterations.numpy())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
