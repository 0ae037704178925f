"""Kafka topics as the job's stream (confluent-kafka, librdkafka), trained
exactly once by the checkpoint.

Messages are JSON objects whose fields are the feature spec's columns (the
same spec as files: sparse fields' columns, dense columns, the label). The
stream's position is the next offset of every partition it reads,
{"kafka": {topic: {partition: offset}}, ...}: the trainer records it under
the checkpoint manager's lock with each batch, so every commit's manifest
holds the offsets its state was trained up to (metadata "position").

Exactly once (docs/guides/streaming-job.md, "Kafka"):
  * the job assigns itself the partitions (no group rebalance decides where
    it starts) and seeks each to the offset the newest commit recorded,
    whatever the consumer group says; partitions the commit does not know
    start at the group's committed offset, else at auto.offset.reset
    (earliest by default);
  * offsets are committed to the group only after a checkpoint commit, and
    only the offsets that commit recorded: the group's offsets are for lag
    monitoring and never ahead of a commit;
  * a killed job loses at most the batches trained since the last commit,
    and the restarted job trains exactly those again from the recorded
    offsets: every event is in the model once.
With `group_managed=True` the consumer group assigns the partitions
(subscribe): on every assignment the job still seeks each partition to its
own position (trained in this process, or the commit's), so a rebalance
neither skips nor repeats events for this model.

A message that is not a JSON object, lacks a column or holds a value of the
wrong type is counted, logged with its topic, partition and offset, and
skipped (or produced to `dead_letter_topic` first); its offset is consumed
like any other. The broker going away: the stream waits, saying what it
waits for, and resumes; checkpoint commits go on meanwhile.
"""
import logging
import sys
import threading
import time

import numpy as np
import pyarrow as pa

from checkpoint import _failpoints
from evstore_app.job.source import column_ids, label_values

__all__ = ["KafkaStream", "KafkaUnavailableError", "parse_until"]

log = logging.getLogger("evstore.kafka")

_DEFAULTS = {"enable.auto.commit": False, "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
             "enable.partition.eof": False, "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 2000,
             # Group-managed runs: a rebalance waits for every member's next heartbeat, and a broker may
             # wait for members up to their session timeout (Tansu: about half of it); Kafka's default
             # before 3.0, 10 s, instead of librdkafka's 45 s.
             "heartbeat.interval.ms": 1000, "session.timeout.ms": 10000}
_FORBIDDEN = {"enable.auto.commit": "true would commit offsets the checkpoint has not recorded (the job commits "
                                    "them to the group itself, after each checkpoint commit)"}
_INT64 = (-2**63, 2**63 - 1)


class KafkaUnavailableError(RuntimeError):
    """confluent-kafka is not installed (pip install 'evstore[kafka]')."""


def _kafka():
    try:
        import confluent_kafka
    except ImportError:
        raise KafkaUnavailableError("the Kafka source needs confluent-kafka: pip install 'evstore[kafka]' "
                                    "(or pip install confluent-kafka)") from None
    return confluent_kafka


def parse_until(text, now=None):
    """A wall-clock deadline (epoch seconds) from `--until`: an ISO 8601 time
    ("2026-11-27T08:00:00Z"; no zone: UTC) or a duration from now ("90s",
    "30m", "2h"). ValueError naming both forms otherwise."""
    import datetime
    now = time.time() if now is None else now
    t = str(text).strip()
    units = {"s": 1, "m": 60, "h": 3600}
    if t and t[-1] in units:
        try:
            return now + float(t[:-1]) * units[t[-1]]
        except ValueError:
            pass
    try:
        d = datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--until takes an ISO 8601 time (2026-11-27T08:00:00Z) or a duration (90s, 30m, 2h), "
                         f"got {text!r}") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=datetime.timezone.utc)
    return d.timestamp()


def _need(spec):
    """[(column, kind)] every message must carry: kind "int64" / "string" /
    "hash" for a sparse field's column, "dense", "label"."""
    out = [(f["column"], f.get("keys", "int64")) for f in spec["sparse"]]
    out += [(c, "dense") for c in spec["dense"]]
    return out + [(spec["label"]["column"], "label")]


def _number(v):
    return isinstance(v, (int, float)) and not (isinstance(v, float) and v != v)


