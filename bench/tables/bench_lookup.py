"""Lookup / insert / Adam benchmark of evstore vs TF DenseHashTable, numpy gather and TFRA.

Run with the project venv from the repo root (bench/run.py drives it per size):

    .venv/bin/python -m bench.tables.bench_lookup --keys 1000000 --dim 16
    .venv/bin/python -m bench.tables.bench_lookup --keys 1000000 --dim 16 --peer-python .peer-tfra/bin/python
    .venv/bin/python -m bench.tables.bench_lookup --quick

Keys and batches: bench/harness/workload.py (the TFRA peer sees the very same batches).
Every system is filled with the same N keys (not pre-sized), then measured in
INTERLEAVED rounds: round r runs batch r of every workload of a phase, one
system after another (order rotated each round), so all systems share the
same noise of this shared 2-core machine. Rates are medians over --batches
timed rounds (after --warmup untimed ones), in keys/s, each output handed over as a host
array aliasing it (bench/harness/timing.py on_host: no copy).
TFRA (optional, --peer-python) runs in its own venv as a `peer_tfra.py
--serve` subprocess that times each batch itself; it idles while we run.

Phases and workloads:
  read    evstore.find        EvFind (read-only) of existing keys
          evstore.foi_hit     EvFindOrInsert of existing keys (counts frequency)
          dense_hash.find     DenseHashTable.lookup (int64 -> float32[dim])
          numpy.gather        table[idx] on a dense float32 [N, dim] array
          numpy.take          np.take(table, idx, axis=0) (for reference)
          tfra.find / lookup_init / upsert_existing   (see peer_tfra.py)
  insert  evstore.foi_new     EvFindOrInsert of never-seen keys (all inserted)
          dense_hash.insert_new, tfra.insert_new   insert of the same new keys
  train   evstore.adam_apply  EvApplyAdam of [batch] existing keys, [batch, dim] grads
          evstore.train_step  embedding_lookup + GradientTape + optimizers.Adam.apply_gradients
                              (train_apply: the apply_gradients call alone)
          tfra.train_step     the same step through TFRA's Keras path (+ train_apply)
numpy is dropped after the read phase and DenseHashTable after the insert phase
(TF does not hand the DenseHashTable's memory back to the OS, so bench/run.py
runs the train phase in a process without it). The train phase runs on tables
holding N + (warmup+batches)*batch keys when it follows the insert phase.
`<workload>_first_s` is the duration of the first (untimed) batch of each workload, `<workload>_first_cpu_s`
its CPU seconds (user + system, every thread of the process doing it).
evstore bytes/key = (index_bytes + meta_bytes) / size from ev.stats(), after the fill (every key
dirty) and after a committed export (begin_export + commit_export: the dirty list emptied).
Prints one JSON line (the last line of stdout).
"""
import argparse
import gc
import glob
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np

from bench.harness.args import add_size_args
from bench.harness.paths import ROOT
from bench.harness.peers import TfraProcess
from bench.harness.rss import guard_available_memory, hwm_mib, rss_mib
from bench.harness.timing import on_host, rate, timed
from bench.harness.workload import Batches, fill_chunks

SYSTEMS = ("evstore", "dense_hash", "numpy")
PHASES = {
    "read": [("evstore", "find"), ("evstore", "foi_hit"), ("dense_hash", "find"), ("numpy", "gather"),
             ("numpy", "take"), ("tfra", "find"), ("tfra", "lookup_init"), ("tfra", "upsert_existing")],
    "insert": [("evstore", "foi_new"), ("dense_hash", "insert_new"), ("tfra", "insert_new")],
    "train": [("evstore", "adam_apply"), ("evstore", "train_step"), ("tfra", "train_step")],
}


