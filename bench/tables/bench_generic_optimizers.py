"""Any Keras optimizer on an EV (the generic row path) vs TFRA's training path with the same optimizer.

    .venv/bin/python -m bench.tables.bench_generic_optimizers --keys 1000000 --dim 16 --peer-python .peer-tfra/bin/python

Keys and batches: bench/harness/workload.py (the TFRA peer sees the very same batches).
For each optimizer in turn (RMSprop and Nadam: optimizers evstore does not
fuse), one EmbeddingVariable of N keys (ev.load in chunks, then a committed
export so nothing is dirty), and per round i, interleaved (the order rotates
each round):

  generic          keras.optimizers.<Opt>(1e-3).apply_gradients([(IndexedSlices(grads, keys_i), ev)]),
                   eager: dedup, read rows + slots, Keras's own update_step on the
                   dense slice, write back (evstore/generic.py)
  generic_fn       the same call inside a tf.function (one trace, then one graph run per step)
  tfra             `de.DynamicEmbeddingOptimizer(tf_keras.optimizers.<Opt>(1e-3)).apply_gradients`
                   of the gradient of sum(embedding(keys_i)) (bench/peers/peer_tfra_optimizers.py;
                   the apply_gradients call alone, its lookup and gradient are not timed)

Each system keeps its own optimizer state; gradients are N(0, 0.01) on our
side and ones on TFRA's (the update's cost does not depend on the values).
keys/s = batch / median seconds. Prints one JSON line (stdout); progress on stderr.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.optimizers import compare, filled_ev, gradient_slices

OPTIMIZERS = {"rmsprop": "RMSprop", "nadam": "Nadam"}   # ours -> keras.optimizers class; TFRA workload apply_<ours>


class GenericOptimizer:
    """One EV filled with N keys, trained by a Keras optimizer through the generic path."""

    def __init__(self, name, args, bt):
        import keras
        import tensorflow as tf

        self.bt = bt
        self.ev = filled_ev(name, args)
        self.slices = gradient_slices(args, bt)
        self.opt = getattr(keras.optimizers, OPTIMIZERS[name])(learning_rate=1e-3)
        self.opt_fn = getattr(keras.optimizers, OPTIMIZERS[name])(learning_rate=1e-3)
        ev, opt_fn = self.ev, self.opt_fn

        @tf.function
        def step(values, keys):
            opt_fn.apply_gradients([(tf.IndexedSlices(values, keys), ev)])
        self.step_fn = step

    def run(self, w, i):
        g = self.slices[i % self.bt.count]
        t0 = time.perf_counter()
        if w == "generic":
            self.opt.apply_gradients([(g, self.ev)])
        elif w == "generic_fn":
            self.step_fn(g.values, g.indices)
        else:
            raise ValueError(w)
        return [time.perf_counter() - t0]


def describe(name, ours, res, tfra):
    if tfra:
        res["ratio_vs_tfra"] = {w: res[w] / tfra for w in ("generic", "generic_fn") if w in res}
    res["slots"] = sorted(ours.ev.export()["slots"]) if int(ours.ev.size()) <= 2_000_000 else None
    return (f"{name}: generic {res.get('generic', 0) / 1e6:.2f} M keys/s, tf.function "
            f"{res.get('generic_fn', 0) / 1e6:.2f} M keys/s, tfra {(tfra or 0) / 1e6:.2f} M keys/s")


def main():
    compare(__doc__, OPTIMIZERS, GenericOptimizer, ("generic", "generic_fn"),
            peer_workload=lambda name: "apply_" + name, describe=describe)


if __name__ == "__main__":
    sys.exit(main())
