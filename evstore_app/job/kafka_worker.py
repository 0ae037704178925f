"""A parameter-server worker's own Kafka consumer: each worker reads the
partitions the chief gives it, in its own process (`evstore server`).

Channel: the training step itself. Every worker process registers `_handle`
in its py_func registry under TOKEN (`install`, done by
evstore_app.cluster.start_server); the chief's step function
(evstore_app/job/cluster_kafka.py) calls an `EagerPyFunc` with that token as
its first op after counting the attempt, so it runs in the process of the
worker the coordinator picked, and returns that worker's next batch.

The step's argument is the chief's plan, one JSON string: a generation (new
at every chief start, commit and rollback), the consumer settings, and every
partition's owner (a worker index) and the offset the last commit recorded.
A worker keeps its consumer across steps while the plan's offsets for its
partitions are where it stands (every batch it read was trained and
committed); otherwise (a new process, a rollback, partitions moved) it seeks
to the plan's offsets and says so (`fresh`). Each batch comes back with its
ranges, [topic, partition, first, next] per partition, the first being where
the worker's previous batch of that partition ended: the chief checks that
the ranges of the steps it counted tile each partition from the commit's
offset, which is what makes a commit exact (cluster_kafka.py).

Fence: the worker process (its consumer) outlives chiefs, so a chief at its
start calls `fence` on every worker (FENCE_TOKEN, an eager op placed on the
worker) with its incarnation, before it restores. `fence` waits for the step
inside `handle_plan`, if any, and from then on a step whose plan names
another chief (one the dead chief dispatched and a worker ran late) takes no
batch and leaves the consumer where it is: an empty step, `stale` in its
meta. Its PS updates, had it taken a batch, would go to the dead chief's
variables: TensorFlow isolates each client's (chief's) resources on the
tasks, so no step of another chief touches this chief's state.
"""
import json
import os
import sys
import threading

import numpy as np
import tensorflow as tf

__all__ = ["install", "TOKEN", "FENCE_TOKEN", "COLUMNS", "SPEC", "handle_plan", "fence"]

TOKEN = "evstore.job.kafka_worker.v1"
FENCE_TOKEN = "evstore.job.kafka_worker.fence.v1"
# The click stream's columns (evstore_app.job.synthetic.ClickStream); the label is "click".
COLUMNS = ("user", "item", "category")
SPEC = {"sparse": [{"column": c} for c in COLUMNS], "dense": ["hour"], "label": {"column": "click"}}
OUTPUT_TYPES = (tf.int64, tf.int64, tf.int64, tf.float32, tf.float32, tf.string)

_LOCK = threading.Lock()
_STATE = {"task": None, "gen": None, "stream": None, "mine": None, "func": None, "fence_func": None, "chief": None}


def install(task):
    """Registers the worker's batch source in this process's py_func registry (idempotent)."""
    from tensorflow.python.ops import script_ops   # the registry EagerPyFunc kernels look tokens up in
    if _STATE.get("func") is None:   # an EagerFunc: it converts the outputs to tensors on the op's device
        _STATE["func"] = script_ops.EagerFunc(_handle, list(OUTPUT_TYPES), False)
    if _STATE.get("fence_func") is None:
        _STATE["fence_func"] = script_ops.EagerFunc(_fence, [tf.int64], False)
    script_ops._py_funcs._funcs[TOKEN] = _STATE["func"]   # a WeakValueDictionary: _STATE holds it
    script_ops._py_funcs._funcs[FENCE_TOKEN] = _STATE["fence_func"]
    _STATE["task"] = int(task)


def _stream(plan, mine):
    from evstore_app.job.kafka_source import KafkaStream
    stream = KafkaStream(plan["bootstrap"], plan["topics"], group_id=plan["group"], properties=plan["properties"],
                         linger=plan["linger"], dead_letter_topic=plan.get("dead_letter_topic"),
                         partition_filter=lambda t, p: (t, p) in mine).bind(SPEC)
    known = {}
    for (t, p), off in mine.items():
        if off is not None:
            known.setdefault(t, {})[str(p)] = off
    stream.open({"kafka": known})
    return stream


def fence(chief):
    """Makes `chief` (an incarnation) this worker's only chief: returns once no step is inside
    `handle_plan`; later steps of other chiefs take nothing."""
    with _LOCK:
        _STATE["chief"] = chief


def _fence(chief):
    fence(chief.numpy().decode())
    return np.int64(_STATE["task"] if _STATE["task"] is not None else -1)


def _empty(meta):
    cols = {c: np.zeros(0, np.int64) for c in COLUMNS}
    cols["hour"] = np.zeros(0, np.float32)
    return cols, np.zeros(0, np.float32), meta


def handle_plan(plan, task):
    """This worker's next batch under `plan` (a dict): (columns, labels, meta)."""
    from checkpoint import _failpoints
    _failpoints.hit("kafka-step-start")
    mine = {(t, int(p)): off for t, p, w, off in plan["parts"] if w == task}
    fresh = False
    with _LOCK:
        st = _STATE
        if st["chief"] is None:   # a worker started after its chief's fence: no other chief reached it
            st["chief"] = plan["chief"]
        if plan["chief"] != st["chief"]:
            print(f"evstore kafka worker {task}: fenced a step of chief {plan['chief']} (chief {st['chief']} "
                  "took over): it consumed nothing and trains nothing", file=sys.stderr, flush=True)
            return _empty({"task": task, "pid": os.getpid(), "gen": plan["gen"], "fresh": False, "messages": 0,
                           "bad": 0, "ranges": [], "stale": True})
        if st["gen"] != plan["gen"]:
            s = st["stream"]
            keeps = (s is not None and set(mine) == st["mine"]
                     and all(s.offsets.get(tp) == off for tp, off in mine.items()))
            if not keeps:
                if s is not None:
                    s.close()
                st["stream"] = _stream(plan, mine) if mine else None
                fresh = True
            st["gen"], st["mine"] = plan["gen"], set(mine)
        s = st["stream"]
        if s is None:     # no partition of its own: an empty step, after waiting as a consumer would
            threading.Event().wait(plan["wait"])
            ranges, batch, taken, bad = {}, None, 0, 0
        else:
            m0, b0 = s.messages, s.bad
            ranges, batch = s.next_batch(plan["batch"], plan["wait"])
            taken, bad = s.messages - m0, s.bad - b0
    meta = {"task": task, "pid": os.getpid(), "gen": plan["gen"], "fresh": fresh, "messages": taken, "bad": bad,
            "ranges": [[t, p, a, b] for (t, p), (a, b) in sorted(ranges.items())]}
    if batch is None:
        return _empty(meta)
    return batch[0], batch[1], meta


def _handle(plan):
    """The py_func: the plan in, (user, item, category, hour, click, meta JSON) out."""
    cols, labels, meta = handle_plan(json.loads(plan.numpy().decode()), _STATE["task"])
    return [np.asarray(cols[c], np.int64) for c in COLUMNS] + [
        np.asarray(cols["hour"], np.float32), np.asarray(labels, np.float32), json.dumps(meta).encode()]
