"""The optimizer comparisons' driver (bench.tables.bench_optimizers, the fused
applies, and bench.tables.bench_generic_optimizers, the generic row path):
their flags, the TFRA peer, one filled EV per optimizer, the rotating rounds
and the JSON line.

A benchmark gives `compare` its optimizers and, per optimizer, an object with
`ev` (the filled table) and `run(workload, round) -> [seconds]`; per optimizer
in turn it times our workloads and the peer's, interleaved (the order rotates
each round), and records keys/s (batch / median seconds) of each.
"""
import argparse
import json
import os
import sys
import time

from bench.harness.args import add_size_args
from bench.harness.peers import TfraProcess
from bench.harness.rss import rss_mib
from bench.harness.timing import rate
from bench.harness.workload import Batches, fill_chunks

PEER_MODULE = "bench.peers.peer_tfra_optimizers"


def add_optimizer_args(ap, optimizers):
    """The flags every optimizer benchmark takes."""
    add_size_args(ap, "keys per load while filling")
    ap.add_argument("--optimizers", default=",".join(optimizers), help="comma-separated (default: all)")
    ap.add_argument("--peer-python", default="", help="python of the TFRA venv; empty: no TFRA")
    ap.add_argument("--log-dir", default="", help="directory for the TFRA peer's stderr log")


def filled_ev(name, args):
    """An int64 EmbeddingVariable `bench_<name>` of args.keys keys (ev.load in
    chunks of args.fill_chunk, rows N(0, 0.01)), then a committed export so
    nothing is dirty."""
    import tensorflow as tf

    import evstore
    ev = evstore.EmbeddingVariable(f"bench_{name}", dim=args.dim, key_dtype=tf.int64)
    for s, e, k in fill_chunks(args.keys, args.fill_chunk):
        ev.load(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
    sid, _, _ = ev.begin_export()
    ev.commit_export(sid)
    return ev


def gradient_slices(args, bt):
    """One IndexedSlices per pre-generated batch: N(0, 0.01) gradients of its keys."""
    import tensorflow as tf
    grads = tf.random.normal([args.batch, args.dim], stddev=0.01)
    return [tf.IndexedSlices(grads, tf.constant(k)) for k in bt.keys]


def _setup(ap, optimizers):
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
        try:
            peer = TfraProcess(args, module=PEER_MODULE)
            peer.wait_ready()
            out["tfra_info"] = peer.info
        except Exception as e:  # report, run our side alone
            out["tfra_error"] = f"cannot start TFRA peer: {e}"
            peer = None
    return args, names, bt, out, peer


def _interleave(ours, peer, ops, args, res, peer_res):
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


def compare(doc, optimizers, make, workloads, peer_workload, describe, tfra_fields=None):
    """The benchmark's main: flags (`doc`: its module docstring), then per optimizer
    `name` of `optimizers` (a dict keyed by name): ours = make(name, args, batches),
    timed over `workloads` with the peer's `peer_workload(name)`; `describe(name,
    ours, res, tfra_keys_per_s)` adds the benchmark's own fields to our result dict
    `res` and returns its progress line. The peer's result is {"workload", "apply_gradients"} plus
    `tfra_fields(name)`. Prints one JSON line (stdout); progress on stderr."""
    tool = os.path.splitext(os.path.basename(sys.argv[0]))[0]

    def progress(msg):
        print(f"[{tool} {time.strftime('%H:%M:%S')}] {msg} (rss {rss_mib():.0f} MiB)", file=sys.stderr, flush=True)

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    add_optimizer_args(ap, optimizers)
    args, names, bt, out, peer = _setup(ap, optimizers)
    for name in names:
        progress(f"{name}: filling {args.keys} keys x dim {args.dim}")
        ours = make(name, args, bt)
        ops = [("evstore", w) for w in workloads]
        if peer is not None:
            ops.append(("tfra", peer_workload(name)))
        res = out["evstore"].setdefault(name, {})
        peer_errors = {}
        times = _interleave(ours, peer, ops, args, res, peer_errors)
        if peer_errors:
            out["tfra"][name] = peer_errors
        for (s, w), ts in times.items():
            if s == "evstore":
                res[w] = rate(args.batch, ts)
            else:
                out["tfra"][name] = {"workload": w, "apply_gradients": rate(args.batch, ts),
                                     **(tfra_fields(name) if tfra_fields else {})}
        progress(describe(name, ours, res, out["tfra"].get(name, {}).get("apply_gradients")))
        del ours
    if peer is not None:
        try:
            out["tfra_stats"] = peer.stats()
        finally:
            peer.close()
    print(json.dumps(out), flush=True)
