"""Synchronous training (CollectiveEmbeddingVariables, MultiWorkerMirroredStrategy)
vs the parameter-server mode vs one process, on bench_cluster.py's Criteo-like model.

    .venv/bin/python -m bench.cluster.bench_sync                  # global batch 1024, 2 workers, 2 rounds (~10 min)
    .venv/bin/python -m bench.cluster.bench_sync --quick          # batch 256, vocabs <= 100k, 1 round of 8 steps

The model is bench_e2e.py's wide & deep (26 fields of Zipf ids, dim 16, a
dim-1 wide table over all 26 ids, 13 dense features, Dense 256-128-1), Adam.
Per round, back to back (the machine is shared: ratios within a round):
  one       one process, plain EVs, the global batch per step, one grouped lookup;
  sync      W worker processes (MultiWorkerMirroredStrategy), each the slice
            B/W of the global batch: the 27 tables are CollectiveEmbeddingVariables
            looked up in one exchange (evstore/collective.py), the dense part
            mirrored and all-reduced; steps are synchronous;
  ps        bench_cluster.py's evstore_group on 2 PS and W workers (asynchronous),
            each worker step B/W examples (the same examples per W worker steps).
Measured per window: examples/s; TCP payload bytes between the worker
processes (the kernel's per-socket counters, `ss -tinpH`), per worker and
step; collective ops per step (counted in the traced step's graph); and the
analytic minimum of the all-to-all design per worker and step,
(1 - 1/W) * U * (8 + 8 d) summed over the tables (U the worker's distinct
ids of a table: a key out, its row back, its gradient out) plus the ring
all-reduce of the dense gradients, 2 (W - 1) / W * 4 P bytes. The exchange's
own padded payload (counts, keys and counts, rows, gradients) is computed
from the same ids. The cost model (`project`) fits the step time as
compute(B/W) + collectives x latency + bytes / bandwidth with constants from
this run, and projects W = 4 .. 64. Results: bench/results/sync-<UTC>.json / .md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


from bench.harness.paths import RESULTS, ROOT, write_result
from bench.harness.driver import apply_quick, log_dir, run_meta, utc_stamp
from bench.harness.peers import module_cmd
from bench.training.bench_e2e import N_FIELDS
from bench.cluster.cluster_common import tcp_bytes
from bench.cluster.cluster_driver import dense_param_count, dense_variables, forward, make_pool


def _args(ap):
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch (split over the workers)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-vocab", type=int, default=1_000_000)
    ap.add_argument("--pool", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=RESULTS)


def build(tf, args, collective):
    import evstore
    init = tf.random_normal_initializer(0.0, 0.01, seed=args.seed)
    make = evstore.CollectiveEmbeddingVariable if collective else evstore.EmbeddingVariable
    tables = [make(f"emb_{i}", args.dim, initializer=init) for i in range(N_FIELDS)]
    tables.append(make("wide_emb", 1, initializer=init))
    dvars = dense_variables(tf, args.dim, args.seed)
    opt = evstore.optimizers.Adam(1e-3)
    if collective:   # Keras tracks the dense weights only (each worker applies its shards itself)
        opt.build(dvars)
    return tables, dvars, opt


def count_collectives(concrete):
    """{op type: count} of the Collective* ops of a traced function (its library included)."""
    gd = concrete.graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    out = {}
    for n in nodes:
        if n.op.startswith("Collective"):
            out[n.op] = out.get(n.op, 0) + 1
    return out


def measure_links(tf, W, chain=20):
    """The cost model's constants, between the workers: per all-to-all of a
    chain of `chain` dependent ones in one tf.function (no per-call
    dispatch), one element each (the latency per collective) and 4 MB per
    worker each (bytes per second per worker)."""
    from evstore import collective as c

    def per_collective(n):
        @tf.function
        def f(x):
            ik = c._counter().assign_add(1) * chain + (1 << 30)   # a key range of its own
            for i in range(chain):
                x = c._collective(tf.raw_ops.CollectiveAllToAllV2, x, ik + i, W) + 1.0
            return x
        x = tf.ones([W, n])
        f(x).numpy()
        c.all_gather_ints([0], W)
        t0 = time.perf_counter()
        f(x).numpy()
        return (time.perf_counter() - t0) / chain
    small = per_collective(1)
    big_n = (1 << 20) // W
    big = per_collective(big_n)
    return {"small_all_to_all_s": small, "bytes_4mb_per_s_per_worker": (W - 1) / W * W * big_n * 4 / big}


def run_process(args):
    """One measured process: `--role one` or `--role sync --rank r --ports ...`; prints a JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sync = args.role == "sync"
    if sync:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
                                              "task": {"type": "worker", "index": args.rank}})
    import tensorflow as tf

    import evstore
    from evstore.collective import all_gather_ints
    W = args.workers if sync else 1
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if sync else tf.distribute.get_strategy()
    with strategy.scope():
        tables, dvars, opt = build(tf, args, sync)
    ids_p, dense_p, y_p = make_pool(args)
    n = args.batch_size // W
    lo, hi = args.rank * n, (args.rank + 1) * n
    data = [(tf.constant(ids_p[b][lo:hi]), tf.constant(dense_p[b][lo:hi]), tf.constant(y_p[b][lo:hi]))
            for b in range(len(ids_p))]

    def step(ids, dense, labels):
        with tf.GradientTape() as tape:
            rows = evstore.embedding_lookup_group(tables, [ids[:, i] for i in range(N_FIELDS)] + [ids])
            loss = forward(tf, dvars, rows[:N_FIELDS], rows[N_FIELDS], dense, labels) / W   # mean over the global batch
        variables = [t.local if sync else t for t in tables] + dvars
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def train(ids, dense, labels):
        return strategy.run(step, args=(ids, dense, labels))

    collectives = count_collectives(train.get_concrete_function(*data[0])) if sync else {}
    pids = all_gather_ints([os.getpid()], W)[:, 0].tolist() if sync else [os.getpid()]
    roles = {p: f"worker{i}" for i, p in enumerate(pids)}
    for b in range(args.warmup):
        train(*data[b % len(data)])
    windows = []
    k = args.warmup
    for _ in range(args.rounds):
        if sync:
            all_gather_ints([0], W)   # start together
        b0 = tcp_bytes(roles) if sync else {}
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train(*data[k % len(data)])
            k += 1
        float(loss)
        dt = time.perf_counter() - t0
        b1 = tcp_bytes(roles) if sync else {}
        sent = sum(v[0] for v in b1.values()) - sum(v[0] for v in b0.values())
        windows.append({"seconds": dt, "steps": args.steps, "worker_bytes_sent": sent})
    eps = [args.batch_size * w["steps"] / w["seconds"] for w in windows]
    probe = measure_links(tf, W) if sync else {}
    res = {"role": args.role, "rank": args.rank, "workers": W, "examples_per_s": statistics.median(eps),
           "examples_per_s_rounds": eps, "collectives_per_step": collectives,
           "bytes_per_worker_step": statistics.median(w["worker_bytes_sent"] / W / w["steps"] for w in windows),
           "windows": windows, **probe}
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


