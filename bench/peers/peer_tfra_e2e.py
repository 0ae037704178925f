"""Peer worker of bench/training/bench_e2e.py: the same wide & deep training on TFRA 0.8.1 dynamic_embedding.

Run ONLY with the peer venv's python (TF 2.16, tf_keras; never import TFRA into the project venv):

    .peer-tfra/bin/python -m bench.peers.peer_tfra_e2e --mode keras --batch-size 1024 --steps 30 --warmup 5

Data, model builder and timing loop are bench_e2e.py's (imported; that module
needs only numpy at import time), so the batches and the architecture are the
ones the evstore and TF-hashing workers train. Here each embedding is a
`de.keras.layers.Embedding` (one CPU cuckoo-hash `de.Variable` per field, dim
16; the wide part one of dim 1), the model is a tf_keras functional model and
the optimizer `de.DynamicEmbeddingOptimizer(tf_keras.optimizers.legacy.Adam(1e-3))`
for every variable: the legacy (OptimizerV2) Adam that TFRA documents for
TF >= 2.11 (`--tfra-optimizer new` takes tf_keras.optimizers.Adam instead;
its first step traces for minutes and its steps run several times slower, so
the legacy one is TFRA's fair configuration).
Modes: `keras` = model.train_on_batch, `step` = a tf.function GradientTape step with optimizer.apply_gradients. Prints one JSON
line (examples/s, losses, peak RSS = VmHWM, table sizes).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.harness.rss import hwm_mib, rss_mib
from bench.training.bench_e2e import N_FIELDS, build_wide_deep, model_inputs, run_steps, start_worker, worker_args


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    worker_args(ap)
    ap.add_argument("--tfra-optimizer", choices=("legacy", "new"), default="legacy",
                    help="tf_keras Adam wrapped by de.DynamicEmbeddingOptimizer (default legacy)")
    args = ap.parse_args()
    t0, _, raw, data_s, tfk, rss0, init = start_worker(args, "tf_keras")
    import tensorflow as tf
    import tensorflow_recommenders_addons as tfra
    from tensorflow_recommenders_addons import dynamic_embedding as de
    layers = {}

    def field(i, name):
        layers[name] = de.keras.layers.Embedding(args.dim, initializer=init, name=name)
        return layers[name]

    def wide(name):
        layers[name] = de.keras.layers.Embedding(1, initializer=init, name=name)
        return layers[name]

    model = build_wide_deep(tfk, field, wide, N_FIELDS, args.dim, seed=args.seed)
    adam = tfk.optimizers.legacy.Adam if args.tfra_optimizer == "legacy" else tfk.optimizers.Adam
    opt = de.DynamicEmbeddingOptimizer(adam(1e-3))
    model.compile(optimizer=opt, loss="binary_crossentropy")
    build_s = time.perf_counter() - t0 - data_s
    batches = [({k: tf.constant(v) for k, v in model_inputs(ids, dense).items()}, tf.constant(y))
               for ids, dense, y in raw]
    if args.mode == "keras":
        def step_fn(x, y):
            return model.train_on_batch(x, y)
    else:
        bce = tfk.losses.BinaryCrossentropy()

        @tf.function
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = bce(y, model(x, training=True))
            tvars = model.trainable_variables
            grads = tape.gradient(loss, tvars)
            opt.apply_gradients(zip(grads, tvars))
            return loss

    res = run_steps(step_fn, batches, args.warmup, args.steps, args.batch_size)
    res.update({"system": "tfra", "mode": args.mode, "tf_version": tf.__version__,
                "tfra_version": tfra.__version__, "keras_version": tfk.__version__,
                "optimizer": type(opt).__module__ + "." + type(opt).__name__,
                "build_s": build_s, "data_s": data_s, "rss_after_build_mib": rss0,
                "peak_rss_mib": hwm_mib(), "rss_end_mib": rss_mib()})
    res["table_rows"] = int(sum(int(layers[f"emb_{i}"].params.size()) for i in range(N_FIELDS)))
    res["wide_rows"] = int(layers["wide_emb"].params.size())
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    sys.exit(main())
