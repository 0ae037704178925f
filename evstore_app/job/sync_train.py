"""Synchronous training of the CTR job on local worker processes (`evstore train-sync`).

The model of `evstore train-cluster` (evstore_app.job.cluster_train.CtrModel)
with CollectiveEmbeddingVariables (evstore/collective.py): W worker processes
under MultiWorkerMirroredStrategy, each owning one shard of every table, the
dense weights mirrored. Batch b of the click stream (a pure function of seed
and b) is split in W equal slices, worker r trains slice r; the loss is the
sum over the slice divided by the global batch size, so a step equals the
one-process step on the whole batch (`ClusterJob(local=True)`), versions and
frequencies exactly.

Checkpoints: every `delta_every` batches every worker commits into the same
chain (checkpoint/sync.py; the first commit a full, then deltas, a full every
`full_every`), with the position (batches trained) as metadata. A worker
restores the newest chain at start and resumes at its position.

Failures: the collective runtime cannot continue without a worker: a
survivor's next collective fails (UnavailableError within a second on
loopback, the dead peer's connections reset) and the worker exits with code
75 saying so. The launcher (`run_local`) watches its workers; when one dies,
it gives the others 10 s to stop so, kills what is left and starts them all again (new ports), and they resume from the last
commit: nothing committed is lost and no batch is trained twice into the
state. After `max_restarts` restarts it gives up (RuntimeError); running the
job again resumes the same way.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["SyncJob", "run_local", "main"]

_KILL_AT = "EVSTORE_SYNC_KILL_AT"   # tests: "<rank>:<batch>": that worker SIGKILLs itself there (first run only)


class SyncJob:
    """One worker of a synchronous job.

    Args:
      rank: this worker's index.
      workers: every worker's "host:port" (worker `rank` serves on its own).
      checkpoints: checkpoint root: a local path every worker sees or an object store URL (None: no checkpoints).
      batch_size: examples per (global) batch, divisible by the number of workers.
      seed, learning_rate, delta_every, full_every, keep_chains: as ClusterJob's.

    Raises:
      ValueError: a bad argument.
    """

    def __init__(self, rank, workers, checkpoints=None, batch_size=256, seed=0, learning_rate=0.05, delta_every=20,
                 full_every=None, keep_chains=3):
        import tensorflow as tf

        import checkpoint.sync
        import evstore
        from evstore.quality import ProgressiveQuality
        from evstore_app.job.cluster_train import CtrModel
        from evstore_app.job.synthetic import ClickStream

        self.rank, self.num_workers = int(rank), len(workers)
        if batch_size % self.num_workers:
            raise ValueError(f"batch_size {batch_size} must be divisible by the number of workers {self.num_workers}")
        for name, v in (("batch_size", batch_size), ("delta_every", delta_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.batch_size, self.delta_every, self.full_every = batch_size, delta_every, full_every
        self.stream = ClickStream(seed=seed, batch_size=batch_size, users=20_000, items=10_000)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": list(workers)}), task_type="worker", task_id=self.rank, rpc_layer="grpc")
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
        with self.strategy.scope():
            self.model = CtrModel(seed=seed, table=evstore.CollectiveEmbeddingVariable)
            self.optimizer = evstore.optimizers.SGD(learning_rate)
            self.optimizer.build(self.dense_vars)
            self.global_step = tf.Variable(0, dtype=tf.int64, name="step", trainable=False,
                                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.manager = None
        if checkpoints is not None:
            self.manager = checkpoint.sync.SyncCheckpointManager(checkpoints, self.model, global_step=self.global_step,
                                                                 keep_chains=keep_chains)
        self.position = 0
        self.resumed_at = None
        self.commits = []
        self.progressive = ProgressiveQuality()   # this worker's slices, keyed by position after
        self._step = self._make_step()

    @property
    def dense_vars(self):
        from evstore_app.job.cluster_train import FIELDS
        return [self.model.weights[f] for f, _ in FIELDS] + [self.model.w_hour, self.model.bias]

    @property
    def train_vars(self):
        from evstore_app.job.cluster_train import FIELDS
        return [self.model.tables[f].local for f, _ in FIELDS] + self.dense_vars

    def _make_step(self):
        import tensorflow as tf
        model, opt, step, strategy, batch = self.model, self.optimizer, self.global_step, self.strategy, self.batch_size

        def fn(user, item, category, hour, label):
            ids = {"user": user, "item": item, "category": category}
            variables = self.train_vars
            with tf.GradientTape() as tape:
                logits = model(ids, hour)
                losses = tf.nn.sigmoid_cross_entropy_with_logits(label, logits)
                loss = tf.reduce_sum(losses) / batch   # the global batch: gradients summed over the workers
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables), global_step=step.assign_add(1))
            return loss, tf.sigmoid(logits)   # this worker's slice, scored before the update (progressive)

        spec = [tf.TensorSpec([None], tf.int64)] * 3 + [tf.TensorSpec([None], tf.float32)] * 2

        @tf.function(input_signature=spec)
        def train_step(user, item, category, hour, label):
            return strategy.run(fn, args=(user, item, category, hour, label))

        return train_step

    def batch(self, b):
        """This worker's slice of batch b (user, item, category, hour, label tensors)."""
        import tensorflow as tf
        cols, label = self.stream.batch(b)
        n = self.batch_size // self.num_workers
        lo, hi = self.rank * n, (self.rank + 1) * n
        return tuple(tf.constant(cols[c][lo:hi]) for c in ("user", "item", "category", "hour")) + (
            tf.constant(label[lo:hi]),)

    def resume(self):
        """Restores the newest chain if there is one; returns the position to resume at."""
        if self.manager is not None and self.manager.latest() is not None:
            self.position = int(self.manager.restore()["position"])
        self.resumed_at = self.position
        return self.position

    def scored(self):
        """This worker's scored examples since the last commit (its part of the commit's quality)."""
        last = self.manager.last_committed
        return self.progressive.scored_since(None if last is None else int(last.metadata["position"]))

    def save(self):
        """Commits a checkpoint at the current position (collective: every worker at once); returns its seq."""
        from evstore_app.job.cluster_train import commit_position
        return commit_position(self.manager, self.position, self.full_every, self.commits, quality=self.scored)

    def train(self, steps, on_commit=None):
        """Trains batches `position .. steps - 1`, committing every `delta_every` batches and at the end."""
        kill = os.environ.get(_KILL_AT, "")
        kill_rank, _, kill_batch = kill.partition(":")
        while self.position < steps:
            if kill and int(kill_rank) == self.rank and int(kill_batch) == self.position and self.resumed_at == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            args = self.batch(self.position)
            _, scores = self._step(*args)
            self.position += 1
            if self.manager is not None:
                scores = self.strategy.experimental_local_results(scores)[0]
                self.progressive.record(self.position, args[-1].numpy(), scores.numpy())
            if self.manager is not None and self.position % self.delta_every == 0:
                seq = self.save()
                if on_commit:
                    on_commit(seq, self.position)
        if self.manager is not None and (not self.commits or self.commits[-1][2] != self.position):
            seq = self.save()
            if on_commit:
                on_commit(seq, self.position)
        return self.position

    def state(self):
        """This worker's shard of every table (keys, values, versions, freqs) and the dense weights, as numpy."""
        from evstore_app.job.cluster_train import FIELDS
        out = {}
        for field, _ in FIELDS:
            e = self.model.tables[field].local.export()
            for k in ("keys", "values", "versions", "freqs"):
                out[f"{field}/{k}"] = e[k].numpy()
        for field, _ in FIELDS:
            out[f"w_{field}"] = self.model.weights[field].numpy()
        out["w_hour"], out["bias"] = self.model.w_hour.numpy(), self.model.bias.numpy()
        return out


