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
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.args import add_size_args
from bench.harness.rss import rss_mib
from bench.harness.timing import rate
from bench.harness.workload import Batches, fill_chunks

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


def progress(msg):
    print(f"[bench_optimizers {time.strftime('%H:%M:%S')}] {msg} (rss {rss_mib():.0f} MiB)", file=sys.stderr,
          flush=True)


class EvstoreOptimizer:
    """One EV filled with N keys, trained by one optimizer."""

    def __init__(self, name, args, bt, tf):
        import evstore
        cls_name, fn_name, kw, _, _ = OPTIMIZERS[name]
        self.tf, self.bt, self.kw = tf, bt, kw
        self.ev = evstore.EmbeddingVariable(f"bench_{name}", dim=args.dim, key_dtype=tf.int64)
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            self.ev.load(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
        sid, _, _ = self.ev.begin_export()
        self.ev.commit_export(sid)
        self.fn = getattr(evstore.training, fn_name)
        keras_kw = {KERAS_KW[k]: v for k, v in kw.items() if k in KERAS_KW}
        if name == "ftrl":
            keras_kw = {"l1_regularization_strength": kw["l1"], "l2_regularization_strength": kw["l2"]}
        if name == "adamw":
            keras_kw = dict(kw)
        self.opt = getattr(evstore.optimizers, cls_name)(learning_rate=1e-3, **keras_kw)
        grads = tf.random.normal([args.batch, args.dim], stddev=0.01)
        self.slices = [tf.IndexedSlices(grads, tf.constant(k)) for k in bt.keys]
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


def add_optimizer_args(ap, optimizers):
    """The flags every optimizer benchmark takes."""
    add_size_args(ap, "keys per load while filling")
    ap.add_argument("--optimizers", default=",".join(optimizers), help="comma-separated (default: all)")
    ap.add_argument("--peer-python", default="", help="python of the TFRA venv; empty: no TFRA")
    ap.add_argument("--log-dir", default="", help="directory for the TFRA peer's stderr log")


def setup(ap, optimizers):
    """Parses the flags; returns (args, optimizer names, batches, the output dict, the TFRA peer or None)."""
    args = ap.parse_args()
    import tensorflow as tf

    names = [o for o in args.optimizers.split(",") if o]
    for o in names:
        if o not in optimizers:
            ap.error(f"unknown optimizer {o!r}; one of {sorted(optimizers)}")
    bt = Batches(args.keys, args.batch, args.batches + args.warmup, args.seed)
    out = {"keys": args.keys, "dim": args.dim, "batch": args.batch, "batches": args.batches,
           "warmup": args.warmup, "seed": args.seed, "tf_version": tf.__version__, "evstore": {}, "tfra": {}}
    peer = None
    if args.peer_python:
        from bench_lookup import TfraProcess
        try:
            peer = TfraProcess(args, module="bench.peers.peer_tfra_optimizers")
            peer.wait_ready()
            out["tfra_info"] = peer.info
        except Exception as e:  # report, run our side alone
            out["tfra_error"] = f"cannot start TFRA peer: {e}"
            peer = None
    return args, names, bt, out, peer


def interleave(ours, peer, ops, args, res, peer_res):
    """Runs `ops` ((side, workload) pairs) for warmup + batches rounds, the
    order rotating each round; returns {op: [seconds of the timed rounds]}.
    A workload that raises is recorded ("<workload>_error" in res / peer_res)
    and dropped; our first round's time is kept as "<workload>_first_s"."""
    times = {op: [] for op in ops}
    for r in range(args.warmup + args.batches):
        k = r % len(ops)
        for s, w in ops[k:] + ops[:k]:
            if (s, w) not in times:
                continue
            try:
                t = ours.run(w, r) if s == "evstore" else peer.run(w, r)
            except Exception as e:  # record and drop this workload
                (res if s == "evstore" else peer_res)[w + "_error"] = f"{type(e).__name__}: {e}"[:2000]
                del times[(s, w)]
                continue
            if r >= args.warmup:
                times[(s, w)].append(t[0])
            elif r == 0 and s == "evstore":
                res[w + "_first_s"] = t[0]
    return times


def finish(out, peer):
    """Collects the peer's stats, stops it, prints the JSON line."""
    if peer is not None:
        try:
            out["tfra_stats"] = peer.stats()
        finally:
            peer.close()
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_optimizer_args(ap, OPTIMIZERS)
    args, names, bt, out, peer = setup(ap, OPTIMIZERS)
    import tensorflow as tf

    for name in names:
        progress(f"{name}: filling {args.keys} keys x dim {args.dim}")
        ours = EvstoreOptimizer(name, args, bt, tf)
        ops = [("evstore", "fused"), ("evstore", "apply_gradients")]
        tfra_w = "apply_" + OPTIMIZERS[name][3]
        if peer is not None:
            ops.append(("tfra", tfra_w))
        res = out["evstore"].setdefault(name, {})
        peer_errors = {}
        times = interleave(ours, peer, ops, args, res, peer_errors)
        if peer_errors:
            out["tfra"][name] = peer_errors
        for (s, w), ts in times.items():
            if s == "evstore":
                res[w] = rate(args.batch, ts)
            else:
                out["tfra"][name] = {"workload": w, "apply_gradients": rate(args.batch, ts),
                                     "equivalent": OPTIMIZERS[name][4]}
        res["slots"] = ours.slots()
        res["row_bytes_per_key"] = ours.ev.stats()["row_bytes"] / max(1, int(ours.ev.size()))
        del ours
        progress(f"{name}: fused {res.get('fused', 0) / 1e6:.2f} M keys/s, apply_gradients "
                 f"{res.get('apply_gradients', 0) / 1e6:.2f} M keys/s")
    finish(out, peer)


if __name__ == "__main__":
    sys.exit(main())
