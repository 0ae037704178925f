"""Chief of the serving-view PS job of test_cluster_s3 (a subprocess, so the test process never
connects its eager context to a cluster): one EV of 2 shards over the cluster's 2 PS, a full and a
delta with an int8 serving view to `--root`, the same full to the local `--local` root.

Usage: `python cluster_chief_view.py --cluster FILE --root s3://... --local DIR`; prints
`RESULT {"full": seq, "delta": seq, "local_full": seq}`."""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402
import checkpoint  # noqa: E402
from evstore_app.cluster import load_cluster  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--local", required=True)
    args = p.parse_args()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(load_cluster(args.cluster)), task_type="chief", task_id=0, rpc_layer="grpc")
    with tf.distribute.experimental.ParameterServerStrategy(resolver).scope():
        ev = evstore.EmbeddingVariable("emb", dim=8, shards=2)
    rng = np.random.default_rng(0)

    def load(keys):
        ev.load(tf.constant(keys, tf.int64), rng.normal(size=(len(keys), 8)).astype(np.float32),
                versions=np.zeros(len(keys), np.int64), freqs=np.ones(len(keys), np.int64))

    load(np.arange(2000))
    s3 = checkpoint.CheckpointManager(args.root, {"emb": ev}, serving_view="int8")
    local = checkpoint.CheckpointManager(args.local, {"emb": ev}, serving_view="int8", lease=False)
    full = s3.save_full()
    local_full = local.save_full()   # the same rows (a full writes every key)
    load(np.arange(0, 2000, 7))
    delta = s3.save_delta()
    s3.close()
    local.close()
    print("RESULT " + json.dumps({"full": full, "delta": delta, "local_full": local_full}), flush=True)


if __name__ == "__main__":
    main()