def merge_states(states):
    """One state (ClusterJob.model.state()'s layout, rows sorted by key) from every worker's `SyncJob.state()`."""
    import numpy as np

    from evstore_app.job.cluster_train import FIELDS
    out = {}
    for field, _ in FIELDS:
        keys = np.concatenate([s[f"{field}/keys"] for s in states])
        order = np.argsort(keys, kind="stable")
        for k in ("keys", "values", "versions", "freqs"):
            out[f"{field}/{k}"] = np.concatenate([s[f"{field}/{k}"] for s in states])[order]
    for k in states[0]:
        if "/" not in k:
            out[k] = states[0][k]
    return out


def _watch_parent():
    """Exits this worker when the launcher dies (its workers cannot go on without it)."""
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, daemon=True).start()


def main(argv=None):
    """One worker process (started by `run_local`): trains, prints a JSON result line, exits."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m evstore_app.job.sync_train")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--workers", required=True, help="every worker's host:port, comma-separated")
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--delta-every", type=int, default=20)
    ap.add_argument("--full-every", type=int, default=None)
    ap.add_argument("--learning-rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result", required=True, help="file the worker's JSON result is written to")
    ap.add_argument("--state-out", default=None, help="write this worker's state (npz) here at the end")
    a = ap.parse_args(argv)
    _watch_parent()
    job = SyncJob(a.rank, a.workers.split(","), a.checkpoints, batch_size=a.batch_size, seed=a.seed,
                  learning_rate=a.learning_rate, delta_every=a.delta_every, full_every=a.full_every)
    start = job.resume()
    print(f"worker {a.rank}: resuming at batch {start}", file=sys.stderr, flush=True)
    import tensorflow as tf
    try:
        job.train(a.steps, on_commit=lambda seq, pos: print(f"worker {a.rank}: committed seq={seq} position={pos}",
                                                            file=sys.stderr, flush=True))
    except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as e:
        # A peer died: its collectives fail here (within a second on loopback, connection reset).
        print(f"worker {a.rank}: a collective failed at batch {job.position} ({type(e).__name__}): another worker "
              "is gone and the collective runtime cannot continue; stopping (the job resumes from its last commit)",
              file=sys.stderr, flush=True)
        os._exit(75)
    if a.state_out:
        import numpy as np
        np.savez(a.state_out, **job.state())
    res = {"rank": a.rank, "resumed_at": start, "position": job.position,
           "global_step": int(job.global_step.numpy()), "commits": len(job.commits)}
    tmp = a.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # the collective runtime's teardown can wait on peers that already left


def run_local(workers=2, checkpoints=None, steps=100, batch_size=256, seed=0, learning_rate=0.05, delta_every=20,
              full_every=None, max_restarts=3, directory=None, state_out=None, log=print, env=None):
    """`evstore train-sync`: runs the job on `workers` local processes until `steps`, restarting them all
    (from the last commit) when one dies; returns a summary dict.

    Args:
      workers: number of worker processes (>= 1).
      directory: where worker logs, results and `workers.json` (the current
        pids) go (None: a new temporary directory).
      state_out: a directory for each worker's final state (`state-<rank>.npz`).
      max_restarts: whole-job restarts allowed after worker failures.
      The others: as SyncJob's.
    Raises:
      ValueError: bad arguments (no checkpoint root with restarts allowed is fine:
        a restart then starts over).
      RuntimeError: the workers failed more than `max_restarts` times (the
        message holds the tail of the failed worker's log).
    """
    from evstore_app.cluster import _free_ports, _tail
    for name, v in (("workers", workers), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if batch_size % workers:
        raise ValueError(f"batch_size {batch_size} must be divisible by the number of workers {workers}")
    directory = directory or tempfile.mkdtemp(prefix="evstore-sync-")
    os.makedirs(directory, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    penv = {"TF_CPP_MIN_LOG_LEVEL": "2", **os.environ, **(env or {})}
    penv["PYTHONPATH"] = os.pathsep.join(p for p in (root, penv.get("PYTHONPATH")) if p)
    penv.pop("TF_CONFIG", None)
    t0 = time.time()
    restarts, resumed = 0, []
    while True:
        addrs = ",".join(f"127.0.0.1:{p}" for p in _free_ports(workers))
        procs = []
        for r in range(workers):
            result = os.path.join(directory, f"result-{r}.json")
            if os.path.exists(result):
                os.remove(result)
            argv = [sys.executable, "-m", "evstore_app.job.sync_train", "--rank", str(r), "--workers", addrs,
                    "--steps", str(steps), "--batch-size", str(batch_size), "--delta-every", str(delta_every),
                    "--learning-rate", str(learning_rate), "--seed", str(seed), "--result", result]
            if checkpoints is not None:
                argv += ["--checkpoints", str(checkpoints)]
            if full_every is not None:
                argv += ["--full-every", str(full_every)]
            if state_out is not None:
                os.makedirs(state_out, exist_ok=True)
                argv += ["--state-out", os.path.join(state_out, f"state-{r}.npz")]
            with open(os.path.join(directory, f"worker-{r}.log"), "ab") as lg:
                procs.append(subprocess.Popen(argv, stdout=lg, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=penv, start_new_session=True))
        with open(os.path.join(directory, "workers.json"), "w") as f:
            json.dump({"incarnation": restarts, "pids": [p.pid for p in procs]}, f)
        failed = _wait(procs)
        if not failed:
            break
        for rank, code in failed:
            log(f"evstore train-sync: worker {rank} exited with code {code}; stopping every worker")
        rank, code = failed[0]
        for r, c in _stop_all(procs, failed):
            log(f"evstore train-sync: worker {r} " + ("stopped by itself" if c == 75 else "exited") + f" with code {c}")
        if restarts >= max_restarts:
            raise RuntimeError(f"worker {rank} exited with code {code} and {restarts} restart(s) were used "
                               f"(max_restarts={max_restarts}); run the job again to resume from its last commit. "
                               f"Log tail:\n{_tail(os.path.join(directory, f'worker-{rank}.log'))}")
        restarts += 1
        log(f"evstore train-sync: restart {restarts}: every worker resumes from the last commit")
    results = []
    for r in range(workers):
        with open(os.path.join(directory, f"result-{r}.json")) as f:
            results.append(json.load(f))
        resumed.append(results[-1]["resumed_at"])
    return {"workers": workers, "restarts": restarts, "resumed_at": results[0]["resumed_at"],
            "position": results[0]["position"], "global_step": results[0]["global_step"],
            "commits": results[0]["commits"], "seconds": round(time.time() - t0, 1), "directory": directory}


def _wait(procs):
    """[] when every worker exited 0; else [(rank, code)] of the workers that failed, killed by a signal first
    (a survivor fails its next collective within a second of its peer's death: both are often seen at once)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
        if failed:
            return sorted(failed, key=lambda rc: (rc[1] >= 0, rc[0]))
        if all(c == 0 for c in codes):
            return []
        time.sleep(0.2)


def _stop_all(procs, failed, grace=10.0):
    """Gives the other workers `grace` seconds to stop by themselves (their
    collectives fail), then SIGKILLs what is left; returns [(rank, code)] of
    the workers not in `failed`."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        p.wait()
    done = {r for r, _ in failed}
    return [(r, p.returncode) for r, p in enumerate(procs) if r not in done]


if __name__ == "__main__":
    main()