def _check(record, need):
    """None if `record` (a decoded message) carries every column with a value
    of the right type, else the reason it is refused."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    for col, kind in need:
        if col not in record:
            return f"lacks column {col!r}"
        v = record[col]
        if kind == "int64":
            if isinstance(v, bool) or not isinstance(v, int) or not _INT64[0] <= v <= _INT64[1]:
                return f"column {col!r} holds {v!r}, not an int64 id"
        elif kind in ("string", "hash"):
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                return f"column {col!r} holds {v!r}, not a string or integer key"
        elif kind == "dense":
            if v is not None and not _number(v):
                return f"column {col!r} holds {v!r}, not a number"
        elif not _number(v):
            return f"column {col!r} holds {v!r}, not a number (the label)"
    return None


class KafkaStream:
    """Batches of JSON messages from Kafka topics, with their offsets.

    Args:
      bootstrap_servers: "host:port[,host:port...]".
      topics: a topic name or a list of them.
      group_id: the consumer group the offsets are committed to (after each
        checkpoint commit; for lag monitoring and for partitions a commit does
        not know yet).
      properties: more librdkafka properties, passed through (security:
        {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", ...});
        "enable.auto.commit": true is refused (ValueError).
      max_events: stop once this many messages were consumed in all (the
        commit's count, across restarts; bad messages count), like
        `--max-rows` for files. None: unbounded.
      until: stop at this wall-clock time (epoch seconds; see parse_until).
      until_event_time: an event-time bound (epoch seconds): each partition
        stops before its first message whose timestamp (the producer's, or the
        broker's with LogAppendTime) is at or past it, leaving that message
        unconsumed (the commit's offset points at it, so a later run without
        the bound starts there); the stream ends once every partition reached
        the bound. None: no bound.
      linger: seconds a batch waits to fill once its first message arrived
        (a slow stream still trains, and commits, every `linger` seconds).
      dead_letter_topic: where bad messages are produced (with headers naming
        their source and the reason) before they are skipped; None: skipped.
      group_managed: let the consumer group assign partitions (subscribe); the
        job still seeks each assigned partition to its own position.
      discover_every: seconds between looks for new partitions (self-assigned).
      partition_filter: (topic, partition) -> bool: only the partitions it
        accepts (e.g. one worker's share); None: all.

    Raises:
      KafkaUnavailableError: confluent-kafka is not installed (at `open`).
      ValueError: bad arguments.
    """

    def __init__(self, bootstrap_servers, topics, group_id="evstore", properties=None, max_events=None,
                 until=None, linger=0.5, dead_letter_topic=None, group_managed=False, discover_every=10.0,
                 partition_filter=None, until_event_time=None):
        if not bootstrap_servers:
            raise ValueError("the Kafka source needs bootstrap servers (host:port)")
        self.topics = [topics] if isinstance(topics, str) else list(topics or [])
        if not self.topics or not all(isinstance(t, str) and t for t in self.topics):
            raise ValueError(f"the Kafka source needs at least one topic name, got {topics!r}")
        if max_events is not None and (isinstance(max_events, bool) or int(max_events) < 1):
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        if linger is None or linger <= 0:
            raise ValueError(f"linger must be a positive number of seconds, got {linger!r}")
        props = {str(k): v for k, v in (properties or {}).items()}
        for k, why in _FORBIDDEN.items():
            if str(props.get(k, "")).lower() in ("true", "1"):
                raise ValueError(f"Kafka property {k}={props[k]}: {why}")
        self.bootstrap = bootstrap_servers
        self.group_id = group_id
        self.config = {**_DEFAULTS, **props, "bootstrap.servers": bootstrap_servers, "group.id": group_id}
        self.max_events = None if max_events is None else int(max_events)
        self.until = until
        self.until_event_ms = None if until_event_time is None else int(round(until_event_time * 1000))
        self._reached = set()         # (topic, partition) past the event-time bound: paused, not consumed
        self.linger = float(linger)
        self.dead_letter_topic = dead_letter_topic
        self.group_managed = group_managed
        self.discover_every = discover_every
        self.partition_filter = partition_filter
        self.rows = None              # unbounded: no "of N rows"
        self.spec = None
        self.consumer = None
        self._dlq = None
        self.offsets = {}             # (topic, partition) -> next offset to train
        self.messages = 0             # consumed in all (the commit's count), bad ones included
        self.bad = 0
        self.bad_reasons = {}
        self.event_time_ms = None     # newest event (producer timestamp) trained
        self.ended = None             # why the stream ended: "max_events", "until", "until_event_time", "stopped"
        self._pending_ts = []         # (messages after the batch, event timestamps ms) not yet committed
        self.freshness = []           # [(commit seq, events, p50 s, p99 s, max s)] event time -> commit
        self._fresh_samples = []
        self._group_seq = None        # the last commit whose offsets went to the group
        self._down_since = None
        self._last_wait_note = 0.0
        self.waits = []               # [(start, end)] the broker could not be reached
        self._lock = threading.Lock()

    # ---- setup -------------------------------------------------------------------
    def bind(self, spec):
        """Sets the feature spec the messages are decoded with; returns self."""
        self.spec = spec
        self._need = _need(spec)
        return self

    def describe(self):
        return f"Kafka {self.bootstrap} topic(s) {', '.join(self.topics)} (group {self.group_id})"

    def _error(self, err):
        """librdkafka's error callback (also called from its own threads): never raises, since an exception
        in a callback resurfaces in the next consume() call; imports nothing (the module was imported by open)."""
        try:
            if err.code() in self._down_codes:
                if self._down_since is None:
                    self._down_since = time.time()
                self._note_wait(err.str())
            else:
                log.warning("Kafka: %s", err.str())
        except Exception:  # noqa: BLE001 - see above
            log.exception("Kafka error callback")

    def _note_wait(self, why):
        now = time.time()
        if now - self._last_wait_note >= 10.0:
            self._last_wait_note = now
            print(f"evstore train: waiting for the Kafka broker at {self.bootstrap} (topics "
                  f"{', '.join(self.topics)}): {why}; training resumes when it answers, committed checkpoints "
                  "are kept", file=sys.stderr, flush=True)

    def _up(self):
        if self._down_since is not None:
            self.waits.append((self._down_since, time.time()))
            print(f"evstore train: the Kafka broker at {self.bootstrap} answers again after "
                  f"{time.time() - self._down_since:.1f} s; training resumes", file=sys.stderr, flush=True)
            self._down_since = None
            self._last_wait_note = 0.0

    def open(self, position=None, stop_event=None):
        """Connects and assigns the partitions, each at the offset `position`
        (a committed position dict) records; waits for the broker, saying so.
        Returns False when `stop_event` was set while waiting."""
        k = _kafka()
        self._down_codes = (k.KafkaError._ALL_BROKERS_DOWN, k.KafkaError._TRANSPORT, k.KafkaError._RESOLVE)
        if self.spec is None:
            raise ValueError("KafkaStream.bind(spec) first (evstore_app.job.train.run does)")
        position = position or {}
        for topic, parts in (position.get("kafka") or {}).items():
            for p, off in parts.items():
                self.offsets[(topic, int(p))] = int(off)
        self.messages = int(position.get("messages", 0))
        self.bad = int(position.get("bad", 0))
        self.event_time_ms = position.get("event_time_ms")
        self.consumer = k.Consumer({**self.config, "error_cb": self._error, "logger": _QUIET})
        if self.dead_letter_topic:
            self._dlq = k.Producer({"bootstrap.servers": self.bootstrap, "message.timeout.ms": 0,
                                    "enable.idempotence": False, "error_cb": self._error, "logger": _QUIET,
                                    **{p: v for p, v in self.config.items() if p.startswith(("security.", "sasl.",
                                                                                              "ssl."))}})
        if self.group_managed:
            self.consumer.subscribe(self.topics, on_assign=self._on_assign)
            return True
        while True:
            if stop_event is not None and stop_event.is_set():
                return False
            try:
                parts = self._partitions()
            except k.KafkaException as e:
                self._error(e.args[0])
                time.sleep(0.5)
                continue
            if parts:
                break
            self._note_wait(f"topic(s) {', '.join(self.topics)} have no partitions yet")
            time.sleep(0.5)
        self._up()
        self._assign(parts)
        self._discovered = time.time()
        return True

    def _partitions(self):
        """Every (topic, partition) of the topics that partition_filter accepts (KafkaException: no broker)."""
        out = []
        for t in self.topics:
            md = self.consumer.list_topics(t, timeout=5)
            tm = md.topics.get(t)
            if tm is None or tm.error is not None:
                continue
            out += [(t, p) for p in sorted(tm.partitions)
                    if self.partition_filter is None or self.partition_filter(t, p)]
        return out

    def _tp(self, t, p):
        k = _kafka()
        return k.TopicPartition(t, p, self.offsets.get((t, p), k.OFFSET_STORED))

    def _assign(self, parts):
        self._assigned = set(parts)
        self.consumer.assign([self._tp(t, p) for t, p in parts])

    def _on_assign(self, consumer, parts):
        """Group-managed: every partition the group gives starts at this job's own position."""
        k = _kafka()
        for tp in parts:
            tp.offset = self.offsets.get((tp.topic, tp.partition), k.OFFSET_STORED)
        consumer.assign(parts)
        self._assigned = {(tp.topic, tp.partition) for tp in parts}
        reached = [tp for tp in parts if (tp.topic, tp.partition) in self._reached]
        if reached:       # past the event-time bound before the rebalance: still not consumed
            consumer.pause(reached)
        print("evstore train: the group assigned " + (", ".join(
            f"{tp.topic}[{tp.partition}]@" + (f"{tp.offset}" if tp.offset >= 0 else "group's offset")
            for tp in parts) or "no partition"), file=sys.stderr, flush=True)

    def _discover(self):
        if self.group_managed or time.time() - self._discovered < self.discover_every:
            return
        self._discovered = time.time()
        try:
            parts = set(self._partitions())
        except _kafka().KafkaException:
            return
        new = sorted(parts - self._assigned)
        if new:
            print(f"evstore train: new partitions {', '.join(f'{t}[{p}]' for t, p in new)}: consuming them from the "
                  "group's committed offset, else auto.offset.reset", file=sys.stderr, flush=True)
            self._assigned |= set(new)
            self.consumer.incremental_assign([self._tp(t, p) for t, p in new])

    # ---- reading -----------------------------------------------------------------
    def position(self):
        """The position after everything handed out so far (what a commit records)."""
        kafka = {}
        for (t, p), off in sorted(self.offsets.items()):
            kafka.setdefault(t, {})[str(p)] = off
        return {"kafka": kafka, "messages": self.messages, "bad": self.bad, "event_time_ms": self.event_time_ms}

    def _done(self):
        if self.max_events is not None and self.messages >= self.max_events:
            self.ended = "max_events"
        elif self.until is not None and time.time() >= self.until:
            self.ended = "until"
        elif self.until_event_ms is not None and getattr(self, "_assigned", None) and self._assigned <= self._reached:
            self.ended = "until_event_time"
        return self.ended is not None

    def batches(self, batch_size, stop_event=None, on_idle=None):
        """Yields (position after the batch, (columns, labels)) until
        max_events / until / `stop_event`. `on_idle()` is called at least every
        `linger` seconds (the job commits the group's offsets there)."""
        while not self._done():
            if stop_event is not None and stop_event.is_set():
                self.ended = "stopped"
                return
            msgs = self._fill(batch_size, stop_event, on_idle)
            if not msgs:
                continue
            records = self._take(msgs, stop_event)
            if not records:
                continue
            yield self.position(), self._columns(records)

    def next_batch(self, batch_size, wait):
        """One batch for a caller that cannot block (a parameter-server
        worker's step): waits at most `wait` s for a first message, then up
        to `linger` for the rest. Returns (ranges, (columns, labels) or None
        when every message was bad or none came): ranges {(topic, partition):
        (first offset, next offset)} of the messages taken, the first being
        where the previous batch of that partition ended."""
        before = dict(self.offsets)
        msgs = self._fill(batch_size, None, None, idle_until=time.time() + wait)
        ranges = {}
        for m in msgs:
            tp = (m.topic(), m.partition())
            if tp not in ranges:
                ranges[tp] = [before.get(tp, m.offset()), m.offset() + 1]
            ranges[tp][1] = m.offset() + 1
        records = self._take(msgs, None)
        return {tp: tuple(r) for tp, r in ranges.items()}, (self._columns(records) if records else None)

    def _take(self, msgs, stop_event):
        """Decodes consumed messages, advancing the offsets; returns the good records."""
        records, ts = [], []
        _failpoints.hit("kafka-batch-consumed")
        if self.until_event_ms is not None:
            msgs = self._before_bound(msgs)
        for m in msgs:
            rec = self._decode(m)
            self.offsets[(m.topic(), m.partition())] = m.offset() + 1
            self.messages += 1
            if rec is not None:
                records.append(rec)
                ts.append(m.timestamp()[1])
        self._flush_dlq(stop_event)
        if ts:
            self.event_time_ms = max(ts) if self.event_time_ms is None else max(self.event_time_ms, max(ts))
            self._pending_ts.append((self.messages, np.asarray(ts, np.int64)))
        return records

    def _fill(self, batch_size, stop_event, on_idle, idle_until=None):
        """Up to batch_size messages (fewer at max_events), waiting at most `linger` once one arrived
        (and, with `idle_until`, none after that time when none came)."""
        want = batch_size if self.max_events is None else min(batch_size, self.max_events - self.messages)
        out, first = [], None
        while len(out) < want:
            if stop_event is not None and stop_event.is_set():
                break
            if self.until is not None and time.time() >= self.until:
                break
            if self.until_event_ms is not None and getattr(self, "_assigned", None) and self._assigned <= self._reached:
                break
            wait = self.linger if first is None else first + self.linger - time.time()
            if first is None and idle_until is not None:
                wait = idle_until - time.time()
            if wait <= 0:
                break
            got = self.consumer.consume(want - len(out), timeout=min(wait, 0.25))
            for m in got:
                if m.error() is not None:
                    self._error(m.error())
                    continue
                out.append(m)
            if out:
                self._up()
                if first is None:
                    first = time.time()
            elif first is None:
                if on_idle is not None:
                    on_idle()
                self._discover()
                if self._down_since is not None:
                    self._note_wait("no answer")
        return out

    def _before_bound(self, msgs):
        """The messages before each partition's first one at or past the event-time bound; that partition
        is paused there (its offset stays at that message)."""
        k = _kafka()
        out = []
        for m in msgs:
            tp = (m.topic(), m.partition())
            if tp in self._reached:
                continue
            if m.timestamp()[1] >= self.until_event_ms:
                self._reached.add(tp)
                self.consumer.pause([k.TopicPartition(*tp)])
                print(f"evstore train: {tp[0]}[{tp[1]}] reached the event-time bound at offset {m.offset()}",
                      file=sys.stderr, flush=True)
                continue
            out.append(m)
        return out

    def _decode(self, m):
        import orjson
        try:
            rec = orjson.loads(m.value() or b"")
        except orjson.JSONDecodeError as e:
            return self._reject(m, f"not JSON ({e})")
        why = _check(rec, self._need)
        return rec if why is None else self._reject(m, why)

    def _reject(self, m, why):
        self.bad += 1
        kind = why.split(" (")[0] if why.startswith("not JSON") else why.split(" holds ")[0]
        self.bad_reasons[kind] = self.bad_reasons.get(kind, 0) + 1
        if self.bad <= 100 or self.bad % 1000 == 0:
            print(f"evstore train: skipping bad message {m.topic()}[{m.partition()}]@{m.offset()}: {why}"
                  + (f" (produced to {self.dead_letter_topic})" if self._dlq is not None else "")
                  + (f"; {self.bad:,} bad messages so far (only every 1000th is shown from here)"
                     if self.bad == 100 else ""), file=sys.stderr, flush=True)
        if self._dlq is not None:
            self._dlq.produce(self.dead_letter_topic, value=m.value(), key=m.key(),
                              headers=[("evstore.error", why.encode()), ("evstore.topic", m.topic().encode()),
                                       ("evstore.partition", str(m.partition()).encode()),
                                       ("evstore.offset", str(m.offset()).encode())])
        return None

    def _flush_dlq(self, stop_event):
        """Dead letters are delivered before the batch's offsets can be committed (waits for the broker)."""
        while self._dlq is not None and len(self._dlq) > 0:
            if self._dlq.flush(1.0) > 0:
                self._note_wait(f"the dead-letter topic {self.dead_letter_topic} is not acknowledged yet")

    def _columns(self, records):
        """(columns, labels) of decoded records, as FileStream makes them from a table."""
        cols = {}
        for i, f in enumerate(self.spec["sparse"]):
            values = [r[f["column"]] for r in records]
            if f.get("keys", "int64") == "int64":
                cols[f["column"]] = np.asarray(values, np.int64)
            else:
                arr = pa.array([v if isinstance(v, str) else str(v) for v in values], pa.string())
                cols[f["column"]] = column_ids(arr, f, f"spec: sparse[{i}]")
        for c in self.spec["dense"]:
            cols[c] = np.asarray([0.0 if r[c] is None else r[c] for r in records], np.float64).astype(np.float32)
        lab = np.asarray([r[self.spec["label"]["column"]] for r in records], np.float64)
        return cols, label_values(lab, self.spec)

    # ---- after commits -------------------------------------------------------------
    def committed(self, manifest, wait=False):
        """After checkpoint `manifest` committed: its recorded offsets go to the
        group (asynchronously unless `wait`), and its events' event time ->
        commit is measured. Once per commit; returns True when it did something."""
        if manifest is None or manifest.seq == self._group_seq:
            return False
        pos = manifest.metadata.get("position")
        if not isinstance(pos, dict) or "kafka" not in pos:
            return False
        self._group_seq = manifest.seq
        self._measure(manifest, int(pos.get("messages", 0)))
        k = _kafka()
        tps = [k.TopicPartition(t, int(p), int(off)) for t, parts in pos["kafka"].items() for p, off in parts.items()]
        if not tps:
            return True
        _failpoints.hit("before-group-commit")
        try:
            self.consumer.commit(offsets=tps, asynchronous=not wait)
        except k.KafkaException as e:   # the next commit's offsets go, and cover these
            log.warning("committing offsets to group %s failed: %s", self.group_id, e)
        return True

    def _measure(self, manifest, messages):
        done = [ts for n, ts in self._pending_ts if n <= messages]
        self._pending_ts = [(n, ts) for n, ts in self._pending_ts if n > messages]
        if not done:
            return
        lat = manifest.wall_time - np.concatenate(done) / 1000.0
        self.freshness.append((manifest.seq, int(lat.size), float(np.percentile(lat, 50)),
                               float(np.percentile(lat, 99)), float(lat.max())))
        step = max(1, lat.size // 2000)   # a bounded sample of every commit's events
        self._fresh_samples.append(lat[::step])

    def freshness_summary(self):
        """{"events", "p50_s", "p99_s", "max_s"} of event time -> commit over the run's commits (None: none)."""
        if not self._fresh_samples:
            return None
        lat = np.concatenate(self._fresh_samples)
        return {"events": int(sum(f[1] for f in self.freshness)), "p50_s": round(float(np.percentile(lat, 50)), 3),
                "p99_s": round(float(np.percentile(lat, 99)), 3), "max_s": round(max(f[4] for f in self.freshness), 3)}

    def lag(self):
        """{"topic[p]": messages behind the partition's high watermark} (from the
        last fetch responses; None for a partition not fetched yet)."""
        k = _kafka()
        out = {}
        for t, p in sorted(getattr(self, "_assigned", ())):
            try:
                lo, hi = self.consumer.get_watermark_offsets(k.TopicPartition(t, p), cached=True)
            except k.KafkaException:
                hi = -1
            nxt = self.offsets.get((t, p))
            out[f"{t}[{p}]"] = None if hi is None or hi < 0 else max(0, hi - (nxt if nxt is not None else lo))
        return out

    def close(self):
        if self._dlq is not None:
            self._dlq.flush(10)
        if self.consumer is not None:
            self._final_lag = self.lag()
            self.consumer.close()
            self.consumer = None
        if self._down_since is not None:
            self.waits.append((self._down_since, time.time()))
            self._down_since = None

    def report(self):
        """What the report and summary.json say about the stream."""
        return {"source": self.describe(), "messages": self.messages, "bad": self.bad,
                "bad_reasons": dict(self.bad_reasons), "ended": self.ended, "lag": self.lag() if self.consumer else getattr(self, "_final_lag", {}),
                "offsets": self.position()["kafka"], "event_to_commit": self.freshness_summary(),
                "event_to_commit_by_commit": [{"seq": q, "events": n, "p50_s": round(a, 3), "p99_s": round(b, 3)}
                                              for q, n, a, b, _ in self.freshness],
                "broker_waits_s": [round(b - a, 2) for a, b in self.waits],
                "dead_letter_topic": self.dead_letter_topic}


# librdkafka's own log lines (a refused connection every 100 ms while the
# broker is away) go to this logger, silenced: the stream says what it waits for.
_QUIET = logging.getLogger("evstore.kafka.librdkafka")
_QUIET.setLevel(logging.WARNING + 100)
