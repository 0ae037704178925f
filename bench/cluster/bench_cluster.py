"""Parameter-server training on a loopback cluster: evstore vs TFRA's `devices=[...]` sharding.

    .venv/bin/python -m bench.cluster.bench_cluster            # batch 1024; 2 PS with 1 and 2 workers, 1 and 4 PS with 1
                                                       # worker; 5 warm-up + 2 x 30 steps per worker (~12 min)
    .venv/bin/python -m bench.cluster.bench_cluster --quick    # batch 256, vocabs <= 100k, 2 PS only, 2 warm-up + 8 steps
    .venv/bin/python -m bench.cluster.bench_cluster --systems evstore,tfra --worker-counts 1 --ps-counts "" --batch-size 512
    .venv/bin/python -m bench.cluster.bench_cluster --render bench/results/cluster-<stamp>.json   # reprint the tables

Every run is one chief process (`--chief`: this file for evstore,
bench/peers/peer_tfra_cluster.py in the .peer-tfra venv for TFRA) that starts its
own loopback cluster of --ps PS tasks and W worker tasks, each a separate
process of its venv that loads the system's ops before starting
`tf.distribute.Server` (`python -m evstore_app server` for evstore,
bench/cluster/cluster_server.py importing TFRA for TFRA), and drives it the same way
for both systems: ParameterServerStrategy + ClusterCoordinator, one
`coord.schedule` per step of a tf.function running `strategy.run(step)` on a
worker, the input a per-worker dataset (bench/cluster/cluster_driver.py).

The model is bench_e2e.py's Criteo-like wide & deep (26 fields, Zipf ids,
13 dense features, embeddings dim 16, a dim-1 wide table, Dense 256-128-1 as
plain variables on the PS), Adam(1e-3) everywhere. Systems:
  evstore        `evstore.EmbeddingVariable(name, dim, shards=--ps)` per table
                 (keys hashed to shards, shard i on PS i), evstore.optimizers.Adam
                 (fused sparse apply on the PS), explicit int64 global step.
  evstore_table  unsharded EVs, table i on PS i % --ps (`tf.device`): per-table
                 placement, lookups of unique ids (tf.unique on the worker).
  evstore_group  as evstore, the 27 lookups in one `evstore.embedding_lookup_group`
                 (one exchange per PS per step whatever the number of tables).
  evstore_2shards  2 shards per table, on PS i % --ps and (i + 1) % --ps
                 (`shards=2, devices=[...]`): fewer, larger tensors per PS.
  tfra           TFRA 0.8.1 `de.keras.layers.Embedding(dim, devices=[all PS])`
                 per table (TFRA's key-sharding over the PS), de.DynamicEmbeddingOptimizer
                 (tf_keras legacy Adam), in TF 2.16.
Measured per window of steps (after coord.join()): examples/s; TCP payload
bytes between each pair of roles from the kernel's per-socket counters
(`ss -tinpH`: bytes_sent / bytes_received per socket, owner pid -> role); and
gRPC calls per step: every process runs with TF_CPP_VMODULE=grpc_state=2, so
TensorFlow logs "Starting call: <method>" for each unary RPC it issues
(RunComponentFunction = a function partition run on a remote task, RecvTensor
= one tensor fetched across tasks, ...). Also the analytic minimum bytes of a
step (unique ids x 8 B out, rows x dim x 4 B back, row gradients x dim x 4 B
out, dense parameters and their gradients x 4 B) and CPU seconds per role
(/proc); bench/cluster/cluster_report.py renders the tables and the 8/32-PS model. Results:
bench/results/cluster-<UTC>.json and .md; logs in bench/results/logs/.
"""
import argparse
import json
import os
import re
import sys
import time


from bench.harness.paths import ROOT, write_result
from bench.harness.driver import (add_driver_args, apply_quick, chosen, git_describe, log_dir, run_meta,
                                  utc_stamp)
from bench.harness.peers import module_cmd, run_json, venv_python
from bench.cluster import cluster_driver
from bench.training.bench_e2e import N_FIELDS
from bench.cluster.cluster_common import emit, ss_available
from bench.cluster.cluster_report import render