def analytic(args):
    """Per worker and step (means over the pool): the all-to-all minimum, the exchange's padded payload."""
    import numpy as np
    import tensorflow as tf  # noqa: F401

    from evstore import shard_index
    W, d = args.workers, args.dim
    ids_p, _, _ = make_pool(args)
    n = args.batch_size // W
    mins, padded, uniq = [], [], []
    dims = [d] * N_FIELDS + [1]
    for ids in ids_p:
        per = []   # per worker: per table, counts per owner
        for r in range(W):
            s = ids[r * n:(r + 1) * n]
            cols = [s[:, i] for i in range(N_FIELDS)] + [s.reshape(-1)]
            per.append([np.bincount(shard_index(np.unique(c), W).numpy(), minlength=W) for c in cols])
        counts = np.array(per)                          # [src, table, dst]
        u = counts.sum(axis=2)                          # [src, table] distinct ids
        uniq.append(u.sum(axis=1).mean())
        mins.append(np.mean([sum((1 - 1 / W) * u[r, t] * (8 + 8 * dims[t]) for t in range(len(dims)))
                             for r in range(W)]))
        m_keys = max(counts.sum(axis=1).max(), 1)       # per (src, dst) pair: keys of every table
        m_floats = max((counts * np.array(dims)[None, :, None]).sum(axis=1).max(), 1)
        # what one worker sends the others: counts gather, keys+counts, rows back, gradients back
        padded.append((W - 1) / W * (W * len(dims) * 4 * W + W * m_keys * 16 + 2 * W * m_floats * 4))
    P = dense_param_count(d)
    proj_u = {}
    for w in (2, 4, 8, 16, 32, 64):
        m = args.batch_size // w
        proj_u[w] = [float(np.mean([sum(len(np.unique(ids[r * m:(r + 1) * m, i])) for i in range(N_FIELDS))
                                    for ids in ids_p for r in range(min(w, 4))])),
                     float(np.mean([len(np.unique(ids[r * m:(r + 1) * m])) for ids in ids_p
                                    for r in range(min(w, 4))]))]   # [field tables, wide table]
    return {"unique_ids_by_workers": proj_u, "unique_ids_per_worker": float(np.mean(uniq)), "min_embedding_bytes": float(np.mean(mins)),
            "dense_allreduce_bytes": 2 * (W - 1) / W * 4 * P, "exchange_payload_bytes": float(np.mean(padded)),
            "dense_params": P}


