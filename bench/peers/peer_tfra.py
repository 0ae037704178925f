"""Peer benchmark: TFRA 0.8.1 `dynamic_embedding` (CPU cuckoo hash table, libcuckoo).

Run ONLY with the peer venv's python (never import TFRA into the project venv):

    .peer-tfra/bin/python -m bench.peers.peer_tfra --keys 1000000 --dim 16
    .peer-tfra/bin/python -m bench.peers.peer_tfra --keys 1000000 --dim 16 --serve   # driven by bench_lookup.py

Key generation and batches: bench/harness/workload.py (identical to bench_lookup.py).
The table is a `de.keras.layers.Embedding(dim)`'s `de.Variable` (one CPU
CuckooHashTable shard, not pre-sized), filled with N keys by
`CuckooHashTable.insert` in chunks. Workloads (one batch each; keys/s = median):

  find            `CuckooHashTable.lookup` of existing keys with the static
                  default value (op TFRA>CuckooHashTableFind): TFRA's cheapest
                  read path, what serving uses.
  lookup_init     `de.Variable.lookup` of existing keys: the read a training
                  lookup does (find + initializer rows generated for misses;
                  TFRA inserts new keys only at the optimizer apply).
  upsert_existing `CuckooHashTable.insert` of existing keys (overwrite).
  insert_new      `CuckooHashTable.insert` of never-seen keys with supplied
                  rows: how TFRA adds keys (its nearest equivalent of a
                  find-or-insert miss).
  train_step      one Adam training step through TFRA's Keras path: Embedding
                  lookup under a GradientTape, loss = sum(emb), gradient,
                  `de.DynamicEmbeddingOptimizer(tf_keras Adam).apply_gradients`.
                  Also reports train_apply: the apply_gradients call alone.

Standalone mode runs every workload in sequence and prints one JSON line.
--serve mode fills the table, prints "@@READY <json>", then answers stdin
commands "<workload> <batch index>" with "@@ <seconds> [<apply seconds>] | <CPU seconds>" (this
process's CPU time, all threads, over the batch),
"stats" with "@@ <json>", and exits on "quit" or EOF; protocol lines start
with "@@" (TF/TFRA may print other lines on stdout).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.harness.args import add_size_args
from bench.harness.rss import hwm_mib, rss_mib
from bench.harness.timing import on_host, rate
from bench.harness.workload import Batches, fill_chunks

WORKLOADS = ("find", "lookup_init", "upsert_existing", "insert_new", "train_step")


class TfraPeer:
    def __init__(self, args):
        import tensorflow as tf
        import tensorflow_recommenders_addons as tfra
        from tensorflow_recommenders_addons import dynamic_embedding as de
        try:
            import tf_keras as tfk
        except ImportError:  # pragma: no cover - stacks without tf_keras
            tfk = tf.keras
        self.tf, self.de, self.tfk = tf, de, tfk
        self.args = args
        self.meta = {"peer": "tfra", "tfra_version": tfra.__version__, "tf_version": tf.__version__}
        rss0 = rss_mib()
        init = tfk.initializers.RandomNormal(0.0, 0.01, seed=1)
        self.layer = de.keras.layers.Embedding(args.dim, initializer=init, name="bench_emb")
        self.var = self.layer.params
        self.table = self.var.tables[0]
        t0 = time.perf_counter()
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            self.table.insert(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
        self.meta["fill_s"] = time.perf_counter() - t0
        self.meta["size_after_fill"] = int(self.table.size().numpy())
        self.meta["rss_fill_mib"] = rss_mib() - rss0
        self.bt = Batches(args.keys, args.batch, args.batches + args.warmup, args.seed)
        self.ex = [tf.constant(k) for k in self.bt.keys]
        self.new = [tf.constant(k) for k in self.bt.new_keys]
        self.rows = tf.random.normal([args.batch, args.dim], stddev=0.01)
        self.opt = None

    def run(self, workload, i):
        """Runs batch i of a workload; returns [seconds] (train_step: [step s, apply s])."""
        ids = self.ex[i % self.bt.count]
        t0 = time.perf_counter()
        if workload == "find":
            on_host(self.table.lookup(ids))
        elif workload == "lookup_init":
            on_host(self.var.lookup(ids))
        elif workload == "upsert_existing":
            self.table.insert(ids, self.rows)
        elif workload == "insert_new":
            self.table.insert(self.new[i % self.bt.count], self.rows)
        elif workload == "train_step":
            if self.opt is None:
                self.opt = self.de.DynamicEmbeddingOptimizer(self.tfk.optimizers.Adam(1e-3))
                self.meta["optimizer"] = type(self.opt).__module__ + "." + type(self.opt).__name__
            t0, t1, t2 = self.timed_step(self.opt, ids)
            return [t2 - t0, t2 - t1]
        else:
            raise ValueError(f"unknown workload {workload!r}; one of {WORKLOADS}")
        return [time.perf_counter() - t0]

    def timed_step(self, opt, ids):
        """One training step through TFRA's Keras path: the gradient of
        sum(layer(ids)) under a GradientTape, then opt.apply_gradients.
        Returns its start, gradient-done and apply-done perf_counter times."""
        tf = self.tf
        t0 = time.perf_counter()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(self.layer(ids))
        tv = self.layer.trainable_variables
        grads = tape.gradient(loss, tv)
        t1 = time.perf_counter()
        opt.apply_gradients(zip(grads, tv))
        return t0, t1, time.perf_counter()

    def stats(self):
        return dict(self.meta, size=int(self.table.size().numpy()), rss_mib=rss_mib(), rss_peak_mib=hwm_mib())


def serve(peer):
    print("@@READY " + json.dumps(peer.meta), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        try:
            if parts[0] == "stats":
                reply = json.dumps(peer.stats())
            else:
                c0 = time.process_time()
                times = peer.run(parts[0], int(parts[1]))
                reply = " ".join(f"{t:.9f}" for t in times) + f" | {time.process_time() - c0:.9f}"
        except Exception as e:  # report, keep serving
            reply = "ERR " + f"{type(e).__name__}: {e}".replace("\n", " ")
        print("@@ " + reply, flush=True)


def standalone(peer, args, workloads):
    out = dict(keys=args.keys, dim=args.dim, batch=args.batch, batches=args.batches)
    for w in workloads:
        times = [peer.run(w, i) for i in range(args.warmup + args.batches)][args.warmup:]
        out[w] = rate(args.batch, [t[0] for t in times])
        if w == "train_step":
            out["train_apply"] = rate(args.batch, [t[1] for t in times])
    out.update(peer.stats())
    print(json.dumps(out), flush=True)


def main(doc=__doc__, peer_class=TfraPeer, workloads=WORKLOADS):
    """A peer's command line (`doc`: its module docstring): the size flags, then
    `peer_class(args)` serves (--serve, the protocol above) or runs `workloads` alone."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    add_size_args(ap, "keys per insert while filling")
    ap.add_argument("--workloads", default=",".join(workloads),
                    help="standalone mode: comma-separated workloads, run in this order (default: all)")
    ap.add_argument("--serve", action="store_true", help="serve batches over stdin/stdout (peer_tfra.py protocol)")
    args = ap.parse_args()
    peer = peer_class(args)
    if args.serve:
        serve(peer)
    else:
        standalone(peer, args, [w for w in args.workloads.split(",") if w])


if __name__ == "__main__":
    sys.exit(main())
