"""The broker going away mid-run: `evstore train --kafka` says what it waits
for, keeps its commits, and once the broker is back trains every event once.
The broker keeps its log on S3 (Tansu's s3:// storage on moto's server, both
real processes on 127.0.0.1), so a SIGKILLed broker restarts with its topics,
messages and committed offsets, as a Kafka broker with disks does."""
import json
import signal

import pytest

pytest.importorskip("confluent_kafka")

from kafka_events import committed_messages, counts, create_topic, events, key_freqs, produce, restored, train, \
    wait_until  # noqa: E402
from s3_server import ENV, start_server  # noqa: E402

from evstore_app.job.kafka_broker import Broker  # noqa: E402


def test_a_broker_killed_and_restarted_mid_run_loses_and_repeats_nothing(tmp_path):
    moto, endpoint = start_server(open(tmp_path / "moto.log", "w"))
    try:
        import boto3
        boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in ENV.items()
                                                     if k != "AWS_DEFAULT_REGION"},
                     region_name=ENV["AWS_DEFAULT_REGION"]).create_bucket(Bucket="tansu")
        broker = Broker(storage="s3://tansu/", env={**ENV, "AWS_ENDPOINT": endpoint},
                        log=str(tmp_path / "broker.log")).start()
        first, second = events(600, seed=11), events(600, seed=11, start=600)
        create_topic(broker.bootstrap, "clicks", 2)
        produce(broker.bootstrap, "clicks", first, partitions=2)
        err_path = tmp_path / "train.err"
        with open(err_path, "w") as err:
            p = train(tmp_path / "root", broker.bootstrap, "clicks", "--max-events", "1200", "--delta-every", "0.3",
                      wait=False, stderr=err)
            wait_until(lambda: committed_messages(tmp_path / "root") == 600, p)
            broker.kill()
            wait_until(lambda: "waiting for the Kafka broker at " + broker.bootstrap in err_path.read_text(), p)
            commits_while_away = committed_messages(tmp_path / "root")
            broker.start()
            produce(broker.bootstrap, "clicks", second, partitions=2)
            out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, err_path.read_text()[-3000:]
        text = err_path.read_text()
        assert "answers again after" in text and commits_while_away == 600
        model, meta = restored(tmp_path / "root")
        rows = first + second
        assert key_freqs(model, "user") == counts(rows, "user") and key_freqs(model, "item") == counts(rows, "item")
        assert meta["position"]["kafka"] == {"clicks": {"0": 600, "1": 600}}
        s = json.loads((tmp_path / "root.train" / "summary.json").read_text())
        assert len(s["kafka"]["broker_waits_s"]) >= 1 and "waited for the Kafka broker" in out
    finally:
        try:
            broker.stop()
        except NameError:
            pass
        moto.send_signal(signal.SIGTERM)
        moto.wait(timeout=30)