SYSTEMS = ("evstore", "evstore_group", "evstore_table", "evstore_2shards", "tfra")
PLACEMENT = {"evstore": "shards", "evstore_group": "group", "evstore_table": "table", "evstore_2shards": "shards2"}


def build_evstore(args):
    """The `build` of cluster_driver.run for evstore (sharded or per-table placement)."""
    def build(tf, strategy, ps_devices):
        import evstore
        init = tf.random_normal_initializer(0.0, 0.01, seed=args.seed)
        evs = []
        for i in range(N_FIELDS + 1):
            name, dim = (f"emb_{i}", args.dim) if i < N_FIELDS else ("wide_emb", 1)
            if args.placement == "table":
                with tf.device(ps_devices[i % len(ps_devices)]):
                    evs.append(evstore.EmbeddingVariable(name, dim, initializer=init))
            elif args.placement == "shards2":  # 2 shards per table, on PS i and i + 1 (mod #PS)
                devs = [ps_devices[(i + j) % len(ps_devices)] for j in range(min(2, len(ps_devices)))]
                evs.append(evstore.EmbeddingVariable(name, dim, initializer=init, shards=len(devs), devices=devs))
            else:  # "shards", "group": shard i on PS i (devices=None under the strategy)
                evs.append(evstore.EmbeddingVariable(name, dim, initializer=init, shards=len(ps_devices)))
        dvars = cluster_driver.dense_variables(tf, args.dim, args.seed)
        step = tf.Variable(0, dtype=tf.int64, name="global_step")
        opt = evstore.optimizers.Adam(1e-3)
        ev_vars = [v for ev in evs for v in (getattr(ev, "trainable_variables", None) or [ev])]
        tvars = ev_vars + dvars
        opt.build([getattr(v, "_proxy", v) for v in tvars])  # Keras builds on variables: an EV by its proxy

        def lookup(ev, ids):
            if args.placement == "table":  # unique on the worker: only distinct ids cross to the PS
                u, idx = tf.unique(ids)
                return tf.gather(evstore.embedding_lookup(ev, u), idx)
            return evstore.embedding_lookup(ev, ids)

        def replica_step(ids, dense, labels):
            with tf.GradientTape() as tape:
                if args.placement == "group":  # every table's lookup in one exchange per PS
                    out = evstore.embedding_lookup_group(evs, [ids[:, f] for f in range(N_FIELDS)]
                                                         + [tf.reshape(ids, [-1])])
                    rows, wide = out[:N_FIELDS], out[N_FIELDS]
                else:
                    rows = [lookup(evs[f], ids[:, f]) for f in range(N_FIELDS)]
                    wide = lookup(evs[N_FIELDS], tf.reshape(ids, [-1]))
                loss = cluster_driver.forward(tf, dvars, rows, wide, dense, labels)
            grads = tape.gradient(loss, tvars)
            opt.apply_gradients(zip(grads, tvars), global_step=step.assign_add(1))
            return loss

        def sizes():
            return {"rows_fields": int(sum(int(ev.size()) for ev in evs[:N_FIELDS])),
                    "rows_wide": int(evs[N_FIELDS].size())}

        return replica_step, {"placement": args.placement, "optimizer": "evstore.optimizers.Adam",
                              "evstore_commit": git_describe(), "sizes": sizes}
    return build


