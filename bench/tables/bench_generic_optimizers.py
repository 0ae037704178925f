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
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.rss import rss_mib
from bench.harness.timing import rate
from bench.harness.workload import fill_chunks
from bench.tables.bench_optimizers import add_optimizer_args, finish, interleave, setup

OPTIMIZERS = {"rmsprop": "RMSprop", "nadam": "Nadam"}   # ours -> keras.optimizers class; TFRA workload apply_<ours>


def progress(msg):
    print(f"[bench_generic_optimizers {time.strftime('%H:%M:%S')}] {msg} (rss {rss_mib():.0f} MiB)",
          file=sys.stderr, flush=True)


class GenericOptimizer:
    """One EV filled with N keys, trained by a Keras optimizer through the generic path."""

    def __init__(self, name, args, bt, tf):
        import keras

        import evstore
        self.tf, self.bt = tf, bt
        self.ev = evstore.EmbeddingVariable(f"bench_{name}", dim=args.dim, key_dtype=tf.int64)
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            self.ev.load(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
        sid, _, _ = self.ev.begin_export()
        self.ev.commit_export(sid)
        grads = tf.random.normal([args.batch, args.dim], stddev=0.01)
        self.slices = [tf.IndexedSlices(grads, tf.constant(k)) for k in bt.keys]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_optimizer_args(ap, OPTIMIZERS)
    args, names, bt, out, peer = setup(ap, OPTIMIZERS)
    import tensorflow as tf

    for name in names:
        progress(f"{name}: filling {args.keys} keys x dim {args.dim}")
        ours = GenericOptimizer(name, args, bt, tf)
        ops = [("evstore", "generic"), ("evstore", "generic_fn")]
        if peer is not None:
            ops.append(("tfra", "apply_" + name))
        res = out["evstore"].setdefault(name, {})
        peer_errors = {}
        times = interleave(ours, peer, ops, args, res, peer_errors)
        if peer_errors:
            out["tfra"][name] = peer_errors
        for (s, w), ts in times.items():
            if s == "evstore":
                res[w] = rate(args.batch, ts)
            else:
                out["tfra"][name] = {"workload": w, "apply_gradients": rate(args.batch, ts)}
        tfra = out["tfra"].get(name, {}).get("apply_gradients")
        if tfra:
            res["ratio_vs_tfra"] = {w: res[w] / tfra for w in ("generic", "generic_fn") if w in res}
        res["slots"] = sorted(ours.ev.export()["slots"]) if args.keys <= 2_000_000 else None
        del ours
        progress(f"{name}: generic {res.get('generic', 0) / 1e6:.2f} M keys/s, tf.function "
                 f"{res.get('generic_fn', 0) / 1e6:.2f} M keys/s, tfra {(tfra or 0) / 1e6:.2f} M keys/s")
    finish(out, peer)

if __name__ == "__main__":
    sys.exit(main())
