"""The chief's training loop of bench/cluster/bench_cluster.py, shared by both systems' chiefs.

Runs in either venv (TF 2.21 + evstore, or TF 2.16 + TFRA): only TF APIs both
have. `run(args, system, build)`:

1. starts the loopback cluster (cluster_common.LoopbackServers: --ps PS tasks,
   --workers worker tasks, each its own process of this venv's python);
2. connects a ParameterServerStrategy + ClusterCoordinator to it (this
   process is the chief);
3. `build(tf, strategy, ps_devices)` (under `strategy.scope()`) creates the
   system's model and returns `replica_step(ids, dense, labels) -> loss` (the
   forward, gradient and optimizer apply of one batch, run by `strategy.run`
   on a worker) and a dict of facts about it;
4. every worker reads its own `coord.create_per_worker_dataset`: a pool of
   --pool pre-generated batches (bench_e2e.make_batch: the Criteo-like data),
   repeated, so the input lives on the worker and never crosses the chief;
5. schedules --warmup steps per worker (the first traces), then --rounds
   windows of --steps steps per worker; around each window (after
   `coord.join()`) it reads the kernel's TCP byte counters of every socket
   between the roles and the gRPC "Starting call" lines each process logged.

Examples/s of a window = workers * steps * batch / window seconds.
"""
import os
import statistics
import time


from bench.harness.paths import LOGS
from bench.training.bench_e2e import N_DENSE, N_FIELDS, make_batch, vocab_sizes
from bench.cluster.cluster_common import LoopbackServers, analytic_bytes, bytes_delta, cluster_spec, cpu_seconds, rpc_counts, tcp_bytes

HIDDEN = (256, 128)


