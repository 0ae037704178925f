"""TFRA chief of bench/cluster/bench_cluster.py: the same PS training with TFRA 0.8.1's `devices=[...]` sharding.

Run ONLY with the peer venv's python (TF 2.16, tf_keras; never import TFRA into the project venv):

    .peer-tfra/bin/python -m bench.peers.peer_tfra_cluster --workers 2 --batch-size 1024 --steps 30

The cluster, the data, the dense part of the model and the measurement are
bench/cluster/cluster_driver.py's (the evstore chief runs the same code); its servers
are bench/cluster/cluster_server.py processes of this venv that import TFRA's
dynamic_embedding (registering its kernels) before starting. Each of the 26
field tables (dim 16) and the wide table (dim 1) is a
`de.keras.layers.Embedding(dim, devices=[every PS])` created under the
strategy scope, as TFRA's movielens-1m-keras-ps demo does: one cuckoo-hash
table per PS device, keys routed by TFRA's default partitioner (key % #PS),
lookups of unique ids (with_unique). Optimizer: de.DynamicEmbeddingOptimizer
(tf_keras.optimizers.legacy.Adam(1e-3)), the one TFRA documents for TF >= 2.11.
Prints one JSON line.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.cluster import cluster_driver
from bench.training.bench_e2e import N_FIELDS
from bench.cluster.cluster_common import emit


def build_tfra(args):
    def build(tf, strategy, ps_devices):
        import tf_keras as tfk
        import tensorflow_recommenders_addons as tfra
        from tensorflow_recommenders_addons import dynamic_embedding as de
        init = tfk.initializers.RandomNormal(0.0, 0.01, seed=args.seed)
        layers = [de.keras.layers.Embedding(args.dim if i < N_FIELDS else 1, initializer=init, devices=ps_devices,
                                            name=f"emb_{i}" if i < N_FIELDS else "wide_emb")
                  for i in range(N_FIELDS + 1)]
        dvars = cluster_driver.dense_variables(tf, args.dim, args.seed)
        opt = de.DynamicEmbeddingOptimizer(tfk.optimizers.legacy.Adam(1e-3))

        def replica_step(ids, dense, labels):
            with tf.GradientTape() as tape:
                rows = [tf.reshape(layers[f](ids[:, f]), [-1, args.dim]) for f in range(N_FIELDS)]
                wide = layers[N_FIELDS](tf.reshape(ids, [-1]))
                loss = cluster_driver.forward(tf, dvars, rows, wide, dense, labels)
            tvars = dvars + [w for layer in layers for w in layer.trainable_weights]
            grads = tape.gradient(loss, tvars)
            opt.apply_gradients(zip(grads, tvars))
            return loss

        def sizes():
            return {"rows_fields": int(sum(int(layer.params.size()) for layer in layers[:N_FIELDS])),
                    "rows_wide": int(layers[N_FIELDS].params.size())}

        shadow = sorted({v.device for layer in layers for v in layer.shadow_impl.as_list()})
        tables = sorted({t.resource_handle.device for layer in layers for t in list(layer.params._tables)})
        return replica_step, {"placement": "tfra devices=[all PS] (key % #PS)", "tfra_version": tfra.__version__,
                              "shadow_variable_devices": shadow, "table_devices": tables,
                              "optimizer": "de.DynamicEmbeddingOptimizer(tf_keras legacy Adam)", "sizes": sizes}
    return build


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    cluster_driver.add_args(ap)
    args = ap.parse_args()
    emit(cluster_driver.run(args, "tfra", sys.executable, build_tfra(args)))


if __name__ == "__main__":
    sys.exit(main())