def _spawn(cmd, log):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), start_new_session=True)


def _result(p, timeout=900):
    out, _ = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"a benchmark process failed (exit {p.returncode})")
    return json.loads(lines[-1])


def _common(args):
    return ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--dim", str(args.dim),
            "--max-vocab", str(args.max_vocab), "--pool", str(args.pool), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--rounds", "1", "--seed", str(args.seed)]


def run_one(args, logdir, stamp, r):
    with open(os.path.join(logdir, f"sync_{stamp}_one_{r}.log"), "w") as log:
        return _result(_spawn(module_cmd(__spec__.name) + ["--role", "one"] + _common(args), log))


def run_sync(args, logdir, stamp, r):
    from bench.cluster.cluster_common import free_ports
    ports = ",".join(str(p) for p in free_ports(args.workers))
    procs = []
    for rank in range(args.workers):
        log = open(os.path.join(logdir, f"sync_{stamp}_sync_{r}_w{rank}.log"), "w")
        procs.append(_spawn(module_cmd(__spec__.name) + ["--role", "sync", "--rank", str(rank), "--ports", ports]
                            + _common(args), log))
    results = [_result(p) for p in procs]
    return results[0]


def run_ps(args, logdir, stamp, r):
    from bench.cluster import bench_cluster
    ns = argparse.Namespace(**vars(args))
    ns.batch_size = args.batch_size // args.workers
    ns.threads, ns.rounds, ns.timeout = 0, 1, 900
    res = bench_cluster.run_one("evstore_group", 2, args.workers, ns, None, logdir, f"{stamp}_r{r}")
    if "error" in res:
        raise RuntimeError(res["error"])
    return {"examples_per_s": res["examples_per_s"],
            "bytes_per_worker_step": res["per_step"]["worker_ps_bytes"],
            "rpcs_per_worker_step": res["per_step"]["worker_ps_rpcs"]}


