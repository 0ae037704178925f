"""The chief of a parameter-server job for the launcher tests, run as a real
subprocess: `python cluster_chief_ev.py --cluster FILE --scenario S --steps N`.

It trains an unsharded EmbeddingVariable placed on PS 1 (plus a PS-side int64
step counter) with functions scheduled on a ClusterCoordinator. Step i looks
up ids `[i % 5, 100 + i % 3, 7]`, so the frequencies after a set of steps are
known exactly. The test drives failures through a line protocol: the chief
prints `ACTION <verb> <job> <task>` and blocks until the test (which owns the
processes) answers one line on stdin; at the end it prints `RESULT <json>`.

Scenarios:
  train:          schedule every step, join.
  kill-worker:    schedule the first half, wait for progress, ask the test to
                  kill worker 1, schedule the second half, join.
  kill-ps:        schedule every step, wait for progress, ask the test to kill
                  PS 1, join; report the error `join` raised.
  restart-worker: kill worker 1 mid-training, finish, ask for its restart,
                  wait for TF's "Cluster successfully recovered." log line, ask
                  to kill worker 0, schedule more steps and join (only the
                  restarted worker can run them).
"""
import argparse
import json
import logging
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402
from evstore_app.cluster import load_cluster  # noqa: E402

PS1 = "/job:ps/replica:0/task:1/device:CPU:0"


def ids_for(i):
    return [i % 5, 100 + i % 3, 7]


def ask(verb, job, task):
    print(f"ACTION {verb} {job} {task}", flush=True)
    answer = sys.stdin.readline().strip()
    if answer != "ok":
        raise RuntimeError(f"the test answered {answer!r} to {verb} {job} {task}")


class Recovered(logging.Handler):
    """Counts TF's "Cluster successfully recovered." log records."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0
        self.cond = threading.Condition()

    def emit(self, record):
        if "Cluster successfully recovered" in record.getMessage():
            with self.cond:
                self.count += 1
                self.cond.notify_all()

    def wait(self, n, timeout):
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, timeout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--scenario", default="train")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--placement", choices=["ps1", "none"], default="ps1",
                   help="ps1: the EV under tf.device(PS 1); none: no device scope (the strategy's default)")
    args = p.parse_args()
    recovered = Recovered()
    tf.get_logger().addHandler(recovered)
    tf.get_logger().setLevel(logging.INFO)

    spec = load_cluster(args.cluster)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        with tf.device(PS1 if args.placement == "ps1" else None):
            ev = evstore.EmbeddingVariable("launcher_ev", 4, initializer=tf.zeros_initializer())
            counter = tf.Variable(0, dtype=tf.int64, name="steps_run")
        opt = evstore.optimizers.SGD(0.1)

    @tf.function
    def step(ids):
        def fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(evstore.embedding_lookup(ev, ids))
            opt.apply_gradients([(tape.gradient(loss, ev), ev)])
            counter.assign_add(1)
            return loss
        return strategy.run(fn, args=(ids,))

    def schedule(lo, hi):
        return [coord.schedule(step, args=(tf.constant(ids_for(i), tf.int64),)) for i in range(lo, hi)]

    def wait_progress(n):
        while int(counter.numpy()) < n:
            time.sleep(0.02)

    n = args.steps
    result = {"scheduled": n}
    if args.scenario == "train":
        schedule(0, n)
        coord.join()
    elif args.scenario == "kill-worker":
        schedule(0, n // 2)
        wait_progress(n // 8)
        result["counter_at_kill"] = int(counter.numpy())
        ask("kill", "worker", 1)
        remote = schedule(n // 2, n)
        coord.join()
        result["fetched"] = len([r.fetch() for r in remote])
    elif args.scenario == "kill-ps":
        remote = schedule(0, n)
        wait_progress(n // 20)
        ask("kill", "ps", 1)
        try:
            coord.join()
            result["join_error"] = None
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            result["join_error"] = type(e).__name__
            result["join_error_is_unavailable"] = isinstance(e, tf.errors.UnavailableError)
        fetch_errors = set()
        for r in remote[-5:]:
            try:
                r.fetch()
            except Exception as e:  # noqa: BLE001
                fetch_errors.add(type(e).__name__)
        result["fetch_errors"] = sorted(fetch_errors)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # the eager context still points at a dead PS: skip its teardown
    elif args.scenario == "restart-worker":
        schedule(0, n // 2)
        wait_progress(n // 8)
        ask("kill", "worker", 1)
        schedule(n // 2, n)
        coord.join()
        ask("restart", "worker", 1)
        if not recovered.wait(1, timeout=90):
            raise RuntimeError("the coordinator never logged 'Cluster successfully recovered.'")
        ask("kill", "worker", 0)
        schedule(n, n + n // 2)
        coord.join()
        result["scheduled"] = n + n // 2
    else:
        raise SystemExit(f"unknown scenario {args.scenario!r}")
    keys = sorted({k for i in range(result["scheduled"]) for k in ids_for(i)})
    result["keys"] = keys
    result["freqs"] = ev.frequency(keys).numpy().tolist()
    result["counter"] = int(counter.numpy())
    exported = ev.export()
    result["exported_keys"] = sorted(exported["keys"].numpy().tolist())
    rows = dict(zip(exported["keys"].numpy().tolist(), exported["values"].numpy().tolist()))
    result["rows"] = [rows[k] for k in keys]
    result["ev_device"] = ev.device
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip the teardown RPCs to (possibly dead) tasks


if __name__ == "__main__":
    main()