def add_args(ap):
    """The flags both chiefs take (the orchestrator passes the same values to both)."""
    ap.add_argument("--ps", type=int, default=2, help="PS tasks (default 2)")
    ap.add_argument("--workers", type=int, default=1, help="worker tasks (default 1)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-vocab", type=int, default=1_000_000)
    ap.add_argument("--pool", type=int, default=32, help="distinct batches each worker cycles through")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per worker")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per worker per round")
    ap.add_argument("--rounds", type=int, default=2, help="timed windows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="intra/inter-op threads of every server (0: default)")
    ap.add_argument("--log-dir", default=LOGS)
    ap.add_argument("--tag", default="run", help="log file name tag")
    ap.add_argument("--chief-log", default=None, help="this process's stderr file (its gRPC calls are counted)")


def dense_variables(tf, dim, seed):
    """The dense part of bench_e2e's wide & deep model as plain tf.Variables
    (placed on the PS by the strategy): deep 26*dim+13 -> 256 -> 128, out on
    [deep 128 | wide 26 | dense 13] -> 1; Glorot-uniform kernels from numpy."""
    import numpy as np
    rng = np.random.default_rng(seed + 7)
    shapes = [(N_FIELDS * dim + N_DENSE, HIDDEN[0]), (HIDDEN[0], HIDDEN[1]), (HIDDEN[1] + N_FIELDS + N_DENSE, 1)]
    out = []
    for j, (a, b) in enumerate(shapes):
        lim = np.sqrt(6.0 / (a + b))
        out.append(tf.Variable(rng.uniform(-lim, lim, (a, b)).astype(np.float32), name=f"kernel_{j}"))
        out.append(tf.Variable(np.zeros(b, np.float32), name=f"bias_{j}"))
    return out


def forward(tf, dvars, field_rows, wide_rows, dense, labels):
    """Loss of the model given the looked-up rows: field_rows a list of 26 [B, dim]
    tensors, wide_rows [B, 26, 1]; mean binary cross-entropy."""
    k0, b0, k1, b1, k2, b2 = dvars
    x = tf.concat(field_rows + [dense], axis=1)
    x = tf.nn.relu(tf.matmul(x, k0) + b0)
    x = tf.nn.relu(tf.matmul(x, k1) + b1)
    z = tf.concat([x, tf.reshape(wide_rows, [-1, N_FIELDS]), dense], axis=1)
    logits = tf.matmul(z, k2) + b2
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


def dense_param_count(dim):
    a = N_FIELDS * dim + N_DENSE
    return a * HIDDEN[0] + HIDDEN[0] + HIDDEN[0] * HIDDEN[1] + HIDDEN[1] + (HIDDEN[1] + N_FIELDS + N_DENSE) + 1


def make_pool(args):
    import numpy as np
    vocabs = vocab_sizes(args.max_vocab)
    batches = [make_batch(args.seed, b, args.batch_size, vocabs) for b in range(args.pool)]
    return [np.stack([b[i] for b in batches]) for i in range(3)]


def _window(coord, schedule, n, servers, chief_log, roles):
    logs = dict(servers.logs, **({"chief0": chief_log} if chief_log else {}))
    b0, off0 = tcp_bytes(roles), {n_: os.path.getsize(p) for n_, p in logs.items()}
    c0 = cpu_seconds(roles)
    t0 = time.perf_counter()
    last = None
    for _ in range(n):
        last = schedule()
    coord.join()
    dt = time.perf_counter() - t0
    c1 = cpu_seconds(roles)
    loss = float(last.fetch())
    time.sleep(0.2)  # let the servers' log lines of the window reach their files
    delta = bytes_delta(b0, tcp_bytes(roles))
    return {"seconds": dt, "steps": n, "loss_last": loss, "bytes": delta, "rpcs": rpc_counts(logs, off0),
            "cpu_s": {k: c1[k] - c0.get(k, 0.0) for k in c1}}


def run(args, system, python, build):
    """Runs the benchmark for `system` with servers of `python`; returns the result dict."""
    import numpy as np
    ids_p, dense_p, y_p = make_pool(args)
    spec = cluster_spec(args.ps, args.workers)
    os.makedirs(args.log_dir, exist_ok=True)
    t_start = time.time()
    with LoopbackServers(python, system, spec, args.log_dir, args.tag, threads=args.threads) as servers:
        import tensorflow as tf
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(args.ps)]
        with strategy.scope():
            replica_step, info = build(tf, strategy, ps_devices)

        def dataset_fn():
            return tf.data.Dataset.from_tensor_slices((ids_p, dense_p, y_p)).repeat()

        it = iter(coord.create_per_worker_dataset(dataset_fn))

        @tf.function
        def train(iterator):
            ids, dense, labels = next(iterator)
            return strategy.run(replica_step, args=(ids, dense, labels))

        def schedule():
            return coord.schedule(train, args=(it,))

        roles = dict(servers.roles)
        roles[os.getpid()] = "chief0"
        t0 = time.perf_counter()
        w = None
        for _ in range(max(1, args.warmup) * args.workers):
            w = schedule()
        coord.join()
        warm_s = time.perf_counter() - t0
        loss_first = float(w.fetch())
        windows = [_window(coord, schedule, args.steps * args.workers, servers, args.chief_log, roles)
                   for _ in range(args.rounds)]
        sizes = info.pop("sizes", lambda: {})()
    n = args.steps * args.workers
    eps = [args.batch_size * n / w_["seconds"] for w_ in windows]
    res = {"system": system, "ps": args.ps, "workers": args.workers, "batch_size": args.batch_size,
           "dim": args.dim, "steps_per_worker": args.steps, "rounds": args.rounds, "pool": args.pool,
           "warmup_s": warm_s, "examples_per_s": statistics.median(eps), "examples_per_s_rounds": eps,
           "loss_first": loss_first, "loss_last": windows[-1]["loss_last"], "windows": windows,
           "table_sizes": sizes, "tf_version": tf.__version__, "wall_s": time.time() - t_start}
    res.update(info)
    res["per_step"] = per_step(windows)
    a = [analytic_bytes(ids_p[b], args.dim, dense_param_count(args.dim)) for b in range(len(ids_p))]
    res["analytic_min"] = {k: np.mean([x[k] for x in a], axis=0).tolist() for k in a[0]}
    return res


def per_step(windows):
    """Per-step means over the windows: bytes per role pair (sent by the first
    role, received by it), worker<->PS bytes both ways, and RPCs per method and
    issuing role."""
    steps = sum(w["steps"] for w in windows)
    byts, rpcs, cpu = {}, {}, {}
    for w in windows:
        for k, c in w.get("cpu_s", {}).items():
            cpu[k] = cpu.get(k, 0.0) + c
        for k, (s, r) in w["bytes"].items():
            byts.setdefault(k, [0, 0])
            byts[k][0] += s
            byts[k][1] += r
        for role, calls in w["rpcs"].items():
            for m, c in calls.items():
                rpcs[f"{role}:{m}"] = rpcs.get(f"{role}:{m}", 0) + c
    byts = {k: [s / steps, r / steps] for k, (s, r) in byts.items()}
    wp = byts.get("worker->ps", [0.0, 0.0])
    ps_side = sum(c for k, c in rpcs.items() if k.startswith("ps:"))
    wk_side = sum(c for k, c in rpcs.items() if k.startswith("worker:"))
    return {"bytes": byts, "worker_to_ps_bytes": wp[0], "ps_to_worker_bytes": wp[1],
            "worker_ps_bytes": wp[0] + wp[1], "rpcs": {k: c / steps for k, c in sorted(rpcs.items())},
            "worker_ps_rpcs": (ps_side + wk_side) / steps, "cpu_s": {k: c / steps for k, c in cpu.items()}}