def project(one_eps, sync, an, args, worker_counts=(2, 4, 8, 16, 32, 64)):
    """Cost model of one synchronous step on W workers at the same global batch B:

        T(W) = B / (W x one_eps) + C x L + bytes(W) / BW

    one_eps: the one-process examples/s of the same run (compute per
    example, lookups and applies included); C: collectives per step
    (counted in the traced step); bytes(W) = (1 - 1/W) x (U_f(B/W) x
    (16 + 8 d) + U_w(B/W) x 24) + 2 (W - 1)/W x 4 P: keys and counts out,
    rows back, gradients out for the distinct ids of a worker's slice (U_f
    over the 26 field tables, U_w of the wide table, measured on slices of the
    pool: they shrink with the slice), plus the ring all-reduce of the P
    dense parameters; BW: the bytes/s per worker of a 4 MB all-to-all
    (measured, a lower bound: its latency included); L: fitted, the 2-worker
    step's time beyond compute(B/2) and bytes/BW, per collective. L is taken
    flat in W (on loopback a collective's latency hardly depends on its size)
    or, pessimistic, growing with the W - 1 peers
    (`..._latency_per_peer`)."""
    B, d = args.batch_size, args.dim
    c = sum(sync["collectives_per_step"].values())
    bw = sync["bytes_4mb_per_s_per_worker"]
    P = an["dense_params"]

    def byts(w):
        uf, uw = an["unique_ids_by_workers"][str(w)] if str(w) in an["unique_ids_by_workers"] else \
            an["unique_ids_by_workers"][w]
        return (1 - 1 / w) * (uf * (16 + 8 * d) + uw * 24) + 2 * (w - 1) / w * 4 * P

    t2 = B / sync["examples_per_s"]
    lat = max((t2 - B / (2 * one_eps) - byts(2) / bw) / max(c, 1), 0.0)
    out = {"latency_per_collective_s": lat, "bytes_per_s_per_worker": bw, "collectives_per_step": c,
           "measured_step_s_w2": t2, "compute_s_w2": B / (2 * one_eps), "rows": []}
    for w in worker_counts:
        comp, comm = B / (w * one_eps), byts(w) / bw
        t, t_peer = comp + c * lat + comm, comp + c * lat * (w - 1) + comm
        out["rows"].append({"workers": w, "step_s": t, "step_s_latency_per_peer": t_peer, "bytes_per_worker": byts(w),
                            "examples_per_s": B / t, "examples_per_s_latency_per_peer": B / t_peer,
                            "speedup_vs_one": B / t / one_eps})
    return out


