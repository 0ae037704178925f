"""`evstore train --kafka` against a real Kafka-protocol broker (Tansu, a
process on 127.0.0.1): every event trained exactly once, whatever kills the
job and whatever the consumer group says; offsets in every commit; bad
messages counted, logged and skipped; the broker going away and coming back.

A key's frequency counts the training events that carried it, so "sum of
frequencies per key = events per key" is the exactly-once check; with one
partition the batch order is the file's, so the killed-and-resumed job must
also end in the state of the same events trained from a Parquet file."""
import datetime
import json
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("confluent_kafka")

from kafka_events import (SPEC, counts, create_topic, events, group_offsets, key_freqs, produce, restored,  # noqa: E402
                          dead_letters, set_group_offsets, train, wait_for)

from evstore_app.job.kafka_broker import Broker  # noqa: E402


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = Broker(log=str(tmp_path_factory.mktemp("kafka") / "broker.log")).start()
    yield b
    b.stop()


BAD = [(0, b"not json at all"), (1, b'{"user": 3, "item": 4, "hour": 1}'), (1, b'{"user": "x", "item": 4, '
                                                                              b'"hour": 1, "click": 0}'),
       (0, b"[1, 2]")]


@pytest.fixture(scope="module")
def three_partition_run(broker, tmp_path_factory):
    """1500 events over three partitions and four bad messages, trained by one run to the end."""
    tmp = tmp_path_factory.mktemp("three")
    rows = events(1500, seed=3)
    create_topic(broker.bootstrap, "clicks3", 3)
    produce(broker.bootstrap, "clicks3", rows, partitions=3, raw=BAD)
    out, err = train(tmp / "root", broker.bootstrap, "clicks3", "--group", "g3", "--max-events", "1504",
                     "--delta-every", "0.5", "--dead-letter-topic", "clicks3-dead")
    return {"rows": rows, "root": tmp / "root", "out": out, "err": err,
            "summary": json.loads((tmp / "root.train" / "summary.json").read_text())}


def test_every_event_of_every_partition_is_trained_once(three_partition_run):
    model, meta = restored(three_partition_run["root"])
    rows = three_partition_run["rows"]
    assert key_freqs(model, "user") == counts(rows, "user")
    assert key_freqs(model, "item") == counts(rows, "item")
    assert meta["examples"] == 1500 and meta["position"]["messages"] == 1504 and meta["position"]["bad"] == 4


def test_each_commit_records_every_partitions_offset_and_the_group_follows_the_last(three_partition_run, broker):
    _, meta = restored(three_partition_run["root"])
    assert meta["position"]["kafka"] == {"clicks3": {"0": 502, "1": 502, "2": 500}}
    assert group_offsets(broker.bootstrap, "g3", "clicks3", 3) == {0: 502, 1: 502, 2: 500}
    s = three_partition_run["summary"]
    assert s["kafka"]["lag"] == {"clicks3[0]": 0, "clicks3[1]": 0, "clicks3[2]": 0}
    assert s["kafka"]["event_to_commit"]["events"] == 1500 and s["kafka"]["ended"] == "max_events"
    assert "event time -> commit: p50" in three_partition_run["out"]


def test_bad_messages_are_counted_logged_with_partition_and_offset_and_dead_lettered(three_partition_run, broker):
    err, s = three_partition_run["err"], three_partition_run["summary"]["kafka"]
    assert "skipping bad message clicks3[0]@500: not JSON" in err
    assert "skipping bad message clicks3[1]@500: lacks column 'click'" in err
    assert "skipping bad message clicks3[1]@501: column 'user' holds 'x', not an int64 id" in err
    assert "skipping bad message clicks3[0]@501: not a JSON object (list)" in err
    assert s["bad"] == 4 and sum(s["bad_reasons"].values()) == 4
    got = dead_letters(broker.bootstrap, "clicks3-dead", 4)
    assert sorted(m.value() for m in got) == sorted(v for _, v in BAD)
    origin = {(int(dict(m.headers())["evstore.partition"]), int(dict(m.headers())["evstore.offset"])) for m in got}
    assert origin == {(0, 500), (1, 500), (1, 501), (0, 501)}


