"""Checkpoint benchmark: evstore full / delta saves and restores vs a plain sequential write and TFRA.

Run with the project venv from the repo root (bench/run.py runs it after the lookup matrix):

    .venv/bin/python -m bench.checkpoints.bench_checkpoint                      # 10M keys x dim 16, Adam slots
    .venv/bin/python -m bench.checkpoints.bench_checkpoint --keys 200000 --repeats 1 --no-tfra   # quick
    .venv/bin/python -m bench.checkpoints.bench_checkpoint --peer-python .peer-tfra/bin/python

The table: one EmbeddingVariable of --keys keys (bench/harness/workload.py's keys) x
--dim, with Adam slots m and v, filled with `ev.load` (values, slots,
versions, freqs) in chunks; a CheckpointManager on a local root (--dir, default
a directory under bench/results/ on the repository's disk) saves it.

  full save        CheckpointManager.save_full() (seal, streamed bundle write,
                   fsync of every file, index check, manifest), --repeats times,
                   interleaved with
  sequential write the same number of bytes written with os.write from an 8 MiB
                   buffer to one file in the same directory, then fsync: the
                   floor for writing those bytes on this disk.
  delta saves      for each --dirty fraction f (in order, each on the chain of
                   the last full): f * keys distinct random keys are updated by
                   evstore.training.sparse_apply_adam (untimed, batches of
                   --batch), then save_delta() is timed.
  restores         CheckpointManager.restore(seq) of the whole chain (full +
                   every delta; --restores full,chain adds the full alone), each into a new
                   empty EV (a restarted job), timed as its two parts: checking
                   every file's crc32c (checkpoint.chain.verify_files, what
                   restore runs first) and restore(verify=False). The files were
                   just written, so they are read from the page cache.
                   --restore-live also times restoring the full into the live
                   10M-key table (going back in time in a running job).
  memory           extra memory of each save = RSS high-water during it minus
                   RSS before (bench/harness/rss.py: VmHWM reset through
                   /proc/self/clear_refs, and a 2 ms VmRSS sampling thread);
                   a restore keeps the table it loads, so for restores the
                   high-water above the RSS after it is reported too.
  CPU              user + system CPU seconds of each full save (getrusage).
  TFRA             bench/peers/peer_tfra_checkpoint.py in the peer venv (--peer-python):
                   the same keys in a de.keras.layers.Embedding with Adam slots
                   (DynamicEmbeddingOptimizer), saved by tf.train.Checkpoint.write
                   (+ fsync of the files) and restored by Checkpoint.read.
Prints one JSON line (the last line of stdout); progress goes to stderr.
"""
import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.paths import RESULTS
from bench.harness.peers import module_cmd, run_json
from bench.harness.args import add_size_args
from bench.harness.workload import fill_chunks, make_keys
from bench.harness.rss import PeakRss

