"""A parameter-server job trained from Kafka, each worker consuming its own
partitions (`evstore train-cluster --kafka`), exactly once by the checkpoint.

The chief spreads the topics' partitions over the workers and schedules
steps whose argument is its plan (evstore_app/job/kafka_worker.py); a step
counts its attempt on a PS (`attempts.assign_add(1)`, before any other
effect), takes the next batch of the worker it runs on, trains on it, and
returns the batch's offset ranges. Every `delta_every` steps the chief joins
and checks two things before it commits:

  * attempts == steps scheduled: TensorFlow re-ran no step. A worker killed
    mid-step has its function re-run elsewhere, and whichever PS-side
    updates of the first attempt landed are applied twice
    (docs/guides/parameter-server.md, "When a task dies"); nothing at the
    chief can tell which, so
  * for every partition, the ranges returned tile it from the offset the
    last commit recorded, with no gap or overlap: each event read was trained
    by exactly one step (a worker restarted mid-round re-reads from the
    commit's offsets, which overlaps).

If both hold, the state is the last commit plus exactly the events of those
ranges, and the commit records every partition's next offset (metadata
"position", the same shape as `evstore train --kafka`'s). If not (or a step
failed), the chief restores the last commit into the PS tasks and starts a
new generation: every worker seeks to the commit's offsets at its next step.
A restarted chief does the same from the newest commit. Offsets go to the
consumer group after each checkpoint commit, for lag monitoring.

The model is the click-stream CTR model of cluster_train.py; messages are JSON
objects with the click stream's columns user, item, category (int64 ids),
hour (a number) and click (the label).
"""
import json
import sys
import threading
import time
import uuid

import numpy as np
import tensorflow as tf

from checkpoint import _failpoints
from evstore_app.cluster import load_cluster
from evstore_app.job import kafka_worker
from evstore_app.job.cluster_train import ClusterJob
from evstore_app.job.kafka_source import _DEFAULTS, _FORBIDDEN, _kafka

__all__ = ["FenceTimeoutError", "KafkaClusterJob", "run"]


class FenceTimeoutError(RuntimeError):
    """A worker neither answered nor failed the fence of a chief's start in time (`fence_timeout`)."""


