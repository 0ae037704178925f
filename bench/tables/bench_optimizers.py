"""Optimizer applies: evstore's fused kernels vs TFRA's training path with TF's optimizers.

    .venv/bin/python -m bench.tables.bench_optimizers --keys 1000000 --dim 16 --peer-python .peer-tfra/bin/python

Keys and batches: bench/harness/workload.py (the TFRA peer sees the very same batches).
For each optimizer in turn, one EmbeddingVariable of N keys (ev.load in chunks,
then a committed export so nothing is dirty), and per round i, interleaved
(the order rotates each round):

  fused            evstore.training.sparse_apply_<opt>(ev, IndexedSlices(grads, keys_i), ...):
                   the fused kernel (dedup + one pass over each row and its slots)
  apply_gradients  evstore.optimizers.<Opt>.apply_gradients([(IndexedSlices, ev)]): the
                   Keras 3 path a model uses (non-finite check, step, hyper-parameters, kernel)
  tfra             `de.DynamicEmbeddingOptimizer(tf_keras.optimizers.<Opt>).apply_gradients`
                   of the gradient of sum(embedding(keys_i)) (bench/peers/peer_tfra_optimizers.py;
                   the apply_gradients call alone, its lookup and gradient are not timed)

TFRA has an equivalent for adam, adamw, ftrl, adagrad and sgd; group_adam and
group_adagrad have none (TFPlus' optimizers), so they are shown against TFRA's
Adam / Adagrad as the nearest training path. Each system uses its own optimizer
state; gradients are N(0, 0.01) on our side and ones (d sum / d emb) on TFRA's
(the update's cost does not depend on the values). keys/s = batch / median
seconds. Prints one JSON line (stdout); progress on stderr.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.optimizers import compare, filled_ev, gradient_slices

# ours -> (evstore.optimizers class, sparse_apply function, kwargs, TFRA workload, TFRA equivalent?)
OPTIMIZERS = {
    "sgd": ("SGD", "sparse_apply_sgd", {}, "sgd", True),
    "adagrad": ("Adagrad", "sparse_apply_adagrad", {}, "adagrad", True),
    "adam": ("Adam", "sparse_apply_adam", {}, "adam", True),
    "adamw": ("AdamW", "sparse_apply_adamw", {"weight_decay": 0.004}, "adamw", True),
    "ftrl": ("Ftrl", "sparse_apply_ftrl", {"l1": 1e-4, "l2": 1e-4}, "ftrl", True),
    "group_adam": ("GroupAdam", "sparse_apply_group_adam", {"l1": 1e-4, "l2": 1e-4, "l21": 1e-4}, "adam", False),
    "group_adagrad": ("GroupAdagrad", "sparse_apply_group_adagrad", {"l1": 1e-4, "l2": 1e-4, "l21": 1e-4},
                      "adagrad", False),
}
KERAS_KW = {"l1": "l1_regularization_strength", "l2": "l2_regularization_strength",
            "l21": "l21_regularization_strength"}


class EvstoreOptimizer:
    """One EV filled with N keys, trained by one optimizer."""

    def __init__(self, name, args, bt):
        import tensorflow as tf

        import evstore
        cls_name, fn_name, kw, _, _ = OPTIMIZERS[name]
        self.bt, self.kw = bt, kw
        self.ev = filled_ev(name, args)
        self.fn = getattr(evstore.training, fn_name)
        keras_kw = {KERAS_KW[k]: v for k, v in kw.items() if k in KERAS_KW}
        if name == "ftrl":
            keras_kw = {"l1_regularization_strength": kw["l1"], "l2_regularization_strength": kw["l2"]}
        if name == "adamw":
            keras_kw = dict(kw)
        self.opt = getattr(evstore.optimizers, cls_name)(learning_rate=1e-3, **keras_kw)
        self.slices = gradient_slices(args, bt)
        self.lr = tf.constant(1e-3)

    def run(self, w, i):
        g = self.slices[i % self.bt.count]
        t0 = time.perf_counter()
        if w == "fused":
            self.fn(self.ev, g, self.lr, i + 1, **self.kw)
        elif w == "apply_gradients":
            self.opt.apply_gradients([(g, self.ev)])
        else:
            raise ValueError(w)
        return [time.perf_counter() - t0]

    def slots(self):
        """Slot names in the rows (read through a full export, so only for tables up to 2M keys)."""
        return sorted(self.ev.export()["slots"]) if int(self.ev.size()) <= 2_000_000 else None


def describe(name, ours, res, tfra):
    res["slots"] = ours.slots()
    res["row_bytes_per_key"] = ours.ev.stats()["row_bytes"] / max(1, int(ours.ev.size()))
    return (f"{name}: fused {res.get('fused', 0) / 1e6:.2f} M keys/s, apply_gradients "
            f"{res.get('apply_gradients', 0) / 1e6:.2f} M keys/s")


def main():
    compare(__doc__, OPTIMIZERS, EvstoreOptimizer, ("fused", "apply_gradients"),
            peer_workload=lambda name: "apply_" + OPTIMIZERS[name][3], describe=describe,
            tfra_fields=lambda name: {"equivalent": OPTIMIZERS[name][4]})


if __name__ == "__main__":
    sys.exit(main())
