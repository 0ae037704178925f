"""The Kafka source's arguments, refused before anything connects: a clear
error naming what is wrong (no broker needed)."""
import datetime

import pytest

from evstore_app.job.kafka_source import KafkaStream, parse_until


def test_until_takes_an_iso_time_or_a_duration():
    assert parse_until("90s", now=1000.0) == 1090.0
    assert parse_until("30m", now=0.0) == 1800.0 and parse_until("2h", now=0.0) == 7200.0
    t = datetime.datetime(2026, 11, 28, tzinfo=datetime.timezone.utc).timestamp()
    assert parse_until("2026-11-28T00:00:00Z") == parse_until("2026-11-28T00:00:00") == t
    with pytest.raises(ValueError, match=r"ISO 8601 time .* or a duration \(90s, 30m, 2h\), got 'soon'"):
        parse_until("soon")


def test_auto_commit_is_refused_because_the_checkpoint_commits_offsets():
    with pytest.raises(ValueError, match="enable.auto.commit=true: .*the job commits them to the group itself"):
        KafkaStream("127.0.0.1:9092", "clicks", properties={"enable.auto.commit": "true"})


@pytest.mark.parametrize("kw, message", [({"topics": []}, "at least one topic"),
                                         ({"topics": "t", "max_events": 0}, "max_events must be a positive int"),
                                         ({"topics": "t", "linger": 0}, "linger must be a positive number")])
def test_bad_stream_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        KafkaStream("127.0.0.1:9092", **kw)
