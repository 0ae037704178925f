"""Shared by the Kafka tests: a small feature spec, deterministic click events,
producing them to a real broker, `evstore train --kafka` as a process, and
reading a root's per-key frequencies (the events each key was trained on)."""
import json
import os
import random
import subprocess
import sys
import time

import numpy as np

# Adagrad: its accumulator starts at a non-zero value, so the bit-for-bit comparison of a killed and
# resumed run also checks that keys admitted right after a restore start their slots there.
SPEC = {"label": {"column": "click"},
        "sparse": [{"name": "user", "column": "user", "dim": 4}, {"name": "item", "column": "item", "dim": 4}],
        "dense": ["hour"], "hidden": [8], "batch_size": 64,
        "optimizer": {"name": "adagrad", "learning_rate": 0.05}}


def events(n, seed=0, start=0):
    r = random.Random(seed * 1_000_003 + start)
    return [{"user": r.randrange(40), "item": r.randrange(150), "hour": (start + i) % 24,
             "click": int(r.random() < 0.3)} for i in range(n)]


def create_topic(bootstrap, topic, partitions):
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result()


def produce(bootstrap, topic, rows, partitions=1, raw=()):
    """Produces `rows` as JSON (row i to partition i % partitions), then the
    raw byte strings `raw` as (partition, bytes); waits for every ack."""
    from confluent_kafka import Producer

    from evstore_app.job.kafka_produce import produce_rows
    produce_rows(bootstrap, topic, rows, partitions=partitions)
    p = Producer({"bootstrap.servers": bootstrap})
    for part, value in raw:
        p.produce(topic, value, partition=part)
    assert p.flush(30) == 0


def train(root, bootstrap, topic, *flags, env=None, wait=True, stderr=None):
    """`evstore train --kafka` as a process (Popen when not `wait`; its stderr
    to the open file `stderr` when given)."""
    spec = os.path.join(os.path.dirname(str(root)), "spec.json")
    with open(spec, "w") as f:
        json.dump(SPEC, f)
    cmd = [sys.executable, "-m", "evstore_app.cli", "train", "--kafka", bootstrap, "--topic", topic, "--spec", spec,
           "--checkpoints", str(root), "--no-progress", *flags]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    if not wait:
        return p
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out, err


def wait_for(path, proc, timeout=300):
    """Waits until `path` exists (a failpoint was reached) while `proc` runs."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def restored(root):
    """The model of the newest chain of `root` (spec SPEC)."""
    import checkpoint
    from evstore_app.job.model import build_model
    from evstore_app.job.spec import load_spec
    model = build_model(load_spec(SPEC))
    meta = checkpoint.CheckpointManager(str(root), model, lease=False).restore()
    return model, meta


def key_freqs(model, name):
    """{key: frequency} of field `name`'s EV: the events trained with that key."""
    from evstore_app.job.model import field_ev
    x = field_ev(model, name).export()
    return dict(zip(x["keys"].numpy().tolist(), x["freqs"].numpy().tolist()))


def counts(rows, column):
    keys, n = np.unique([r[column] for r in rows], return_counts=True)
    return dict(zip(keys.tolist(), n.tolist()))


def group_offsets(bootstrap, group, topic, partitions):
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in got}
    finally:
        c.close()


def set_group_offsets(bootstrap, group, topic, offsets):
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        c.commit(offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        c.close()


def committed_messages(root):
    """The largest message count a commit under `root` records (0: none)."""
    best = 0
    for d in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, d, "MANIFEST.json")) as f:
                pos = json.load(f)["metadata"].get("position")
        except (OSError, ValueError, KeyError):
            continue
        if isinstance(pos, dict):
            best = max(best, int(pos.get("messages", 0)))
    return best


def dead_letters(bootstrap, topic, n):
    """The messages of `topic` (a dead-letter topic), once at least `n` are there (or after 20 s)."""
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "auto.offset.reset": "earliest"})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    got = []
    for _ in range(40):
        got += [m for m in c.consume(10, 0.5) if m.error() is None]
        if len(got) >= n:
            break
    c.close()
    return got


def wait_until(what, proc, timeout=300):
    """Waits until `what()` is true while `proc` runs."""
    deadline = time.time() + timeout
    while not what():
        assert proc.poll() is None, f"the job ended early (exit {proc.returncode})"
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
