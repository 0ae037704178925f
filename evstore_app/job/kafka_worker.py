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
"""
import json
import os
import threading

import numpy as np
import tensorflow as tf

__all__ = ["install", "TOKEN", "COLUMNS", "SPEC", "handle_plan"]

TOKEN = "evstore.job.kafka_worker.v1"
# The click stream's columns (evstore_app.job.synthetic.ClickStream); the label is "click".
COLUMNS = ("user", "item", "category")
SPEC = {"sparse": [{"column": c} for c in COLUMNS], "dense": ["hour"], "label": {"column": "click"}}
OUTPUT_TYPES = (tf.int64, tf.int64, tf.int64, tf.float32, tf.float32, tf.string)

_LOCK = threading.Lock()
_STATE = {"task": None, "gen": None, "stream": None, "mine": None, "func": None}


def install(task):
    """Registers the worker's batch source in this process's py_func registry (idempotent)."""
    from tensorflow.python.ops import script_ops   # the registry EagerPyFunc kernels look tokens up in
    if _STATE.get("func") is None:   # an EagerFunc: it converts the outputs to tensors on the op's device
        _STATE["func"] = script_ops.EagerFunc(_handle, list(OUTPUT_TYPES), False)
    script_ops._py_funcs._funcs[TOKEN] = _STATE["func"]   # a WeakValueDictionary: _STATE holds it
    _STATE["task"] = int(task)


def _stream(plan, mine):
    from evstore_app.job.kafka_source import KafkaStream
    stream = KafkaStream(plan["bootstrap"], plan["topics"], group_id=plan["group"], properties=plan["properties"],
                         linger=plan["linger"], partition_filter=lambda t, p: (t, p) in mine).bind(SPEC)
    known = {}
    for (t, p), off in mine.items():
        if off is not None:
            known.setdefault(t, {})[str(p)] = off
    stream.open({"kafka": known})
    return stream


def handle_plan(plan, task):
    """This worker's next batch under `plan` (a dict): (columns, labels, meta)."""
    mine = {(t, int(p)): off for t, p, w, off in plan["parts"] if w == task}
    fresh = False
    with _LOCK:
        st = _STATE
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
        cols = {c: np.zeros(0, np.int64) for c in COLUMNS}
        cols["hour"] = np.zeros(0, np.float32)
        return cols, np.zeros(0, np.float32), meta
    return batch[0], batch[1], meta


def _handle(plan):
    """The py_func: the plan in, (user, item, category, hour, click, meta JSON) out."""
    cols, labels, meta = handle_plan(json.loads(plan.numpy().decode()), _STATE["task"])
    return [np.asarray(cols[c], np.int64) for c in COLUMNS] + [
        np.asarray(cols["hour"], np.float32), np.asarray(labels, np.float32), json.dumps(meta).encode()]
