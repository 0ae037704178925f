"""The Kafka job across hosts (tests/hosts.py: network namespaces on one
bridge): the broker on a host of its own, its log on an object store on a
third, the trainer on a fourth; the broker host loses every process mid-run
and comes back, and the trainer, which only waited, trains every event once."""
import json
import os
import sys

import pytest

pytest.importorskip("confluent_kafka")

import hosts  # noqa: E402
from kafka_events import SPEC, counts, events, key_freqs, restored  # noqa: E402

PRODUCE = """
import json, sys
from evstore_app.job.kafka_produce import ensure_topic, produce_rows
bootstrap, path = sys.argv[1], sys.argv[2]
ensure_topic(bootstrap, "clicks", 2)
print("produced", produce_rows(bootstrap, "clicks", json.load(open(path)), partitions=2), flush=True)
"""


def test_a_trainer_on_its_own_host_trains_once_through_the_broker_hosts_loss(tmp_path):
    with hosts.network_or_skip(tmp_path) as net:
        store = net.object_store()
        kafka, trainer = net.host("kafka"), net.host("trainer")
        broker_env = {"AWS_ENDPOINT": store.endpoint, "AWS_ALLOW_HTTP": "true"}
        broker_argv = [sys.executable, "-m", "evstore_app.job.kafka_broker", "--address", kafka.address,
                       "--port", "9092", "--storage", f"s3://{store.bucket}/"]

        def start_broker(name):
            b = kafka.start(broker_argv, name=name, env=broker_env)
            b.wait_line(lambda ln: ln.startswith("Kafka broker (Tansu) on"))
            return b

        def produce(rows, name):
            path = kafka.put(f"{name}.json", json.dumps(rows))
            p = kafka.start([sys.executable, "-c", PRODUCE, f"{kafka.address}:9092", path], name=name)
            assert p.wait(timeout=120) == 0

        start_broker("broker")
        first, second = events(500, seed=13), events(500, seed=13, start=500)
        produce(first, "produce1")
        spec = trainer.put("spec.json", json.dumps(SPEC))
        job = trainer.start([sys.executable, "-m", "evstore_app.cli", "train", "--kafka", f"{kafka.address}:9092",
                             "--topic", "clicks", "--spec", spec, "--checkpoints", "/tmp/root", "--max-events",
                             "1000", "--delta-every", "0.3", "--no-progress"], name="train")
        log = trainer.log_path("train")
        hosts_wait(lambda: _committed(os.path.join(trainer.tmp, "root")) == 500, job)
        kafka.kill_all()                          # the broker host loses every process
        hosts_wait(lambda: "waiting for the Kafka broker" in open(log).read(), job)
        start_broker("broker2")
        produce(second, "produce2")
        assert job.wait(timeout=300) == 0, open(log).read()[-3000:]
        model, meta = restored(os.path.join(trainer.tmp, "root"))
        rows = first + second
        assert key_freqs(model, "user") == counts(rows, "user") and key_freqs(model, "item") == counts(rows, "item")
        assert meta["position"]["kafka"] == {"clicks": {"0": 500, "1": 500}}


def _committed(root):
    from kafka_events import committed_messages
    return committed_messages(str(root))


def hosts_wait(what, proc, timeout=300):
    import time
    deadline = time.time() + timeout
    while not what():
        assert proc.alive(), "the job ended early"
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
