"""Produces a data file's rows to a Kafka topic as the JSON messages
`evstore train --kafka` reads: the rows the file job would train (the spec's
joins applied, timestamp order), row i to partition i % partitions, so each
partition keeps the file's order. For demos, tests and benchmarks:

    python -m evstore_app.job.kafka_produce --bootstrap 127.0.0.1:9092 --topic ratings \\
        --data examples/data/movielens/ratings.csv --spec examples/movielens.json [--rate 2000]
"""
import argparse
import sys
import time

__all__ = ["produce_rows", "ensure_topic"]


def ensure_topic(bootstrap, topic, partitions, properties=None):
    """Creates `topic` with `partitions` partitions unless it exists."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({**(properties or {}), "bootstrap.servers": bootstrap})
    if topic in admin.list_topics(timeout=10).topics:
        return
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result()
    except KafkaException as e:
        if "already exists" not in str(e).lower() and "TOPIC_ALREADY_EXISTS" not in str(e):
            raise


def produce_rows(bootstrap, topic, rows, partitions=1, rate=None, properties=None):
    """Produces `rows` (dicts) as JSON, row i to partition i % partitions, at
    most `rate` rows/s (None: as fast as the broker takes them); returns the
    count once every row is acknowledged. RuntimeError for a failed delivery."""
    import orjson
    from confluent_kafka import Producer
    failed = []
    p = Producer({"linger.ms": 5, **(properties or {}), "bootstrap.servers": bootstrap})
    t0, n = time.time(), 0
    for i, row in enumerate(rows):
        while True:
            try:
                p.produce(topic, orjson.dumps(row), partition=i % partitions,
                          on_delivery=lambda err, msg: err is not None and failed.append(err))
                break
            except BufferError:          # the local queue is full: let deliveries drain it
                p.poll(0.1)
        n += 1
        if rate is not None and n % 100 == 0:
            ahead = n / rate - (time.time() - t0)
            if ahead > 0:
                time.sleep(ahead)
        p.poll(0)
    p.flush()
    if failed:
        raise RuntimeError(f"{len(failed)} rows were not delivered to {topic}: {failed[0]}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m evstore_app.job.kafka_produce",
                                 description="produce a data file's rows to a Kafka topic as JSON messages")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--data", required=True, help="a data file or directory, as `evstore train --data` reads it")
    ap.add_argument("--spec", required=True, help="the feature spec (its joins and timestamp order apply)")
    ap.add_argument("--partitions", type=int, default=1, help="partitions of a topic this creates (default 1)")
    ap.add_argument("--rate", type=float, default=None, help="rows per second (default: as fast as possible)")
    ap.add_argument("--max-rows", type=int, default=None)
    a = ap.parse_args(argv)
    from evstore_app.job.source import read_table
    from evstore_app.job.spec import load_spec
    table = read_table(a.data, load_spec(a.spec), a.max_rows)
    ensure_topic(a.bootstrap, a.topic, a.partitions)
    n = produce_rows(a.bootstrap, a.topic, table.to_pylist(), partitions=a.partitions, rate=a.rate)
    print(f"produced {n:,} rows to {a.topic}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