TARGETS = {"full_vs_seq": 0.5, "extra_mib": 256, "delta1_vs_full": 0.05}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sequential_write(path, nbytes, buf):
    """Seconds to write nbytes to a new file from `buf` and fsync it (file and directory)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        mv = memoryview(buf)
        while left:
            left -= os.write(fd, mv[:min(left, len(mv))])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def fill(ev, args, tf):
    rng = np.random.default_rng(args.seed)
    for s, e, k in fill_chunks(args.keys, args.fill_chunk):
        n = e - s
        ev.load(tf.constant(k), rng.standard_normal((n, args.dim), dtype=np.float32) * 0.01,
                versions=np.zeros(n, np.int64), freqs=np.ones(n, np.int64),
                slots={"m": rng.standard_normal((n, args.dim), dtype=np.float32) * 0.001,
                       "v": np.abs(rng.standard_normal((n, args.dim), dtype=np.float32)) * 1e-4})


def dirty(ev, step, frac, args, tf, evstore):
    """Updates round(frac * keys) distinct random keys with sparse Adam applies; returns the count."""
    rng = np.random.default_rng(args.seed + int(frac * 1e6) + 1)
    n = max(1, int(round(frac * args.keys)))
    keys = make_keys(rng.choice(args.keys, n, replace=False))
    step.assign_add(1)
    for s in range(0, n, args.batch):
        k = tf.constant(keys[s:s + args.batch])
        g = tf.constant(rng.standard_normal((len(k), args.dim), dtype=np.float32) * 0.01)
        evstore.training.sparse_apply_adam(ev, tf.IndexedSlices(g, k), 1e-3, step)
    return n


def run_tfra(args):
    cmd = module_cmd("bench.peers.peer_tfra_checkpoint", python=args.peer_python) + ["--keys", str(args.keys),
           "--dim", str(args.dim), "--seed", str(args.seed), "--fill-chunk", str(args.fill_chunk),
           "--repeats", str(args.tfra_repeats), "--dir", os.path.join(args.dir, "tfra")]
    return run_json(cmd, os.path.join(args.log_dir, f"peer_tfra_checkpoint_{args.keys}x{args.dim}.log")
                    if args.log_dir else None, args.timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_size_args(ap, "keys per ev.load while filling")
    ap.set_defaults(keys=10_000_000, batch=65536)
    ap.add_argument("--dirty", default="0.001,0.01,0.1", help="dirty-key fractions of the deltas")
    ap.add_argument("--repeats", type=int, default=2, help="full saves (each paired with a sequential write)")
    ap.add_argument("--chunk-rows", type=int, default=65536, help="CheckpointManager chunk_rows")
    ap.add_argument("--dir", default=None, help="scratch directory (default bench/results/ckpt-scratch-<pid>)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--peer-python", default=None, help="python of the TFRA venv (e.g. .peer-tfra/bin/python)")
    ap.add_argument("--no-tfra", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds for the TFRA subprocess")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--restores", default="chain",
                    help="comma-separated restores to time: full (the full alone), chain (full + every delta); "
                         "default chain (each takes minutes at 10M keys, see BENCHMARKS.md)")
    ap.add_argument("--tfra-repeats", type=int, default=2, help="TFRA saves")
    ap.add_argument("--restore-live", action="store_true",
                    help="also time restoring the full into the live (filled) table: slow, see BENCHMARKS.md")
    args = ap.parse_args()
    args.dir = os.path.abspath(args.dir or os.path.join(RESULTS, f"ckpt-scratch-{os.getpid()}"))
    os.makedirs(args.dir, exist_ok=True)
    try:
        out = measure(args)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(out), flush=True)


def measure(args):
    import tensorflow as tf

    import evstore
    from checkpoint import CheckpointManager, Storage
    from checkpoint.chain import verify_files

    out = {"keys": args.keys, "dim": args.dim, "slots": ["m", "v"], "chunk_rows": args.chunk_rows,
           "repeats": args.repeats, "dir": args.dir}
    root = os.path.join(args.dir, "root")
    ev = evstore.EmbeddingVariable("bench", dim=args.dim)
    step = tf.Variable(0, dtype=tf.int64)
    t0 = time.perf_counter()
    fill(ev, args, tf)
    out["fill_s"] = time.perf_counter() - t0
    out["stats_after_fill"] = ev.stats()
    log(f"filled {args.keys} keys x {args.dim} (+ m, v) in {out['fill_s']:.1f}s")
    mgr = CheckpointManager(root, [ev], global_step=step, keep_chains=None, chunk_rows=args.chunk_rows)
    buf = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()

    fulls, seqs, mems, cpus, nbytes, full_seq = [], [], [], [], None, None
    for r in range(args.repeats):
        if full_seq is not None:
            shutil.rmtree(os.path.join(root, f"full-{full_seq:010d}"))
        if nbytes is not None:
            seqs.append(sequential_write(os.path.join(args.dir, "seq.bin"), nbytes, buf))
        with PeakRss() as mem:
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            full_seq = mgr.save_full()
            fulls.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        mems.append(mem.as_dict())
        nbytes = mgr.last_committed.total_bytes
        if r == 0:   # the first full's size is now known: pair it with a write of the same size
            seqs.append(sequential_write(os.path.join(args.dir, "seq.bin"), nbytes, buf))
        log(f"full save {r}: {fulls[-1]:.2f}s ({nbytes / fulls[-1] / 1e6:.0f} MB/s), sequential write "
            f"{seqs[-1]:.2f}s ({nbytes / seqs[-1] / 1e6:.0f} MB/s), extra memory {mem.extra_mib:.0f} MiB, "
            f"CPU {cpus[-1]:.1f}s")
    full_s, seq_s = statistics.median(fulls), statistics.median(seqs)
    out["full"] = {"bytes": nbytes, "save_s": fulls, "save_s_median": full_s, "mbps": nbytes / full_s / 1e6,
                   "mem": mems, "extra_mib_max": max(m["extra_mib"] for m in mems), "cpu_s": cpus}
    out["seq_write"] = {"bytes": nbytes, "s": seqs, "s_median": seq_s, "mbps": nbytes / seq_s / 1e6}
    out["full_vs_seq"] = seq_s / full_s

    out["deltas"] = []
    chain = [full_seq]
    for frac in [float(x) for x in args.dirty.split(",") if x]:
        n = dirty(ev, step, frac, args, tf, evstore)
        with PeakRss() as mem:
            t0 = time.perf_counter()
            seq = mgr.save_delta()
            dt = time.perf_counter() - t0
        chain.append(seq)
        m = mgr.last_committed
        out["deltas"].append({"frac": frac, "keys": n, "rows": m.evs["bench"]["rows"], "bytes": m.total_bytes,
                              "save_s": dt, "vs_full": dt / full_s, "mem": mem.as_dict()})
        log(f"delta {frac:g}: {n} keys, {dt:.3f}s = {dt / full_s:.1%} of the full save, "
            f"extra memory {mem.extra_mib:.0f} MiB")

    out["restore"] = []
    storage = Storage(root)
    targets = {"full": ("full", chain[:1]), "chain": (f"full + {len(chain) - 1} deltas", chain)}
    todo = []
    for t in [x for x in args.restores.split(",") if x]:
        if t not in targets:
            raise SystemExit(f"--restores: unknown {t!r} (full, chain)")
        if targets[t][1] not in [u[1] for u in todo]:
            todo.append(targets[t])
    for name, seqs in todo:
        # A restarted job: a new, empty EV. restore() = verify every file (crc32c) then load;
        # both parts are timed separately (restore(verify=False) + the same verify_files calls).
        fresh = evstore.EmbeddingVariable("bench", dim=args.dim)
        rmgr = CheckpointManager(root, [fresh], global_step=step, keep_chains=None, chunk_rows=args.chunk_rows)
        manifests = rmgr.chain(seqs[-1])
        t0 = time.perf_counter()
        problems = [p for m in manifests for p in verify_files(storage, m)]
        verify_s = time.perf_counter() - t0
        assert not problems, problems
        with PeakRss() as mem:
            t0 = time.perf_counter()
            rmgr.restore(seq=seqs[-1], verify=False)
            load_s = time.perf_counter() - t0
        assert int(fresh.size()) == args.keys
        out["restore"].append({"what": name, "seq": seqs[-1], "chain": len(manifests),
                               "bytes": sum(m.total_bytes for m in manifests), "verify_s": verify_s,
                               "load_s": load_s, "s": verify_s + load_s, "mem": mem.as_dict()})
        log(f"restore {name} into a new EV: verify {verify_s:.2f}s + load {load_s:.2f}s, "
            f"RSS +{mem.extra_mib:.0f} MiB (the table), peak {mem.transient_mib:.0f} MiB above that")
        del fresh, rmgr
        gc.collect()
    if args.restore_live:
        # Going back in time in a running job: restore the full into the live, full table.
        with PeakRss() as mem:
            t0 = time.perf_counter()
            CheckpointManager(root, [ev], global_step=step, keep_chains=None,
                              chunk_rows=args.chunk_rows).restore(seq=chain[0], verify=False)
            dt = time.perf_counter() - t0
        out["restore_live"] = {"what": "full into the live table", "load_s": dt, "mem": mem.as_dict()}
        log(f"restore full into the live table: load {dt:.2f}s")

    if args.peer_python and not args.no_tfra:
        del ev, mgr
        gc.collect()
        log("TFRA peer ...")
        out["tfra"] = run_tfra(args)
        t = out["tfra"]
        if "save_s_median" in t:
            out["tfra_save_vs_evstore"] = t["save_s_median"] / full_s
            log(f"TFRA save {t['save_s_median']:.2f}s ({t['bytes']} bytes), extra memory "
                f"{t['extra_mib_max']:.0f} MiB; restore {t['restore_s']:.2f}s")
        else:
            log(f"TFRA: {t}")
    out["targets"] = TARGETS
    return out


if __name__ == "__main__":
    sys.exit(main())
