"""`make bench`: evstore vs TFRA, TF DenseHashTable and numpy gather over a size matrix.

    .venv/bin/python -m bench.run            # default matrix: 1M and 10M keys x dim 16 and 64
    .venv/bin/python -m bench.run --quick    # ~1 minute smoke run (100k keys, 5 rounds)
    .venv/bin/python -m bench.run --matrix 1000000x16 --batches 10

For each (keys, dim), one configuration in memory at a time, it runs
bench/tables/bench_lookup.py twice, each a fresh process measuring its systems
interleaved batch by batch (every ratio is taken within one run):
  run A  evstore, TF DenseHashTable, numpy gather   phases read, insert
  run B  evstore, TFRA                               phases read, insert, train
and then bench/tables/bench_insert_build.py:
  run I  evstore, TF DenseHashTable, each built from empty to the configuration's keys by
         batches of new keys, every batch timed (growth and first touch included on both
         sides: the new-key insert comparison; run A's insert phase is its steady batches;
         --no-insert-build skips it, --only-insert-build runs only it)
A configuration whose run A would not fit in memory (estimated over --solo-above-mib, default
8 GiB: 10M x 64) runs each system in a process of its own instead, one after another in
--solo-rounds rounds (bench/tables/solo_runs.py), run I's two tables too; its tables read as
the others', and its notes give its cells by CPU time per key.
Then, for configurations of at most --opt-max-keys keys (default 1M), run O:
bench/tables/bench_optimizers.py, each fused optimizer apply (SGD, Adagrad, Adam, AdamW,
Ftrl, GroupAdam, GroupAdagrad) against TFRA's apply_gradients with TF's
optimizer of the same batch (bench/peers/peer_tfra_optimizers.py).
The other parts follow in this order, the shorter first (a run stopped part-way keeps
the parts it finished): end-to-end training, filters, tiered, checkpoints, serving, cluster.
bench/training/bench_e2e.py: a wide & deep model's examples/s, evstore vs TF hashing vs
TFRA (--no-e2e skips it).
Then bench/tables/bench_filters.py (admission filters and eviction on a Zipf stream,
vs TFRA's restrict policies; skip with --no-filters) appends its table.
Then bench/tiered/bench_tiered.py engine (the tiered row store against the all-DRAM
table, core only, 300k keys x 64 with Adam, 10% in DRAM, one round; the RocksDB
peer only where librocksdb-dev is installed; skip with --no-tiered).
Each of these three is bounded by --part-timeout: one that fails or runs past it is
stopped with its workers and its section says why.
Then bench/checkpoints/bench_checkpoint.py (one process, --checkpoint-keys keys x dim 16 with
Adam slots): full save vs a sequential write of the same bytes, extra memory,
delta saves at 0.1% / 1% / 10% dirty keys, restores, and TFRA's
tf.train.Checkpoint save of the same table (--no-checkpoint skips it,
--only-checkpoint runs nothing else).
Then bench/serving/bench_serving.py (one process plus its trainer process): delta apply
rows/s at dim 16 and 64, memory of a delta apply vs a second load (TF Serving's
reload), freshness and predict p50/p99 idle vs under continuous application;
then bench/serving/bench_serving_net.py: `evstore serve` over REST (wrk) and gRPC
against the export's in-process signature call rate, batch 1 and 64, and p99
while deltas apply (--no-serving skips both, --only-serving runs nothing else).
Then bench/cluster/bench_cluster.py (parameter-server training on a loopback cluster,
evstore vs TFRA's devices=[...]: examples/s with 1 and 2 workers, bytes and
gRPC calls per step, the 8/32-PS model; --no-cluster skips it, --only-cluster
runs nothing else).

TFRA is bench/peers/peer_tfra.py in the .peer-tfra venv (created with
bench/peers/tfra-setup.sh if missing); if that fails, TFRA is reported as
unavailable and everything else still runs. A run whose estimated peak memory
exceeds MemAvailable is skipped (and reported). With EVSTORE_BENCH_BIGMEM_LOCK=<file>
set, each configuration or part estimated above EVSTORE_BENCH_BIGMEM_MIB (default
6144) runs holding flock(2) on that file, the lock `flock <file> <command>` takes
(bench/harness/bigmem.py), and MemAvailable is checked once it is held.

Writes bench/results/bench-<UTC time>.json (all raw numbers) and .md (the
tables printed to stdout); logs go to bench/results/logs/. After each part the
raw results so far go to bench-<UTC time>.partial.json (removed when the run
completes), so a run stopped part-way keeps what it measured: `--render` it.
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

from bench.harness.bigmem import big_memory
from bench.harness.driver import log_dir, run_meta, utc_stamp
from bench.harness.paths import RESULTS, ROOT, write_result
from bench.harness.peers import DEFAULT_VENV, ensure_peer, last_line, module_cmd, run_json
from bench.harness.rss import mem_available_mib
from bench.section_tables import checkpoint_tables, cluster_tables, serving_tables
from bench.tables.bench_insert_build import dense_hash_buckets
from bench.tables.solo_runs import build_solo, run_solo

DEFAULT_MATRIX = "1000000x16,1000000x64,10000000x16,10000000x64"
QUICK_MATRIX = "100000x16,100000x64"
TARGETS = {"tfra": 3.0, "dense_hash": 2.0, "numpy": 0.6, "adam": 3.0, "bytes": 32}
# The cells a configuration run one system per process also gives by CPU time per key, its systems
# having run at different times: (label, run, evstore's workload, the peer, the peer's workload).
CPU_CELLS = (("find vs TFRA", "B", "find", "tfra", "find"),
             ("find vs DenseHashTable", "A", "find", "dense_hash", "find"),
             ("new-key insert vs DenseHashTable", "A", "foi_new", "dense_hash", "insert_new"),
             ("new-key insert vs TFRA", "B", "foi_new", "tfra", "insert_new"),
             ("training step vs TFRA's", "B", "train_step", "tfra", "train_step"))


BUILD_SKIPPED = {"skipped": "--no-insert-build"}


def est_peak_mib(keys, dim):
    """Rough peak of one run: about 6x the raw rows (keys, versions and rows), plus the process itself."""
    return keys * (4 * dim + 16) * 6 / 2**20 + 1500


def est_checkpoint_peak_mib(keys):
    """Rough peak of the checkpoint part (dim 16 with Adam slots): about 1 KB a key over its two
    processes (evstore's table and saves; the TFRA peer holds its table twice while it restores)."""
    return keys * 1024 / 2**20 + 1500


def run_bench(keys, dim, args, tag, extra, logdir, module="bench.tables.bench_lookup"):
    """One bench_lookup (or `module`) process; returns its JSON result (or {"error": ...})."""
    script = module.rsplit(".", 1)[1]
    cmd = module_cmd(module) + ["--keys", str(keys), "--dim", str(dim),
           "--batch", str(args.batch), "--batches", str(args.batches), "--warmup", str(args.warmup),
           "--seed", str(args.seed), "--log-dir", logdir] + extra
    return run_json(cmd, os.path.join(logdir, f"{script}_{keys}x{dim}_{tag}.log"), args.timeout)


def est_solo_peak_mib(keys, dim, batch, inserted_batches):
    """Rough peak of the largest process of a configuration run one system per process
    (bench/tables/solo_runs.py): evstore's after its first Adam apply, which widens every row to three
    times its width (weights, m, v) block by block for the keys the insert phase added by then, holding
    the new rows and at most the widening's bound beside them (arena.h WidenBoundBytes: four new blocks
    of 65,536 rows and one old); plus the rows' versions, its index and metadata, and the process."""
    n = keys + inserted_batches * batch
    widen_bound = (4 * 3 + 1) * 65536 * 4 * dim
    return (n * (12 * dim + 56) + widen_bound) / 2**20 + 1500


def est_build_peak_mib(keys, dim, batch, one_per_process):
    """Rough peak of run I: DenseHashTable about twice its final buckets (key + row each; its last doubling
    holds the old and the new buckets, and its process peaked at 9.3 GiB at 10M x 64); evstore its rows,
    versions, index and metadata (about 40 bytes a key) and a reserved block. One process holds both
    tables, or (one_per_process) the larger."""
    dense = dense_hash_buckets(keys, batch) * (8 + 4 * dim) * 2.1
    ev = keys * (4 * dim + 8 + 40) * 1.2
    return (max(dense, ev) if one_per_process else dense + ev) / 2**20 + 1500


def solo(keys, dim, args):
    """Whether a configuration runs one system per process: run A's estimated peak, three tables
    in one process, over --solo-above-mib."""
    return est_peak_mib(keys, dim) > args.solo_above_mib


def run_build(keys, dim, args, logdir):
    """Run I: bench_insert_build, both tables built from empty by new keys, in one process; or, for a
    configuration run one system per process (solo()), one table per process in --solo-rounds rounds."""
    def run_one(tag, systems):
        return run_json(module_cmd("bench.tables.bench_insert_build") + [
            "--keys", str(keys), "--dim", str(dim), "--batch", str(args.batch), "--systems", systems],
            os.path.join(logdir, f"bench_insert_build_{keys}x{dim}_{tag}.log"), args.timeout)
    if solo(keys, dim, args):
        return build_solo(run_one, args.solo_rounds)
    return run_one("I", "evstore,dense_hash")


def run_config(keys, dim, args, peer_py, logdir):
    """Run A: evstore vs DenseHashTable and numpy (read, insert). Run B: evstore
    vs TFRA (read, insert, train). Separate processes keep the peak memory of
    10M x 64 in bounds; every ratio is taken within one run. A configuration
    whose run A would not fit (solo()) runs one system per process instead."""
    out = {"keys": keys, "dim": dim}
    if args.only_insert_build:
        out["I"] = run_build(keys, dim, args, logdir)
        return out
    if solo(keys, dim, args):
        def run_one(tag, extra, peer):
            return run_bench(keys, dim, args, tag, extra + (["--peer-python", peer_py] if peer else []), logdir)
        out.update(run_solo(run_one, args.solo_rounds, args.batch, peer_py is not None))
        out["I"] = BUILD_SKIPPED if args.no_insert_build else run_build(keys, dim, args, logdir)
        return out
    out["A"] = run_bench(keys, dim, args, "A", ["--systems", "evstore,dense_hash,numpy",
                                                "--phases", "read,insert"], logdir)
    out["B"] = run_bench(keys, dim, args, "B", ["--systems", "evstore", "--phases", "read,insert,train"]
                         + (["--peer-python", peer_py] if peer_py else []), logdir)
    out["I"] = BUILD_SKIPPED if args.no_insert_build else run_build(keys, dim, args, logdir)
    if keys <= args.opt_max_keys:
        out["O"] = run_bench(keys, dim, args, "O", (["--peer-python", peer_py] if peer_py else []), logdir,
                             module="bench.tables.bench_optimizers")
    return out


def run_checkpoint(args, peer_py, logdir):
    """One bench_checkpoint.py process; returns its JSON result (or {"error": ...})."""
    cmd = module_cmd("bench.checkpoints.bench_checkpoint") + ["--keys", str(args.checkpoint_keys),
           "--dim", "16", "--repeats", str(args.checkpoint_repeats), "--seed", str(args.seed), "--log-dir", logdir]
    cmd += ["--peer-python", peer_py] if peer_py else ["--no-tfra"]
    log_path = os.path.join(logdir, f"bench_checkpoint_{args.checkpoint_keys}x16.log")
    return run_json(cmd, log_path, args.timeout)


def run_serving(args, logdir):
    """One bench_serving.py process; returns its JSON result (or {"error": ...})."""
    cmd = module_cmd("bench.serving.bench_serving") + ["--seed", str(args.seed)]
    if args.quick:
        cmd += ["--keys", "200000", "--delta-rows", "100000", "--apply-rounds", "2", "--live-s", "10"]
    res = run_json(cmd, os.path.join(logdir, "bench_serving.log"), args.timeout)
    net = module_cmd("bench.serving.bench_serving_net") + ["--seed", str(args.seed)]
    if args.quick:
        net += ["--seconds", "5", "--rounds", "2"]
    res["net"] = run_json(net, os.path.join(logdir, "bench_serving_net.log"), args.timeout)
    return res


def run_cluster(args, peer_py, logdir):
    """One bench_cluster.py orchestrator (its chiefs and servers are its children). It exits 1
    when one system failed (TFRA fails with 2 workers), its result recording which: that result
    is kept."""
    cmd = module_cmd("bench.cluster.bench_cluster") + ["--out-dir", args.out_dir, "--seed", str(args.seed)]
    cmd += (["--quick"] if args.quick else []) + (["--peer-venv", args.peer_venv] if peer_py else
                                                   ["--systems", "evstore,evstore_table"])
    return run_json(cmd, os.path.join(logdir, "bench_cluster.log"), max(args.timeout, 5400), partial_ok=True)


def _group_alive(pgid):
    """Whether a process of group `pgid` still runs (a zombie, dead and awaiting its reaper, does not)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):   # not a process, or gone meanwhile
            continue
        if int(pgrp) == pgid and state not in "ZX":
            return True
    return False


def run_part(cmd, log_path, timeout):
    """Runs one part's driver (its workers are its children) from the repository root, stderr to `log_path`.
    Returns (stdout, None) when it exits 0, else (stdout, the reason). A part still running after `timeout`
    seconds is killed with its whole process group, and the reason says so: the run goes on to the next part
    once every process of the group has exited (a SIGKILLed worker holds its memory until it has)."""
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except BaseException as e:  # the time bound, or the run itself interrupted: no worker outlives it
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            while _group_alive(p.pid):   # the driver is reaped; its workers die on their own CPU time
                time.sleep(0.01)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return out, f"stopped after {timeout:.0f} s (the part's time bound, --part-timeout)"
    return out, (f"failed (exit {p.returncode}{last_line(log_path)})" if p.returncode else None)


def m(x):
    return "n/a" if x is None else f"{x / 1e6:.2f}"


def ratio(a, b, target=None):
    if a is None or b is None or b == 0:
        return "n/a"
    r = a / b
    mark = "" if target is None else (" ✓" if r >= target else " ✗")
    return f"{r:.2f}x{mark}"


def g(res, run, sys_name, key):
    v = res.get(run, {}).get(sys_name, {}).get(key)
    return v if isinstance(v, (int, float)) else None


def table(results, title, note, cols):
    """cols: (header, fn(result) -> cell) pairs after the keys / dim columns. No results: no table."""
    if not results:
        return []
    out = [f"\n### {title}\n", note + "\n" if note else "",
           "| keys | dim | " + " | ".join(h for h, _ in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for r in results:
        out.append(f"| {r['keys'] / 1e6:g}M | {r['dim']} | " + " | ".join(f(r) for _, f in cols) + " |")
    return [x for x in out if x != ""]


def tables(results, tfra_note):
    T = TARGETS
    ok = [r for r in results if "error" not in r]
    ab = [r for r in ok if "A" in r or "B" in r]       # --only-insert-build runs neither
    built = [r for r in ok if "I" in r]
    out = []

    def f1(x, p=1):
        return "n/a" if x is None else f"{x:.{p}f}"

    def rate_cols(ev_a, dht, ev_b, tfra, gather=True):
        cols = [("evstore (A)", lambda r: m(g(r, "A", "evstore", ev_a))),
                ("DenseHashTable (A)", lambda r: m(g(r, "A", "dense_hash", dht)))]
        if gather:
            cols += [("numpy `t[idx]` (A)", lambda r: m(g(r, "A", "numpy", "gather"))),
                     ("numpy take (A)", lambda r: m(g(r, "A", "numpy", "take")))]
        cols += [(f"vs DHT (≥{T['dense_hash']}x)",
                  lambda r: ratio(g(r, "A", "evstore", ev_a), g(r, "A", "dense_hash", dht), T["dense_hash"])),
                 (f"vs gather (≥{T['numpy']}x)",
                  lambda r: ratio(g(r, "A", "evstore", ev_a), g(r, "A", "numpy", "gather"), T["numpy"])),
                 ("evstore (B)", lambda r: m(g(r, "B", "evstore", ev_b))),
                 ("TFRA (B)", lambda r: m(g(r, "B", "tfra", tfra))),
                 (f"vs TFRA (≥{T['tfra']}x)",
                  lambda r: ratio(g(r, "B", "evstore", ev_b), g(r, "B", "tfra", tfra), T["tfra"]))]
        return cols

    out += table(ab, "Read-only find (M keys/s)", "evstore EvFind; DenseHashTable.lookup; TFRA "
                 "CuckooHashTable.lookup.", rate_cols("find", "find", "find", "find"))
    out += table(ab, "Find-or-insert, existing keys (training-lookup hit; M keys/s)",
                 "evstore EvFindOrInsert (counts frequency) vs DenseHashTable.lookup (it has no "
                 "find-or-insert) and TFRA's training read `de.Variable.lookup` (find + initializer rows).",
                 rate_cols("foi_hit", "find", "foi_hit", "lookup_init", gather=False))
    out += table(ab, "Find-or-insert, new keys (every key inserted; M keys/s)",
                 "evstore EvFindOrInsert of never-seen keys vs `insert` of the same keys with supplied rows, into "
                 "tables already holding the configuration's keys; medians of the batches. DenseHashTable grows by "
                 "doubling inside one batch (at 10M keys, in none of these), so its median batch writes memory its "
                 "last doubling already touched: run I below is the like-for-like insert comparison.",
                 rate_cols("foi_new", "insert_new", "foi_new", "insert_new", gather=False))
    def build(system, key):
        return lambda r: m((r.get("I", {}).get(system) or {}).get(key))

    def build_ratio(key):
        def cell(r):
            ev, dh = ((r.get("I", {}).get(s) or {}).get(key) for s in ("evstore", "dense_hash"))
            return ratio(ev, dh, 1.0)
        return cell

    out += table(built, "New keys, amortized: each table built from empty (run I; M keys/s)",
                 "bench_insert_build: evstore EvFindOrInsert and DenseHashTable.insert (supplied rows) of the same "
                 "batches of new keys until each holds the configuration's keys, unsized, in turns; keys / the sum "
                 "of every batch's time, so both pay their growth and the first touch of their memory. CPU: the "
                 "process's, all threads. Bytes per key: what each table holds at the end.",
                 [("evstore wall", build("evstore", "rate_wall")),
                  ("DenseHashTable wall", build("dense_hash", "rate_wall")),
                  ("vs (≥1x)", build_ratio("rate_wall")),
                  ("evstore CPU", build("evstore", "rate_cpu")),
                  ("DenseHashTable CPU", build("dense_hash", "rate_cpu")),
                  ("vs CPU (≥1x)", build_ratio("rate_cpu")),
                  ("bytes/key evstore", lambda r: f1((r.get("I", {}).get("evstore") or {}).get("bytes_per_key"), 0)),
                  ("bytes/key DenseHashTable",
                   lambda r: f1((r.get("I", {}).get("dense_hash") or {}).get("bytes_per_key"), 0))])

    def worst(run, system, key):
        def cell(r):
            spread = (r.get(run, {}).get(system) or {}).get(key + "_s_min_med_max")
            return f1(spread[-1] * 1e3, 0) if spread else "n/a"
        return cell

    out += table(ab, "Insert phase: slowest of the timed batches (ms)",
                 "Medians hide growth pauses: a table that rehashes all at once shows one slow batch.",
                 [("evstore (A)", worst("A", "evstore", "foi_new")),
                  ("DenseHashTable (A)", worst("A", "dense_hash", "insert_new")),
                  ("evstore (B)", worst("B", "evstore", "foi_new")),
                  ("TFRA (B)", worst("B", "tfra", "insert_new"))])
    out += table(ab, "Adam (run B; M keys/s)",
                 "apply = EvApplyAdam alone; step = lookup + gradient + apply_gradients (its "
                 "apply_gradients part alone in the next columns). DESIGN target: fused apply ≥ 3x TFRA's step.",
                 [("evstore apply", lambda r: m(g(r, "B", "evstore", "adam_apply"))),
                  ("evstore step", lambda r: m(g(r, "B", "evstore", "train_step"))),
                  ("TFRA step", lambda r: m(g(r, "B", "tfra", "train_step"))),
                  (f"apply vs TFRA step (≥{T['adam']}x)", lambda r: ratio(
                      g(r, "B", "evstore", "adam_apply"), g(r, "B", "tfra", "train_step"), T["adam"])),
                  ("step vs step", lambda r: ratio(g(r, "B", "evstore", "train_step"),
                                                   g(r, "B", "tfra", "train_step"))),
                  ("evstore apply_gradients", lambda r: m(g(r, "B", "evstore", "train_apply"))),
                  ("TFRA apply_gradients", lambda r: m(g(r, "B", "tfra", "train_apply"))),
                  ("vs", lambda r: ratio(g(r, "B", "evstore", "train_apply"), g(r, "B", "tfra", "train_apply"))),
                  ("evstore 1st apply (s)", lambda r: f1(g(r, "B", "evstore", "adam_apply_first_s"), 2))])

    def total_sealed(r):
        st = r.get("A", {}).get("evstore", {}).get("stats_after_seal") or {}
        if not st.get("size"):
            return "n/a"
        tot = (st["index_bytes"] + st["meta_bytes"] + st["row_bytes"]) / st["size"]
        return f"{tot:.1f} ({'✓' if tot <= 4 * r['dim'] + 32 else '✗'} {4 * r['dim'] + 32})"

    def rows_after_adam(r):
        st = r.get("B", {}).get("evstore", {}).get("stats_final") or {}
        return f1(st["row_bytes"] / st["size"]) if st.get("size") else "n/a"

    out += table(ab, "evstore memory (bytes per key)",
                 f"index + meta target ≤ {T['bytes']} (4*dim+32 in total without slots). 'all dirty': right after "
                 "the fill, every key on the dirty list (8 B/key of index_bytes); 'sealed': after a committed "
                 "export. RSS: growth of the process during the fill (run B).",
                 [("index+meta, all dirty", lambda r: f1(g(r, "A", "evstore", "index_meta_bytes_per_key"))),
                  ("index+meta, sealed", lambda r: f1(g(r, "A", "evstore", "index_meta_bytes_per_key_sealed"))),
                  ("rows", lambda r: f1(g(r, "A", "evstore", "row_bytes_per_key"))),
                  ("total, sealed (≤ 4*dim+32)", lambda r: total_sealed(r)),
                  ("rows after Adam (w, m, v)", rows_after_adam),
                  ("evstore RSS (MiB)", lambda r: f1(g(r, "B", "evstore", "rss_fill_mib"), 0)),
                  ("TFRA RSS (MiB)", lambda r: f1(g(r, "B", "tfra", "rss_fill_mib"), 0))])
    out += optimizer_table(ab)
    notes = [f"- {r['keys']}x{r['dim']}: {r['error']}" for r in results if "error" in r]
    for r in ok:
        if r.get("solo"):
            so = r["solo"]
            notes.append(f"- {r['keys']}x{r['dim']} ran one system per process (runs A and B's three tables "
                         f"would not fit in one), {so['rounds']} rounds in the order "
                         + "; ".join(", ".join(o) for o in so["order"])
                         + ", each system's batches pooled over its rounds; peak RSS per process (MiB): "
                         + ", ".join(f"{p['process']} (round {p['round']}) {p['rss_peak_mib']:.0f}"
                                     for p in so["processes"]
                                     if p.get("rss_peak_mib") is not None))
            cpu = [(what, ratio(g(r, run, "evstore", ours + "_cpu"), g(r, run, peer, theirs + "_cpu")))
                   for what, run, ours, peer, theirs in CPU_CELLS]
            notes.append(f"- {r['keys']}x{r['dim']} by CPU time per key (the median batch's CPU seconds of the "
                         "process doing the work, all its threads): "
                         + ", ".join(f"{what} {x}" for what, x in cpu))
            notes += [f"- {r['keys']}x{r['dim']} {e}" for e in so["errors"]]
        built = r.get("I") or {}
        if built.get("skipped"):
            notes.append(f"- {r['keys']}x{r['dim']} run I skipped ({built['skipped']})")
        if built.get("solo") and "ratio_cpu" in built:
            so = built["solo"]
            notes.append(f"- {r['keys']}x{r['dim']} run I built one table per process, {so['rounds']} rounds in the "
                         "order " + "; ".join(", ".join(o) for o in so["order"]) + "; evstore / DenseHashTable by "
                         "CPU time per key (each process's CPU, all its threads), per round: "
                         + ", ".join(f"{x:.2f}x" for x in built["ratio_cpu"]) + " (wall: "
                         + ", ".join(f"{x:.2f}x" for x in built["ratio_wall"]) + "); peak RSS per process (MiB): "
                         + ", ".join(f"{p['process']} (round {p['round']}) {p['rss_peak_mib']:.0f}"
                                     for p in so["processes"] if p.get("rss_peak_mib") is not None))
        if built.get("solo"):
            notes += [f"- {r['keys']}x{r['dim']} run I {e}" for e in built["solo"]["errors"]]
        if r.get("bigmem_lock"):
            notes.append(f"- {r['keys']}x{r['dim']} ran holding {r['bigmem_lock']['lock']} (waited "
                         f"{r['bigmem_lock']['waited_s']:.0f} s for it)")
        for run in ("A", "B", "I", "O"):
            rr = r.get(run, {})
            if "error" in rr:
                notes.append(f"- {r['keys']}x{r['dim']} run {run}: {rr['error']}")
            if rr.get("tfra_error"):
                notes.append(f"- {r['keys']}x{r['dim']} run {run} TFRA: {rr['tfra_error']}")
            for s in ("evstore", "dense_hash", "numpy", "tfra"):
                entries = (rr.get(s) or {}).items()
                if run == "O":  # nested per optimizer
                    entries = [(f"{o}.{k}", v) for o, d in entries for k, v in d.items()]
                notes += [f"- {r['keys']}x{r['dim']} run {run} {s}.{k}: {v}"
                          for k, v in entries if k.endswith("error")]
    if tfra_note:
        notes.insert(0, f"- TFRA unavailable: {tfra_note}")
    if notes:
        out += ["\n### Errors, skips and notes\n"] + notes
    return "\n".join(out) + "\n"


def optimizer_table(results):
    """Run O: one row per (config, optimizer)."""
    rows = [r for r in results if isinstance(r.get("O"), dict) and "evstore" in r["O"]]
    if not rows:
        return []
    out = ["\n### Optimizer applies (run O; M keys/s)\n",
           "fused = evstore.training.sparse_apply_<opt> (the fused kernel); apply_gradients = "
           "evstore.optimizers.<Opt>.apply_gradients (Keras path); TFRA = DynamicEmbeddingOptimizer(tf_keras "
           "<Opt>).apply_gradients of the same batch. GroupAdam / GroupAdagrad have no TFRA equivalent: "
           "compared with TFRA's Adam / Adagrad (nearest, marked *).\n",
           "| keys | dim | optimizer | slots | evstore fused | evstore apply_gradients | TFRA apply_gradients "
           "| fused vs TFRA | apply_gradients vs TFRA |", "|---" * 9 + "|"]
    for r in rows:
        o = r["O"]
        for name, ev in o["evstore"].items():
            tf_ = o.get("tfra", {}).get(name, {})
            t = tf_.get("apply_gradients")
            tag = tf_.get("workload", "n/a").replace("apply_", "") + ("" if tf_.get("equivalent", True) else "*")
            out.append(f"| {r['keys'] / 1e6:g}M | {r['dim']} | {name} | {', '.join(ev.get('slots') or []) or '-'} "
                       f"| {m(ev.get('fused'))} | {m(ev.get('apply_gradients'))} | {m(t)} ({tag}) "
                       f"| {ratio(ev.get('fused'), t)} | {ratio(ev.get('apply_gradients'), t)} |")
    return out


def evstore_version():
    """git describe of the tree, plus any uncommitted files under evstore/ (a moving tree says so)."""
    try:
        commit = subprocess.run(["git", "describe", "--always"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--", "evstore", "CMakeLists.txt"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.split("\n")
    except OSError:
        return "unknown"
    changed = [c[3:] for c in changed if c.strip()]
    return commit + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_MATRIX}, 5 rounds, 1 warmup")
    ap.add_argument("--matrix", default=None, help=f"comma-separated KEYSxDIM (default {DEFAULT_MATRIX})")
    ap.add_argument("--batch", type=int, default=65536, help="keys per batch (default 65536)")
    ap.add_argument("--batches", type=int, default=None, help="timed rounds per phase (default 20; quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds per phase (default 2; quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    ap.add_argument("--peer-venv", default=DEFAULT_VENV, help="TFRA venv (default .peer-tfra)")
    ap.add_argument("--no-tfra", action="store_true", help="skip the TFRA peer")
    ap.add_argument("--opt-max-keys", type=int, default=1_000_000,
                    help="run the optimizer benchmark (run O) for configurations up to this many keys (default 1M)")
    ap.add_argument("--solo-above-mib", type=float, default=8192,
                    help="run a configuration one system per process, in rounds, when run A's estimated peak "
                         "(its three tables in one process) is over this many MiB (default 8192: 10M x 64 only)")
    ap.add_argument("--no-insert-build", action="store_true",
                    help="skip run I (bench_insert_build: each table built from empty by new keys)")
    ap.add_argument("--only-insert-build", action="store_true",
                    help="run only run I for each configuration of the matrix (nothing else)")
    ap.add_argument("--solo-rounds", type=int, default=2,
                    help="rounds of a configuration run one system per process (default 2)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per bench_lookup.py process (default 1800)")
    ap.add_argument("--part-timeout", type=float, default=5400,
                    help="seconds for each of the end-to-end, filters and tiered parts, after which the part is "
                         "stopped and the run goes on, the reason in its results (default 5400)")
    ap.add_argument("--out-dir", default=RESULTS, help="results directory")
    ap.add_argument("--render", metavar="JSON", help="only print the tables of a saved results file")
    ap.add_argument("--checkpoint-keys", type=int, default=None,
                    help="keys of the checkpoint benchmark (default 10M; quick 200k)")
    ap.add_argument("--checkpoint-repeats", type=int, default=3, help="full saves in the checkpoint benchmark")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint benchmark")
    ap.add_argument("--only-checkpoint", action="store_true", help="run only the checkpoint benchmark")
    ap.add_argument("--no-serving", action="store_true", help="skip the serving benchmark")
    ap.add_argument("--only-serving", action="store_true", help="run only the serving benchmark")
    ap.add_argument("--no-cluster", action="store_true", help="skip the PS-cluster benchmark")
    ap.add_argument("--only-cluster", action="store_true", help="run only the PS-cluster benchmark")
    ap.add_argument("--no-filters", action="store_true", help="skip bench/tables/bench_filters.py")
    ap.add_argument("--no-e2e", action="store_true", help="skip bench/training/bench_e2e.py (end-to-end training)")
    ap.add_argument("--no-tiered", action="store_true", help="skip bench/tiered/bench_tiered.py (tiered row store, core)")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        print((tables(data["results"], None if data["meta"]["tfra"] == "available" else data["meta"]["tfra"])
               if data["results"] else "")
              + "".join(data.get("markdown_parts") or []) + checkpoint_tables(data.get("checkpoint"))
              + serving_tables(data.get("serving")) + cluster_tables(data.get("cluster")))
        return
    matrix = args.matrix or (QUICK_MATRIX if args.quick else DEFAULT_MATRIX)
    args.batches = args.batches or (5 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    configs = [tuple(int(x) for x in c.lower().split("x")) for c in matrix.split(",") if c]
    if args.only_insert_build:
        args.no_filters = args.no_e2e = args.no_tiered = args.no_checkpoint = args.no_serving = True
        args.no_cluster = args.no_tfra = True
    only = [o for o in ("checkpoint", "serving", "cluster") if getattr(args, "only_" + o)]
    if only:
        configs = []
        args.no_filters = args.no_e2e = args.no_tiered = True
        for o in ("checkpoint", "serving", "cluster"):
            setattr(args, "no_" + o, o not in only)
    args.checkpoint_keys = args.checkpoint_keys or (200_000 if args.quick else 10_000_000)

    logdir = log_dir(args.out_dir)
    stamp = utc_stamp()
    peer_py, tfra_note = None, None
    if args.no_tfra:
        tfra_note = "--no-tfra"
    else:
        with open(os.path.join(logdir, "tfra-setup.log"), "w") as log:
            peer_py, tfra_note = ensure_peer(args.peer_venv, log)

    commit = evstore_version()
    t_start = time.time()
    results = []
    ckpt = serving = cluster = None
    e2e_md = filters_md = tiered_md = ""
    partial_path = os.path.join(args.out_dir, f"bench-{stamp}.partial.json")

    def save_partial(done):
        """The raw results so far, after each part: a run stopped or killed part-way keeps what it measured
        (`--render` prints its tables)."""
        meta = {**run_meta(stamp, sys.argv[1:]), "evstore_commit": commit, "tfra": tfra_note or "available",
                "parts_done": done, "elapsed_s": time.time() - t_start}
        # Written aside and renamed into place: a kill mid-write leaves the previous record whole.
        with open(partial_path + ".tmp", "w") as f:
            json.dump({"meta": meta, "results": results, "checkpoint": ckpt, "serving": serving,
                       "cluster": cluster, "markdown_parts": [filters_md, tiered_md, e2e_md]}, f, indent=1)
        os.replace(partial_path + ".tmp", partial_path)
    for keys, dim in configs:
        need = (est_build_peak_mib(keys, dim, args.batch, solo(keys, dim, args)) if args.only_insert_build
                else est_solo_peak_mib(keys, dim, args.batch, args.warmup + args.batches) if solo(keys, dim, args)
                else est_peak_mib(keys, dim))
        with big_memory(need, f"{keys} keys x dim {dim}") as held:
            avail = mem_available_mib()
            if need > avail:
                results.append({"keys": keys, "dim": dim,
                                "error": f"skipped: estimated peak {need:.0f} MiB > MemAvailable {avail:.0f} MiB"})
                print(results[-1]["error"], flush=True)
                continue
            print(f"[{time.time() - t_start:6.0f}s] {keys} keys x dim {dim} ...", flush=True)
            results.append(run_config(keys, dim, args, peer_py, logdir))
        if held:
            results[-1]["bigmem_lock"] = held
        for run in ("A", "B", "I", "O"):
            if "error" in results[-1].get(run, {}):
                print(f"  run {run}: " + results[-1][run]["error"], flush=True)
        save_partial(f"table {keys}x{dim}")

    if not args.no_e2e:
        print(f"[{time.time() - t_start:6.0f}s] end-to-end training (bench_e2e.py) ...", flush=True)
        cmd = module_cmd("bench.training.bench_e2e") + ["--out-dir", args.out_dir]
        cmd += (["--quick"] if args.quick else [])
        cmd += (["--peer-venv", args.peer_venv] if peer_py else ["--systems", "evstore,tf_hash"])
        out, failed = run_part(cmd, os.path.join(logdir, "bench_e2e.log"), args.part_timeout)
        # bench_e2e prints "results: bench/results/e2e-<stamp>.json / .md"
        md = [os.path.join(ROOT, ln.split("results:", 1)[1].split()[0][:-len(".json")] + ".md")
              for ln in out.splitlines() if ln.startswith("results:")]
        md = [m for m in md if os.path.exists(m)]
        e2e_md = ("\n" + open(md[-1]).read()) if not failed and md else (
            f"\n### End-to-end training\n\n{failed or 'no results file'}; see bench/results/logs/bench_e2e.log\n")
        save_partial("e2e")

    if not args.no_filters:
        print(f"[{time.time() - t_start:6.0f}s] filters and eviction (bench_filters.py) ...", flush=True)
        cmd = module_cmd("bench.tables.bench_filters") + ["--out-dir", args.out_dir]
        cmd += (["--quick"] if args.quick else []) + (["--no-tfra"] if peer_py is None else
                                                       ["--peer-python", peer_py])
        out, failed = run_part(cmd, os.path.join(logdir, "bench_filters.log"), args.part_timeout)
        table_lines = out.split("\n\n", 1)[-1].split("results:")[0].strip()
        filters_md = ("\n### Filters and eviction on a Zipf(1.1) stream (bench_filters.py)\n\n"
                      + (table_lines if not failed else f"{failed}; see bench/results/logs/bench_filters.log") + "\n")
        save_partial("filters")

    if not args.no_tiered:
        keys = 100_000 if args.quick else 300_000
        print(f"[{time.time() - t_start:6.0f}s] tiered row store (bench_tiered.py engine, {keys} keys) ...", flush=True)
        cmd = module_cmd("bench.tiered.bench_tiered") + ["engine", "--keys", str(keys), "--rounds", "1"]
        out, failed = run_part(cmd, os.path.join(logdir, "bench_tiered.log"), args.part_timeout)
        parts = [p for p in out.split("\n\n") if " keys x dim 64" in p]
        notes = [ln for ln in out.splitlines() if ln.startswith("RocksDB not found")]
        tiered_md = ("\n### Tiered row store, core only (bench_tiered.py engine)\n\n"
                     + ("\n".join(notes + [parts[-1].strip()]) if not failed and parts else
                        f"{failed or 'no table printed'}; see bench/results/logs/bench_tiered.log") + "\n")
        save_partial("tiered")

    if not args.no_checkpoint:
        print(f"[{time.time() - t_start:6.0f}s] checkpoints: {args.checkpoint_keys} keys x dim 16 ...", flush=True)
        with big_memory(est_checkpoint_peak_mib(args.checkpoint_keys), "checkpoints") as held:
            ckpt = run_checkpoint(args, peer_py, logdir)
        if held:
            ckpt["bigmem_lock"] = held
        if "error" in ckpt:
            print("  " + ckpt["error"], flush=True)
        save_partial("checkpoint")

    if not args.no_serving:
        print(f"[{time.time() - t_start:6.0f}s] serving ...", flush=True)
        serving = run_serving(args, logdir)
        if "error" in serving:
            print("  " + serving["error"], flush=True)
        save_partial("serving")
    if not args.no_cluster:
        print(f"[{time.time() - t_start:6.0f}s] parameter-server cluster (bench_cluster.py) ...", flush=True)
        cluster = run_cluster(args, peer_py, logdir)
        if "error" in cluster:
            print("  " + cluster["error"], flush=True)
        save_partial("cluster")

    meta = {**run_meta(stamp, sys.argv[1:]), "evstore_commit": commit, "platform": platform.platform(),
            "python": platform.python_version(), "batch": args.batch, "batches": args.batches,
            "warmup": args.warmup, "seed": args.seed, "tfra": tfra_note or "available",
            "total_s": time.time() - t_start}
    md = (f"## evstore benchmark {stamp}\n\n`{meta['command']}` — evstore {commit}, {meta['cpus']} CPUs, "
          + (f"batch {args.batch}, run I only (--only-insert-build), {meta['total_s']:.0f} s total.\n"
             if results and args.only_insert_build else
             f"batch {args.batch}, median of {args.batches} interleaved rounds, {meta['total_s']:.0f} s total. "
             "Run A: evstore, DenseHashTable, numpy in one process; run B: evstore and TFRA (subprocess); "
             "ratios are within a run"
             + (" (configurations run one system per process excepted: see the notes)"
                if any(r.get("solo") for r in results) else "") + ".\n" if results else f"{meta['total_s']:.0f} s total.\n")
          + (tables(results, tfra_note) if results else "") + filters_md + tiered_md + e2e_md + checkpoint_tables(ckpt)
          + serving_tables(serving) + cluster_tables(cluster))
    write_result(f"bench-{stamp}",
                 {"meta": meta, "results": results, "checkpoint": ckpt, "serving": serving, "cluster": cluster},
                 md=md, out_dir=args.out_dir)
    if os.path.exists(partial_path):
        os.remove(partial_path)


if __name__ == "__main__":
    sys.exit(main())