def run_chief(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    res = cluster_driver.run(args, "evstore", sys.executable, build_evstore(args))
    res["system"] = {v: k for k, v in PLACEMENT.items()}[args.placement]
    emit(res)


def _first_error(log_path):
    """': <the first TF error status in the log>' (an INVALID_ARGUMENT, FAILED_PRECONDITION,
    NOT_FOUND or INTERNAL before the ABORTED / CANCELLED ones it causes), or ''."""
    with open(log_path, errors="replace") as f:
        lines = [ln for ln in f if "Starting call" not in ln and "remote_handle" not in ln]
    for codes in ("INVALID_ARGUMENT|FAILED_PRECONDITION|NOT_FOUND|INTERNAL", "ABORTED"):
        for line in lines:
            m = re.search(r"\b(" + codes + r"): (.{0,160})", line)
            if m and m.group(2).strip():
                return f": {m.group(1)}: {m.group(2).strip()}"
    return ""


def run_one(system, ps, workers, args, peer_py, logdir, stamp):
    """One chief process; returns its JSON result (or {"error": ...})."""
    tag = f"{stamp}_{system}_ps{ps}_w{workers}"
    chief_log = os.path.join(logdir, f"cluster_{tag}_chief.log")
    common = ["--ps", str(ps), "--workers", str(workers), "--batch-size", str(args.batch_size),
              "--dim", str(args.dim), "--max-vocab", str(args.max_vocab), "--pool", str(args.pool),
              "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
              "--seed", str(args.seed), "--threads", str(args.threads), "--log-dir", logdir, "--tag", tag,
              "--chief-log", chief_log]
    if system == "tfra":
        if not peer_py:
            return {"error": "TFRA peer venv unavailable"}
        cmd = module_cmd("bench.peers.peer_tfra_cluster", python=peer_py) + common
    else:
        cmd = module_cmd(__spec__.name) + ["--chief", "--placement", PLACEMENT[system]] + common
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="grpc_state=2")
    res = run_json(cmd, chief_log, args.timeout, what="chief", env=env)
    if "error" in res:
        res["error"] += _first_error(chief_log)
    else:
        res["chief_wall_s"] = res.pop("wall_s")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--placement", choices=tuple(PLACEMENT.values()), default="shards", help=argparse.SUPPRESS)
    cluster_driver.add_args(ap)
    add_driver_args(ap, "cluster", SYSTEMS, timeout_help="seconds per chief process",
                    quick_help="smoke run: batch 256, --max-vocab 100000, 2 warm-up + 1 round of 8 steps "
                               "(unless given)")
    ap.add_argument("--worker-counts", default="1,2", help="comma-separated worker counts, with --ps PS (default 1,2)")
    ap.add_argument("--ps-counts", default="1,4",
                    help="extra runs with 1 worker and these PS counts, for the cost-per-PS fit (default 1,4; "
                         "quick: none)")
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.chief:
        return run_chief(args)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        print(render(data["meta"], data["results"]))
        return None
    apply_quick(args, argv, (("--batch-size", 256), ("--max-vocab", 100_000), ("--warmup", 2), ("--steps", 8),
                             ("--rounds", 1), ("--pool", 12), ("--ps-counts", "")))
    systems = chosen(args.systems, SYSTEMS, "--systems")
    counts = [int(w) for w in args.worker_counts.split(",") if w]
    configs = [(args.ps, w) for w in counts] + [(p, 1) for p in (int(x) for x in args.ps_counts.split(",") if x)
                                                 if p != args.ps]
    if not ss_available():
        raise SystemExit("`ss` (iproute2) is required to read per-socket byte counters")
    peer_py = venv_python(args.peer_venv, needed="tfra" in systems)
    logdir = log_dir(args.out_dir)
    stamp = utc_stamp()
    t_start = time.time()
    results = {}
    for p, w in configs:           # per configuration, the systems back to back (closest in time)
        for s in systems:
            print(f"[{time.time() - t_start:5.0f}s] {s}, {p} PS, {w} worker(s) ...", flush=True)
            r = run_one(s, p, w, args, peer_py, logdir, stamp)
            results[f"{s}/ps{p}/w{w}"] = r
            print("    " + (r["error"] if "error" in r else
                            f"{r['examples_per_s']:,.0f} examples/s, "
                            f"{r['per_step']['worker_ps_bytes'] / 1e6:.2f} MB and "
                            f"{r['per_step']['worker_ps_rpcs']:.0f} RPCs worker<->PS per step"), flush=True)
    meta = {**run_meta(stamp, argv), "ps": args.ps, "worker_counts": counts,
            "configs": configs,
            "systems": systems, "batch_size": args.batch_size, "dim": args.dim, "max_vocab": args.max_vocab,
            "pool": args.pool, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
            "seed": args.seed, "total_s": time.time() - t_start}
    md = f"## Parameter-server training on a loopback cluster {stamp}\n\n" + render(meta, results)
    base = write_result(f"cluster-{stamp}", {"meta": meta, "results": results}, md=md, out_dir=args.out_dir)
    print(json.dumps({"meta": meta, "results": results, "markdown": md, "files": os.path.relpath(base, ROOT)}),
          flush=True)  # for bench/run.py: its last "{" line
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
