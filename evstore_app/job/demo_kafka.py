"""`evstore demo --kafka`: the demo's synthetic click stream through a Kafka
broker. A producer thread writes the stream's batches to a topic of its own
(JSON messages with the spec's columns, keeping a bounded number of batches
ahead of the trainer), and the trainer reads them back with the Kafka source
(evstore_app/job/kafka_source.py), so every commit records the topic's
offsets, as `evstore train --kafka` does. With no broker given, the bundled
one (Tansu, evstore_app/job/kafka_broker.py) runs for the demo's lifetime.
"""
import os
import threading
import uuid

from evstore_app.job.kafka_broker import Broker
from evstore_app.job.kafka_produce import ensure_topic
from evstore_app.job.kafka_source import KafkaStream

__all__ = ["KafkaFeed"]


class KafkaFeed:
    """The demo's stream produced to, and consumed from, Kafka.

    Args:
      stream: the ClickStream to produce.
      spec: the demo's feature spec (its columns name the messages' fields).
      bootstrap: a broker's "host:port"; None starts the bundled broker.
      out: the demo's directory (the bundled broker's log goes there).
      partitions: the topic's partitions (batch b goes to partition b % partitions).
      ahead: batches produced ahead of the trainer at most.
    """

    def __init__(self, stream, spec, bootstrap=None, out=None, partitions=2, ahead=8):
        self.stream, self.spec, self.partitions, self.ahead = stream, spec, partitions, ahead
        self.broker = None
        if bootstrap is None:
            log = os.path.join(out, "broker.log") if out else None
            self.broker = Broker(log=log).start()
            bootstrap = self.broker.bootstrap
        self.bootstrap = bootstrap
        run = uuid.uuid4().hex[:8]      # a topic and group of this run: a new root reads from the start
        self.topic, self.group = f"evstore-demo-{run}", f"evstore-demo-{run}"
        ensure_topic(bootstrap, self.topic, partitions)
        self.source = KafkaStream(bootstrap, self.topic, group_id=self.group, linger=0.2).bind(spec)
        self.produced = 0               # messages acknowledged
        self._stop = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._produce, daemon=True, name="demo-kafka-producer")

    def describe(self):
        where = "the bundled broker (Tansu)" if self.broker is not None else "the broker"
        return f"Kafka topic {self.topic} on {where} at {self.bootstrap}"

    def _produce(self):
        import orjson
        from confluent_kafka import Producer
        p = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        label = self.spec["label"]["column"]
        try:
            for b, (cols, y) in self.stream.batches():
                while self.produced - self.source.messages > self.ahead * self.stream.batch_size:
                    if self._stop.wait(0.05):
                        return
                if self._stop.is_set():
                    return
                names = list(cols)
                for i in range(len(y)):
                    row = {c: cols[c][i].item() for c in names}
                    row[label] = int(y[i])
                    while True:
                        try:
                            p.produce(self.topic, orjson.dumps(row), partition=b % self.partitions)
                            break
                        except BufferError:
                            p.poll(0.1)
                p.flush()
                self.produced += len(y)
        except Exception as e:  # noqa: BLE001 - the trainer's side reports it
            self._error = e
        finally:
            p.flush(10)

    def batches(self, stop_event):
        """Opens the consumer and starts producing; yields (position, (columns, labels)) as the trainer takes them."""
        self.source.open(None, stop_event)
        self._thread.start()
        for item in self.source.batches(self.stream.batch_size, stop_event):
            if self._error is not None:
                raise RuntimeError(f"producing the demo stream to {self.topic} failed: {self._error}")
            yield item

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.source.close()
        if self.broker is not None:
            self.broker.stop()
