"""The serving side of the many-hosts fleet tests: three `evstore serve`
replicas, each on a host of its own of a tests/hosts.py Network, serving one
object-store root, and a client host the test's requests come from.

    replicas = Replicas(net, export_url, root)       # hosts replica0..2 and client
    replicas.wait_version(seq)                       # every replica serves commit seq
    replicas.predict(replicas.hosts[0], inputs)      # outputs of a REST predict
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REST, GRPC = 8501, 8500
WAIT_S = 120   # a commit to be served on a loaded machine


class Replicas:
    """`n` replicas (tests/multihost/replica.py: the export from `export_url`, then `evstore serve` on
    port 8501 (REST) / 8500 (gRPC) of its host's address) polling `root`; returns once each listens."""

    def __init__(self, net, export_url, root, n=3, model="m"):
        self.net, self.model = net, model
        self.client = net.host("client")
        self.hosts, self.procs = [], []
        for i in range(n):
            h = net.host(f"replica{i}")
            self.hosts.append(h)
            self.procs.append(h.start([sys.executable, os.path.join(HERE, "replica.py"), export_url,
                                       "--checkpoints", root, "--host", h.address, "--port", GRPC,
                                       "--rest_api_port", REST, "--model_name", model, "--poll-every", "0.2"],
                                      name="serve"))
        for p in self.procs:
            p.wait_line(lambda ln: ln.startswith("grpc "))

    def rest(self, host, method, path, body=None):
        """(status, parsed JSON or text) of one request to `host`'s REST port, sent from the client host."""
        req = urllib.request.Request(f"http://{host.address}:{REST}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with self.client.inside():
            try:
                with opener.open(req, timeout=60) as r:
                    status, raw, ctype = r.status, r.read(), r.headers.get("content-type", "")
            except urllib.error.HTTPError as e:
                status, raw, ctype = e.code, e.read(), e.headers.get("content-type", "")
        return status, json.loads(raw) if ctype.startswith("application/json") else raw.decode()

    def version(self, host):
        status, body = self.rest(host, "GET", f"/v1/models/{self.model}")
        assert status == 200, body
        return int(body["model_version_status"][0]["version"])

    def wait_version(self, seq):
        """Returns once every replica serves version `seq`."""
        for h in self.hosts:
            deadline = time.monotonic() + WAIT_S
            while (v := self.version(h)) != seq:
                assert time.monotonic() < deadline, f"{h.name} still serves {v}, want {seq}"
                time.sleep(0.1)

    def predict(self, host, inputs):
        """The outputs (flat) of a columnar REST predict of `inputs` ({name: list}) on `host`."""
        status, out = self.rest(host, "POST", f"/v1/models/{self.model}:predict", {"inputs": inputs})
        assert status == 200, out
        return np.ravel(out["outputs"])

    def metrics(self, host):
        """{sample: value} of `host`'s /metrics (unlabelled samples)."""
        from prometheus_client.parser import text_string_to_metric_families

        _, text = self.rest(host, "GET", "/metrics")
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels}

    def stop(self):
        """SIGTERM each replica; returns their exit codes."""
        return [p.stop() for p in self.procs]