def render(meta, rounds, an, proj):
    sync_small = statistics.median(r["sync"].get("small_all_to_all_s", float("nan")) for r in rounds)
    def med(key, f):
        return statistics.median(f(r[key]) for r in rounds)
    one = med("one", lambda x: x["examples_per_s"])
    syn = med("sync", lambda x: x["examples_per_s"])
    ps = med("ps", lambda x: x["examples_per_s"])
    ratio_s = statistics.median(r["sync"]["examples_per_s"] / r["one"]["examples_per_s"] for r in rounds)
    ratio_p = statistics.median(r["ps"]["examples_per_s"] / r["one"]["examples_per_s"] for r in rounds)
    sb = med("sync", lambda x: x["bytes_per_worker_step"])
    pb = med("ps", lambda x: x["bytes_per_worker_step"])
    W = meta["workers"]
    coll = rounds[0]["sync"]["collectives_per_step"]
    lines = [f"Global batch {meta['batch_size']}, dim {meta['dim']}, max vocab {meta['max_vocab']:,}, {W} workers, "
             f"{meta['rounds']} rounds of {meta['steps']} steps; medians; ratios within a round.", "",
             "| mode | examples/s | vs one process | bytes per worker step | per example |",
             "|---|---:|---:|---:|---:|",
             f"| one process | {one:,.0f} | 1.00 | - | - |",
             f"| sync, {W} workers (all-to-all) | {syn:,.0f} | {ratio_s:.2f} | {sb / 1e6:.2f} MB | "
             f"{sb * W / meta['batch_size']:,.0f} B |",
             f"| PS, 2 PS + {W} workers (async, grouped) | {ps:,.0f} | {ratio_p:.2f} | {pb / 1e6:.2f} MB | "
             f"{pb * W / meta['batch_size']:,.0f} B |", "",
             f"Sync mode per worker and step: {an['unique_ids_per_worker']:,.0f} distinct ids over the 27 tables; "
             f"analytic minimum {an['min_embedding_bytes'] / 1e6:.3f} MB (all-to-all) + "
             f"{an['dense_allreduce_bytes'] / 1e6:.3f} MB (ring all-reduce of {an['dense_params']:,} dense "
             f"parameters) = {(an['min_embedding_bytes'] + an['dense_allreduce_bytes']) / 1e6:.3f} MB; the "
             f"exchange's padded payload {an['exchange_payload_bytes'] / 1e6:.3f} MB; measured TCP "
             f"{sb / 1e6:.3f} MB ({sb / (an['min_embedding_bytes'] + an['dense_allreduce_bytes']):.2f} x the "
             f"minimum). Collectives per step: {sum(coll.values())} ({', '.join(f'{k} {v}' for k, v in sorted(coll.items()))}).",
             "", "Projection at the same global batch (cost model of `project`; from this run: compute "
             f"{proj['compute_s_w2'] * 1e3:.1f} ms of the measured 2-worker step of "
             f"{proj['measured_step_s_w2'] * 1e3:.1f} ms, the rest {proj['latency_per_collective_s'] * 1e3:.2f} ms "
             f"per collective x {proj['collectives_per_step']} collectives; "
             f"{proj['bytes_per_s_per_worker'] / 1e6:,.0f} MB/s per worker measured with 4 MB all-to-alls; "
             f"a lone one-element all-to-all took {sync_small * 1e3:.1f} ms):", "",
             "| workers | step (ms) | bytes per worker | examples/s | vs one process | examples/s if latency x (W-1) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in proj["rows"]:
        lines.append(f"| {row['workers']} | {row['step_s'] * 1e3:.1f} | {row['bytes_per_worker'] / 1e6:.2f} MB | "
                     f"{row['examples_per_s']:,.0f} | {row['speedup_vs_one']:.2f} | "
                     f"{row['examples_per_s_latency_per_peer']:,.0f} |")
    return "\n".join(lines) + "\n"


def _sync_median(rounds):
    keys = ("examples_per_s", "bytes_per_worker_step", "small_all_to_all_s", "bytes_4mb_per_s_per_worker")
    return dict(rounds[0]["sync"], **{k: statistics.median(r["sync"][k] for r in rounds if k in r["sync"])
                                      for k in keys if k in rounds[0]["sync"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _args(ap)
    ap.add_argument("--role", choices=["one", "sync"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ports", default="", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="batch 256, vocabs <= 100k, 1 round of 8 steps")
    ap.add_argument("--render", metavar="JSON", help="only print the tables of a saved sync-*.json")
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.role:
        return run_process(args)
    if args.render:   # re-render a saved run (the projection recomputed)
        with open(args.render) as f:
            data = json.load(f)
        rounds, an, meta = data["rounds"], data["analytic"], data["meta"]
        for k in ("batch_size", "dim", "workers"):
            setattr(args, k, meta[k])
        one_eps = statistics.median(r["one"]["examples_per_s"] for r in rounds)
        proj = project(one_eps, _sync_median(rounds), an, args)
        print(render(meta, rounds, an, proj))
        return 0
    apply_quick(args, argv, (("--batch-size", 256), ("--max-vocab", 100_000), ("--warmup", 2), ("--steps", 8),
                             ("--rounds", 1), ("--pool", 8)))
    logdir = log_dir(args.out_dir)
    stamp = utc_stamp()
    t0 = time.time()
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name, fn in (("one", run_one), ("sync", run_sync), ("ps", run_ps)):
            print(f"[{time.time() - t0:5.0f}s] round {r}: {name} ...", flush=True)
            row[name] = fn(args, logdir, stamp, r)
            print(f"    {row[name]['examples_per_s']:,.0f} examples/s", flush=True)
        rounds.append(row)
    an = analytic(args)
    one_eps = statistics.median(r["one"]["examples_per_s"] for r in rounds)
    proj = project(one_eps, _sync_median(rounds), an, args)
    meta = {**run_meta(stamp, argv), "workers": args.workers, "batch_size": args.batch_size,
            "dim": args.dim, "max_vocab": args.max_vocab, "steps": args.steps, "rounds": args.rounds,
            "total_s": time.time() - t0}
    md = f"## Synchronous training vs PS mode vs one process {stamp}\n\n" + render(meta, rounds, an, proj)
    write_result(f"sync-{stamp}", {"meta": meta, "rounds": rounds, "analytic": an, "projection": proj}, md=md,
                 out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