class Evstore:
    def __init__(self, args, bt, tf):
        import evstore
        from evstore import ops
        self.tf, self.ops, self.evstore, self.dim, self.bt = tf, ops, evstore, args.dim, bt
        rss0 = rss_mib()
        self.ev = evstore.EmbeddingVariable("bench", dim=args.dim, key_dtype=tf.int64)
        self.h = self.ev.resource_handle
        t0 = time.perf_counter()
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            self.ev.load(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
        st = self.ev.stats()
        self.info = {"fill_s": time.perf_counter() - t0, "rss_fill_mib": rss_mib() - rss0,
                     "stats_after_fill": st,
                     "index_meta_bytes_per_key": (st["index_bytes"] + st["meta_bytes"]) / max(1, st["size"]),
                     "index_bytes_per_key": st["index_bytes"] / max(1, st["size"]),
                     "meta_bytes_per_key": st["meta_bytes"] / max(1, st["size"]),
                     "row_bytes_per_key": st["row_bytes"] / max(1, st["size"])}
        # The fill marks every key dirty (the dirty list is part of index_bytes);
        # a committed export (what a checkpoint save does) empties it.
        sid, _, _ = self.ev.begin_export()
        self.ev.commit_export(sid)
        st = self.ev.stats()
        self.info["stats_after_seal"] = st
        self.info["index_meta_bytes_per_key_sealed"] = (st["index_bytes"] + st["meta_bytes"]) / max(1, st["size"])
        self.ex = [tf.constant(k) for k in bt.keys]
        self.new = [tf.constant(k) for k in bt.new_keys]
        self.no_proxy = tf.zeros([0])
        self.grads = tf.random.normal([args.batch, args.dim], stddev=0.01)
        self.adam_hp = [tf.constant(x, tf.float32) for x in (1e-3, 0.9, 0.999, 1e-7)]
        self.opt = None

    def run(self, w, i):
        tf, ops, h, dim = self.tf, self.ops, self.h, self.dim
        ids = self.ex[i % self.bt.count]
        if w == "find":
            return [timed(lambda: on_host(ops.ev_find(h, ids, dim=dim)))]
        if w == "foi_hit":
            return [timed(lambda: on_host(ops.ev_find_or_insert(h, ids, self.no_proxy, dim=dim)))]
        if w == "foi_new":
            new = self.new[i % self.bt.count]
            return [timed(lambda: on_host(ops.ev_find_or_insert(h, new, self.no_proxy, dim=dim)))]
        if w == "adam_apply":
            step = tf.constant(i + 1, tf.int64)
            return [timed(lambda: ops.ev_apply_adam(h, ids, self.grads, step, *self.adam_hp))]
        if w == "train_step":
            if self.opt is None:
                self.opt = self.evstore.optimizers.Adam(1e-3)
            t0 = time.perf_counter()
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(self.evstore.embedding_lookup(self.ev, ids))
            g = tape.gradient(loss, [self.ev])
            t1 = time.perf_counter()
            self.opt.apply_gradients(zip(g, [self.ev]))
            t2 = time.perf_counter()
            return [t2 - t0, t2 - t1]
        raise ValueError(w)

    def stats(self):
        return dict(self.info, stats_final=self.ev.stats(), rss_mib=rss_mib())


class DenseHash:
    def __init__(self, args, bt, tf):
        self.bt = bt
        # keys are >= 0 (bench/harness/workload.py), so -1 / -2 are free to reserve
        self.table = tf.lookup.experimental.DenseHashTable(
            key_dtype=tf.int64, value_dtype=tf.float32, default_value=tf.zeros([args.dim]),
            empty_key=-1, deleted_key=-2)
        t0 = time.perf_counter()
        for s, e, k in fill_chunks(args.keys, args.fill_chunk):
            self.table.insert(tf.constant(k), tf.random.normal([e - s, args.dim], stddev=0.01))
        self.info = {"fill_s": time.perf_counter() - t0}
        self.ex = [tf.constant(k) for k in bt.keys]
        self.new = [tf.constant(k) for k in bt.new_keys]
        self.rows = tf.random.normal([args.batch, args.dim], stddev=0.01)

    def run(self, w, i):
        if w == "find":
            ids = self.ex[i % self.bt.count]
            return [timed(lambda: on_host(self.table.lookup(ids)))]
        if w == "insert_new":
            return [timed(self.table.insert, self.new[i % self.bt.count], self.rows)]
        raise ValueError(w)

    def stats(self):
        return dict(self.info, size=int(self.table.size().numpy()))


class NumpyGather:
    def __init__(self, args, bt, tf=None):
        self.bt = bt
        self.arr = np.random.default_rng(args.seed + 1).standard_normal((args.keys, args.dim), dtype=np.float32)

    def run(self, w, i):
        idx = self.bt.idx[i % self.bt.count]
        if w == "gather":
            return [timed(lambda: self.arr[idx])]
        if w == "take":
            return [timed(lambda: np.take(self.arr, idx, axis=0))]
        raise ValueError(w)

    def stats(self):
        return {"array_mib": self.arr.nbytes / 2**20}


def progress(msg):
    """One progress line on stderr with this process's RSS."""
    print(f"[bench_lookup {time.strftime('%H:%M:%S')}] {msg} (rss {rss_mib():.0f} MiB)", file=sys.stderr, flush=True)


def run_phase(name, systems, results, args):
    """Interleaved rounds over the phase's (system, workload) pairs present in `systems`."""
    ops = [(s, w) for s, w in PHASES[name] if s in systems]
    times = {op: [] for op in ops}
    cpus = {op: [] for op in ops}
    for r in range(args.warmup + args.batches):
        k = r % max(1, len(ops))
        for s, w in ops[k:] + ops[:k]:
            if (s, w) not in times:
                continue
            c0 = time.process_time()
            try:
                t = systems[s].run(w, r)
            except Exception as e:  # record and drop this workload, keep the rest running
                results.setdefault(s, {})[w + "_error"] = f"{type(e).__name__}: {e}"[:2000]
                del times[(s, w)]
                continue
            # CPU seconds of the process doing the work, all its threads (the peer measures its own)
            cpu = systems[s].last_cpu_s if isinstance(systems[s], TfraProcess) else time.process_time() - c0
            if r >= args.warmup:
                times[(s, w)].append(t)
                cpus[(s, w)].append(cpu)
            elif r == 0:
                results.setdefault(s, {})[w + "_first_s"] = t[0]
                results[s][w + "_first_cpu_s"] = cpu
    for (s, w), ts in times.items():
        summarize(results.setdefault(s, {}), w, ts, args.batch, cpus[(s, w)])


def summarize(res, w, ts, batch, cpu=()):
    """Sets workload `w`'s figures in `res` from its timed batches `ts` (each [seconds] or, for a
    training step, [step seconds, apply seconds]) and their CPU seconds `cpu`: the median rate, the
    min / median / max batch seconds (spikes show up in max), the apply's rate, keys per CPU second
    (`<w>_cpu`, the median batch's), and the batches themselves (`<w>_batch_s`, `<w>_batch_cpu_s`,
    so runs of one system in several processes can be pooled: bench/tables/solo_runs.py)."""
    res[w] = rate(batch, [t[0] for t in ts])
    res[w + "_batch_s"] = [list(t) for t in ts]
    cpu = [c for c in cpu if c is not None]
    res[w + "_batch_cpu_s"] = cpu
    res[w + "_cpu"] = rate(batch, cpu) if cpu and min(cpu) > 0 else None
    if ts:
        sec = sorted(t[0] for t in ts)
        res[w + "_s_min_med_max"] = [sec[0], sec[len(sec) // 2], sec[-1]]
    if len(ts) and len(ts[0]) > 1:
        res[w.replace("step", "apply")] = rate(batch, [t[1] for t in ts])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_size_args(ap, "keys per load/insert while filling")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated in-process systems from {','.join(SYSTEMS)} (default: all)")
    ap.add_argument("--peer-python", default="",
                    help="python of the TFRA venv (e.g. .peer-tfra/bin/python); empty: no TFRA")
    ap.add_argument("--log-dir", default="", help="directory for the TFRA peer's stderr log")
    ap.add_argument("--phases", default="read,insert,train",
                    help="comma-separated phases to run, in order: read, insert, train (default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 100k keys, 5 rounds, 1 warmup")
    ap.add_argument("--min-available-mib", type=float, default=1024,
                    help="stop (this process and its TFRA peer, exit 3, the reason on stderr) once the machine's "
                         "MemAvailable falls under this (default 1024; 0: never)")
    args = ap.parse_args()
    if args.min_available_mib > 0:
        guard_available_memory(args.min_available_mib)
    if args.quick:
        args.keys, args.batches, args.warmup = 100_000, 5, 1
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(wanted) - set(SYSTEMS):
        ap.error(f"unknown systems: {sorted(set(wanted) - set(SYSTEMS))}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if set(phases) - set(PHASES):
        ap.error(f"unknown phases: {sorted(set(phases) - set(PHASES))}")

    out = {"keys": args.keys, "dim": args.dim, "batch": args.batch, "batches": args.batches,
           "warmup": args.warmup, "seed": args.seed, "systems": wanted + (["tfra"] if args.peer_python else []),
           "phases": args.phases}
    peer = None
    if args.peer_python:  # start first: it fills its table while we fill ours
        try:
            peer = TfraProcess(args)
        except OSError as e:
            out["tfra_error"] = f"cannot start TFRA peer: {e}"

    import tensorflow as tf
    out["tf_version"] = tf.__version__
    if "evstore" in wanted:  # which native build this process measured (the tree may be rebuilt meanwhile)
        so = glob.glob(os.path.join(ROOT, "evstore", "native", "_evstore_ops*.so"))
        out["evstore_so_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(os.path.getmtime(so[0]))) \
            if so else None
    bt = Batches(args.keys, args.batch, args.batches + args.warmup, args.seed)
    classes = {"evstore": Evstore, "dense_hash": DenseHash, "numpy": NumpyGather}
    systems, results = {}, {}
    for s in wanted:
        try:
            systems[s] = classes[s](args, bt, tf)
            progress(f"{s} filled")
        except Exception as e:
            results[s] = {"error": f"setup: {type(e).__name__}: {e}"[:2000]}
    if peer is not None:
        try:
            t0 = time.time()
            peer.wait_ready()
            systems["tfra"] = peer
            out["tfra_wait_s"] = time.time() - t0
        except Exception as e:
            out["tfra_error"] = f"{type(e).__name__}: {e}"
            peer.close()
            peer = None

    for ph in phases:
        t0 = time.perf_counter()
        run_phase(ph, systems, results, args)
        out[f"phase_{ph}_s"] = time.perf_counter() - t0
        progress(f"phase {ph} done")
        drop = {"read": "numpy", "insert": "dense_hash"}.get(ph)
        if drop in systems:
            results.setdefault(drop, {}).update(systems.pop(drop).stats())
            gc.collect()
            progress(f"{drop} freed")
    out["rss_end_mib"] = rss_mib()
    out["rss_peak_mib"] = hwm_mib()
    for s, obj in systems.items():
        try:
            results.setdefault(s, {}).update(obj.stats())
        except Exception as e:
            results.setdefault(s, {})["stats_error"] = f"{type(e).__name__}: {e}"
    if peer is not None:
        peer.close()
    out.update(results)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