class KafkaClusterJob(ClusterJob):
    """The chief of a PS job whose workers each consume their own partitions.

    Args (beyond ClusterJob's, whose `delta_every` counts steps between commits):
      bootstrap_servers, topics, group_id, properties: the Kafka source's
        (evstore_app.job.kafka_source.KafkaStream); properties reach every
        worker's consumer and the chief's.
      max_events: stop at the first commit that consumed this many messages
        in all (across restarts; bad ones count). None: unbounded.
      until: stop at this wall-clock time (epoch seconds).
      wait: seconds a worker's step waits for a first message (then it trains
        what it has, or nothing).
      linger: seconds a worker's batch waits to fill once a message arrived.
      max_rollbacks: rollbacks in a row without a commit before the job gives up
        (the error of the last failed step is raised).
      dead_letter_topic: where a worker produces the bad messages it skips (headers
        name their source), acknowledged before its step returns, so before the commit
        past them; a rolled-back round's bad messages are produced again when re-read.
      fence_timeout: seconds the start waits for each worker to answer the fence
        (`fence_workers`); a worker alive but not answering by then (hung, or
        stopped, in a step of an earlier chief) raises FenceTimeoutError naming it.
    """

    def __init__(self, cluster, checkpoints, bootstrap_servers, topics, group_id="evstore", properties=None,
                 max_events=None, until=None, wait=0.2, linger=0.2, max_rollbacks=5, dead_letter_topic=None, log=print,
                 fence_timeout=60.0, **kw):
        if isinstance(fence_timeout, bool) or not isinstance(fence_timeout, (int, float)) or not fence_timeout > 0:
            raise ValueError(f"fence_timeout must be a positive number of seconds, got {fence_timeout!r}")
        self.fence_timeout = float(fence_timeout)
        props = {str(k): v for k, v in (properties or {}).items()}
        for k, why in _FORBIDDEN.items():
            if str(props.get(k, "")).lower() in ("true", "1"):
                raise ValueError(f"Kafka property {k}={props[k]}: {why}")
        self.topics = [topics] if isinstance(topics, str) else list(topics or [])
        if not self.topics:
            raise ValueError("the Kafka source needs at least one topic name")
        if checkpoints is None:
            raise ValueError("a Kafka job needs a checkpoint root: the commits hold its offsets")
        self.kafka = {"bootstrap": bootstrap_servers, "topics": self.topics, "group": group_id,
                      "properties": props, "wait": float(wait), "linger": float(linger),
                      "dead_letter_topic": dead_letter_topic}
        self.max_events, self.until, self.max_rollbacks, self.log = max_events, until, max_rollbacks, log
        # No reference model: the workers read the batches, so the chief cannot keep their rows before
        # the steps that change them (ClusterJob.train); the records carry no `reference`.
        super().__init__(cluster, checkpoints=checkpoints, reference=False, **kw)
        self.worker_addresses = ["this process"] if self.coord is None else list(load_cluster(cluster)["worker"])
        self.workers = len(self.worker_addresses)
        if self.coord is None:
            kafka_worker.install(0)   # local: the steps' batches come from this process
        self.kafka["batch"] = self.stream.batch_size
        self.offsets = {}          # (topic, partition) -> next offset, as of the last commit
        self.messages = self.bad = self.examples = self.steps = 0
        self.rollbacks = []        # (why, offsets restored)
        self._incarnation = uuid.uuid4().hex[:12]
        self._gen = 0
        self._consumer = None

    def _make_step(self):
        model, opt, step, strategy = self.model, self.optimizer, self.global_step, self.strategy
        with strategy.scope():
            self.attempts = tf.Variable(0, dtype=tf.int64, name="attempts", trainable=False)
        attempts = self.attempts

        def fn(plan):
            with tf.control_dependencies([attempts.assign_add(1)]):   # before any other effect of the step
                out = tf.raw_ops.EagerPyFunc(input=[plan], token=kafka_worker.TOKEN,
                                             Tout=list(kafka_worker.OUTPUT_TYPES))
            user, item, category, hour, label = (tf.reshape(t, [-1]) for t in out[:5])
            ids = {"user": user, "item": item, "category": category}
            variables = model.train_vars
            with tf.GradientTape() as tape:
                logits = model(ids, hour)
                n = tf.maximum(tf.cast(tf.size(label), tf.float32), 1.0)
                loss = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(label, logits)) / n
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables), global_step=step.assign_add(1))
            return tf.sigmoid(logits), label, out[5]

        @tf.function
        def train_step(plan):
            return strategy.run(fn, args=(plan,))

        return train_step

    # ---- position -----------------------------------------------------------------
    def kafka_position(self):
        kafka = {}
        for (t, p), off in sorted(self.offsets.items()):
            kafka.setdefault(t, {})[str(p)] = off
        return {"kafka": kafka, "messages": self.messages, "bad": self.bad}

    def _set_position(self, meta):
        pos = meta.get("position") if meta else None
        pos = pos if isinstance(pos, dict) else {}
        self.offsets = {(t, int(p)): int(o) for t, parts in (pos.get("kafka") or {}).items() for p, o in parts.items()}
        self.messages, self.bad = int(pos.get("messages", 0)), int(pos.get("bad", 0))
        self.examples = int((meta or {}).get("examples", 0))

    def resume(self):
        """Fences the workers (`fence_workers`), then restores the newest chain if there is one (its offsets
        become every worker's); returns the position."""
        self.fence_workers()
        if self.manager.latest() is not None:
            self._set_position(self.manager.restore())
        return self.kafka_position()

    def fence_workers(self):
        """Makes this chief every worker's only one (kafka_worker.fence): a step an earlier chief
        dispatched and a worker runs from now on takes no batch. The workers are fenced at once, each
        by a thread. A worker whose task is gone (an error) is logged: a dead worker's steps died with
        it, and a restarted one never saw the earlier chief. A worker that neither answers nor fails
        within `fence_timeout` (alive, but hung or stopped in a step) raises FenceTimeoutError naming
        it: this chief cannot know that worker will never run an earlier chief's step."""
        self.log("evstore train-cluster: fencing the steps of earlier chiefs on the workers")
        if self.coord is None:
            kafka_worker.fence(self._incarnation)
            return
        arg = tf.constant(self._incarnation)
        failed = {}

        def fence(i):
            try:
                with tf.device(f"/job:worker/replica:0/task:{i}"):
                    tf.raw_ops.EagerPyFunc(input=[arg], token=kafka_worker.FENCE_TOKEN, Tout=[tf.int64])
            except (tf.errors.OpError, RuntimeError) as e:
                failed[i] = e

        # Daemon threads: the op of a worker that never answers cannot be cancelled, and must not keep
        # the process alive once it gave up on it.
        threads = [threading.Thread(target=fence, args=(i,), name=f"evstore-fence-worker-{i}", daemon=True)
                   for i in range(self.workers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.fence_timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, t in enumerate(threads) if t.is_alive()]
        if hung:
            raise FenceTimeoutError(
                "; ".join(f"worker {i} ({self.worker_addresses[i]}) did not answer the fence within "
                          f"{self.fence_timeout:g} s" for i in hung)
                + ": its process is alive but hung, or stopped, maybe in a step of an earlier chief. Restart "
                "that worker's `evstore server` (or let its step finish), then start the chief again")
        for i, e in sorted(failed.items()):
            self.log(f"evstore train-cluster: worker {i} did not answer the fence ({type(e).__name__}); "
                     "a dead worker's steps died with it")

    def quality(self):
        last = self.manager.last_committed
        return self.progressive.since(None if last is None else int(last.metadata.get("examples", 0)))

    # ---- the plan -----------------------------------------------------------------
    def consumer(self):
        if self._consumer is None:
            k = _kafka()
            self._consumer = k.Consumer({**_DEFAULTS, **self.kafka["properties"],
                                         "bootstrap.servers": self.kafka["bootstrap"], "group.id": self.kafka["group"]})
        return self._consumer

    def partitions(self):
        """Every (topic, partition) of the topics (the last known ones while the broker does not answer)."""
        k = _kafka()
        out = []
        try:
            for t in self.topics:
                tm = self.consumer().list_topics(t, timeout=5).topics.get(t)
                if tm is not None and tm.error is None:
                    out += [(t, p) for p in sorted(tm.partitions)]
        except k.KafkaException as e:
            self.log(f"evstore train-cluster: waiting for the Kafka broker at {self.kafka['bootstrap']}: {e}")
            return getattr(self, "_parts", [])
        self._parts = out
        return out

    def _start_offsets(self, parts):
        """Where partitions no commit knows start: the group's committed offset, else auto.offset.reset's
        end of the partition (earliest by default). Recorded from the next commit on, so every commit
        holds every partition's offset. None for a partition the broker does not answer for yet."""
        k = _kafka()
        new = [(t, p) for t, p in parts if (t, p) not in self.offsets]
        if not new:
            return
        latest = str(self.kafka["properties"].get("auto.offset.reset", "earliest")).lower() in ("latest", "end",
                                                                                              "largest")
        try:
            got = self.consumer().committed([k.TopicPartition(t, p) for t, p in new], timeout=10)
            for tp in got:
                off = tp.offset
                if off < 0:
                    lo, hi = self.consumer().get_watermark_offsets(k.TopicPartition(tp.topic, tp.partition),
                                                                   timeout=10)
                    off = hi if latest else lo
                self.offsets[(tp.topic, tp.partition)] = int(off)
        except k.KafkaException as e:
            self.log(f"evstore train-cluster: waiting for the Kafka broker at {self.kafka['bootstrap']}: {e}")

    def plan(self):
        """A new generation's plan: partition i of the sorted list to worker i % workers, at the commit's offsets."""
        self._gen += 1
        parts = self.partitions()
        self._start_offsets(parts)
        owners = [[t, p, i % self.workers, self.offsets.get((t, p))] for i, (t, p) in enumerate(parts)]
        self._plan = {**self.kafka, "chief": self._incarnation, "gen": f"{self._incarnation}:{self._gen}", "parts": owners}
        return self._plan

    # ---- a round of steps -------------------------------------------------------------
    def _round(self, plan):
        """Schedules delta_every steps under `plan`, joins; returns (results, None) or (None, why not exact)."""
        arg = tf.constant(json.dumps(plan))
        before = int(self.attempts.numpy())
        outs = []
        try:
            for _ in range(self.delta_every):
                outs.append(self.coord.schedule(self._step, args=(arg,)) if self.coord is not None
                            else self._step(arg))
            self.join()
            results = [o.fetch() if hasattr(o, "fetch") else o for o in outs]
        except (tf.errors.OpError, RuntimeError) as e:
            return None, f"a step failed ({type(e).__name__}: {str(e)[:1500]})"
        ran = int(self.attempts.numpy()) - before
        if ran != len(outs):
            return None, (f"{ran} step attempts for {len(outs)} steps: TensorFlow re-ran a step of a worker that "
                          "died, whose first attempt's updates may have landed")
        return results, None

    def _check(self, plan, metas):
        """The new offsets if the ranges tile every partition from the plan's offsets, else (None, why)."""
        start = {(t, p): off for t, p, _, off in plan["parts"]}
        ranges = {}
        for m in metas:
            for t, p, a, b in m["ranges"]:
                ranges.setdefault((t, p), []).append((a, b))
        out = dict(self.offsets)
        for tp, rs in ranges.items():
            rs.sort()
            at = start.get(tp)
            at = rs[0][0] if at is None else at
            for a, b in rs:
                if a != at:
                    what = "read twice" if a < at else "skipped"
                    return None, f"{tp[0]}[{tp[1]}] offsets {min(a, at)}..{max(a, at)} were {what} in this round"
                at = b
            out[tp] = at
        return out, None

    def _rollback(self, why):
        self.log(f"evstore train-cluster: restoring the last commit: {why}")
        meta = self.manager.restore()
        self._set_position(meta)
        self._scored = []
        self.rollbacks.append((why, self.kafka_position()["kafka"]))

    def _done(self):
        if self.max_events is not None and self.messages >= self.max_events:
            return "max_events"
        if self.until is not None and time.time() >= self.until:
            return "until"
        return None

    def train_stream(self, stop_event=None, on_commit=None):
        """Rounds of `delta_every` steps, a commit after each exact round with messages, until max_events /
        until / `stop_event`; returns why it ended."""
        failed = 0
        if self.manager.last_committed is None:
            self._commit(on_commit)     # the initial state: what a rollback before any event returns to
        while True:
            ended = self._done() or ("stopped" if stop_event is not None and stop_event.is_set() else None)
            if ended:
                return ended
            plan = self.plan()
            results, why = self._round(plan)
            if results is not None:
                metas = [json.loads(_text(r[2])) for r in results]
                if any(m.get("stale") for m in metas):
                    raise RuntimeError("evstore train-cluster: a newer chief fenced this one's steps on the workers "
                                       "(it took over the job); this chief stops")
                offsets, why = self._check(plan, metas)
            if why is not None:
                failed += 1
                if failed > self.max_rollbacks:
                    raise RuntimeError(f"evstore train-cluster: {failed} rounds in a row were not exact; last: {why}")
                self._rollback(why)
                continue
            failed = 0
            self._waiting(plan, metas)
            taken = sum(m["messages"] for m in metas)
            if not taken:
                continue
            self.offsets = offsets
            self.messages += taken
            self.bad += sum(m["bad"] for m in metas)
            self.steps += len(results)
            for scores, labels, _ in results:
                labels = np.asarray(labels)
                if labels.size:
                    self.examples += int(labels.size)
                    self.progressive.record(self.examples, labels, np.asarray(scores))
            self._commit(on_commit)

    def _waiting(self, plan, metas):
        """Says which workers ran no step this round (their partitions wait for them)."""
        ran = {m["task"] for m in metas}
        idle = sorted({w for _, _, w, _ in plan["parts"]} - ran)
        if idle and len(metas) >= 2 * self.workers:
            parts = ", ".join(f"{t}[{p}]" for t, p, w, _ in plan["parts"] if w in idle)
            self.log(f"evstore train-cluster: worker(s) {idle} ran no step in this round; their partitions "
                     f"{parts} wait until they are back")

    def _commit(self, on_commit):
        meta = {"position": self.kafka_position(), "examples": self.examples}
        m = self.manager
        if m.last_committed is None or (self.full_every is not None and self.steps % self.full_every == 0):
            seq, kind = m.save_full(meta, quality=self.quality), "full"
        else:
            seq, kind = m.save_delta(meta, quality=self.quality), "delta"
        self.commits.append((seq, kind, self.kafka_position()))
        self._group_commit()
        if on_commit:
            on_commit(seq, self.kafka_position())
        return seq

    def _group_commit(self):
        """The commit's offsets to the consumer group (lag monitoring), after the checkpoint commit."""
        k = _kafka()
        tps = [k.TopicPartition(t, p, off) for (t, p), off in sorted(self.offsets.items())]
        if not tps:
            return
        _failpoints.hit("before-group-commit")
        try:
            self.consumer().commit(offsets=tps, asynchronous=False)
        except k.KafkaException as e:   # the next commit's offsets go, and cover these
            self.log(f"evstore train-cluster: committing offsets to group {self.kafka['group']} failed: {e}")

    def close(self):
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def _text(v):
    """A step's string output as str (a tensor locally, numpy bytes from a RemoteValue)."""
    v = v.numpy() if hasattr(v, "numpy") else v
    v = v.item() if isinstance(v, np.ndarray) else v
    return v.decode() if isinstance(v, bytes) else str(v)


def run(cluster, checkpoints, bootstrap_servers, topics, group_id="evstore", properties=None, max_events=None,
        until=None, batch_size=256, seed=0, learning_rate=0.05, delta_every=20, full_every=None, wait=0.2,
        linger=0.2, dead_letter_topic=None, log=print, fence_timeout=60.0):
    """`evstore train-cluster --kafka`: resume from `checkpoints`, train from the topics until max_events / until
    (each worker consuming its own partitions), committing every `delta_every` steps; returns a summary."""
    t0 = time.time()
    job = KafkaClusterJob(cluster, checkpoints, bootstrap_servers, topics, group_id=group_id, properties=properties,
                          max_events=max_events, until=until, wait=wait, linger=linger, log=log,
                          dead_letter_topic=dead_letter_topic, fence_timeout=fence_timeout,
                          batch_size=batch_size, seed=seed, learning_rate=learning_rate, delta_every=delta_every,
                          full_every=full_every)
    start = job.resume()
    where = ", ".join(f"{t}[{p}]@{o}" for t, ps in start["kafka"].items() for p, o in ps.items()) or "the group's offsets"
    log(f"evstore train-cluster: {job.num_ps} PS, {job.workers} worker(s) each consuming its own partitions of "
        f"{', '.join(job.topics)}; resuming at {where}")
    try:
        ended = job.train_stream(on_commit=lambda seq, pos: log(
            f"committed seq={seq} messages={pos['messages']} offsets={json.dumps(pos['kafka'], sort_keys=True)}"))
    finally:
        job.close()
    print(f"evstore train-cluster: ended ({ended}) after {job.messages:,} messages", file=sys.stderr, flush=True)
    return {"resumed_at": start, "position": job.kafka_position(), "examples": job.examples, "ended": ended,
            "global_step": int(job.global_step.numpy()), "commits": len(job.commits),
            "rollbacks": [w for w, _ in job.rollbacks], "seconds": round(time.time() - t0, 1)}