def test_killed_at_any_moment_the_job_trains_every_event_once_into_the_uninterrupted_state(broker, tmp_path):
    """One partition: killed while a batch is consumed but not trained and while a
    checkpoint is written, with the group's offsets set wrong before each restart:
    ahead (a job trusting them would skip events) and behind (it would train events
    twice; what a kill between a commit and its group commit leaves, so that kill is
    not run again); the final state equals the same events trained from a Parquet
    file in one go."""
    rows = events(1600, seed=7)
    create_topic(broker.bootstrap, "clicks1", 1)
    produce(broker.bootstrap, "clicks1", rows)
    root, n = tmp_path / "root", "1600"
    flags = ("--group", "g1", "--max-events", n, "--delta-every", "0.2", "--batch-linger", "60")
    for point, group_says in (("kafka-batch-consumed@5", 1600), ("before-manifest@1", 0)):
        marker = tmp_path / f"{point}.hit"
        p = train(root, broker.bootstrap, "clicks1", *flags, wait=False,
                  env={"EVSTORE_FAILPOINT": point, "EVSTORE_FAILPOINT_FILE": str(marker)})
        wait_for(marker, p)
        p.send_signal(signal.SIGKILL)
        p.wait()
        set_group_offsets(broker.bootstrap, "g1", "clicks1", {0: group_says})   # the restart follows the commit
    out, err = train(root, broker.bootstrap, "clicks1", *flags)
    assert "resuming at offsets clicks1[0]@" in err
    model, meta = restored(root)
    assert key_freqs(model, "user") == counts(rows, "user") and key_freqs(model, "item") == counts(rows, "item")
    assert meta["examples"] == 1600 and meta["position"]["kafka"] == {"clicks1": {"0": 1600}}
    # The same events from a Parquet file, one uninterrupted run: the same state, bit for bit.
    from evstore_app.job import train as file_train
    from evstore_app.job.report import state_matches
    from evstore_app.job.spec import load_spec
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "clicks.parquet")
    file_train.run(str(tmp_path / "clicks.parquet"), SPEC, str(tmp_path / "file-root"), delta_every=3600,
                   progress=False, out=str(tmp_path / "file-out"))
    file_model, _ = restored(tmp_path / "file-root")
    assert state_matches(load_spec(SPEC), str(root), file_model)


def test_a_rebalance_of_a_group_managed_run_neither_skips_nor_repeats_events(broker, tmp_path):
    """Another member joins the job's group, takes a partition, commits a wrong
    offset for it (past the end: a job trusting the group would skip events)
    and leaves; the job gets the partition back and reads it from its own position."""
    import threading

    from confluent_kafka import Consumer, TopicPartition
    from kafka_events import committed_messages, wait_until
    first, second = events(400, seed=5), events(400, seed=5, start=400)
    create_topic(broker.bootstrap, "clicks2", 2)
    produce(broker.bootstrap, "clicks2", first, partitions=2)
    with open(tmp_path / "train.err", "w") as err:
        p = train(tmp_path / "root", broker.bootstrap, "clicks2", "--group", "gm", "--group-managed",
                  "--max-events", "800", "--delta-every", "0.3", wait=False, stderr=err)
        wait_until(lambda: committed_messages(tmp_path / "root") == 400, p)
        held, stop = [], threading.Event()
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "gm", "enable.auto.commit": False,
                      "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        c.subscribe(["clicks2"], on_assign=lambda cons, parts: held.extend(parts))

        def member():
            while not stop.is_set():
                c.consume(10, 0.1)      # its events are its own, never trained by the job's model
        t = threading.Thread(target=member)
        t.start()
        wait_until(lambda: held, p)
        produce(broker.bootstrap, "clicks2", second, partitions=2)
        mine = held[0].partition
        stop.set()
        t.join()
        c.commit(offsets=[TopicPartition("clicks2", mine, 10_000)], asynchronous=False)
        c.close()
        out, _ = p.communicate(timeout=300)
    text = (tmp_path / "train.err").read_text()
    assert p.returncode == 0, text[-3000:]
    assert text.count("the group assigned") >= 2
    model, meta = restored(tmp_path / "root")
    rows = first + second
    assert key_freqs(model, "user") == counts(rows, "user") and key_freqs(model, "item") == counts(rows, "item")
    assert meta["position"]["kafka"] == {"clicks2": {"0": 400, "1": 400}}


def test_an_event_time_bound_stops_each_partition_before_its_first_later_event(broker, tmp_path):
    """--until-event-time: 300 events timestamped T0 + i ms over two partitions, the bound T0 + 200 ms:
    the first 200 are trained, each partition's commit offset points at its first event at the bound,
    and the run ends by itself."""
    from confluent_kafka import Producer
    rows = events(300, seed=11)
    create_topic(broker.bootstrap, "clicks-et", 2)
    t0 = 1_790_000_000_000
    p = Producer({"bootstrap.servers": broker.bootstrap})
    for i, r in enumerate(rows):
        p.produce("clicks-et", json.dumps(r).encode(), partition=i % 2, timestamp=t0 + i)
    assert p.flush(30) == 0
    bound = datetime.datetime.fromtimestamp((t0 + 200) / 1000, datetime.timezone.utc).isoformat()
    out, err = train(tmp_path / "root", broker.bootstrap, "clicks-et", "--group", "get", "--until-event-time", bound)
    model, meta = restored(tmp_path / "root")
    assert key_freqs(model, "user") == counts(rows[:200], "user")
    assert meta["position"]["kafka"] == {"clicks-et": {"0": 100, "1": 100}} and meta["examples"] == 200
    assert "clicks-et[0] reached the event-time bound at offset 100" in err
    assert json.loads((tmp_path / "root.train" / "summary.json").read_text())["kafka"]["ended"] == "until_event_time"
