"""The serving fleet with every process on a host of its own (tests/hosts.py):
moto's S3 server on host `s3`, the trainer (tests/multihost/fleet_trainer.py)
on host `trainer`, three `evstore serve` replicas on hosts `replica0..2`, the
test's requests from host `client`. The hosts share the network and the
object store, nothing else: the export reaches each replica's host through
the store (tests/multihost/replica.py), every commit too. One fleet serves
the module's tests, in order."""
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import hosts

HERE = os.path.dirname(os.path.abspath(__file__))
REPLICAS = 3
REST, GRPC, ADMIN = 8501, 8500, 8502


class Fleet:
    def __init__(self, net):
        self.net = net
        self.store = net.object_store()
        self.root = self.store.root("fleet")
        self.export_url = self.store.root("export")
        self.client = net.host("client")
        self.trainer_host = net.host("trainer")
        self.trainer = self.trainer_host.start(
            [sys.executable, f"{HERE}/fleet_trainer.py", "--root", self.root, "--export-url", self.export_url],
            name="trainer", stdin=subprocess.PIPE)
        self.probes = {}
        self.read_commit()
        self.replicas = []
        for i in range(REPLICAS):
            h = net.host(f"replica{i}")
            p = h.start([sys.executable, f"{HERE}/replica.py", self.export_url, "--checkpoints", self.root,
                         "--host", h.address, "--port", GRPC, "--rest_api_port", REST, "--admin_port", ADMIN,
                         "--model_name", "ctr", "--poll-every", "0.2"], name="serve")
            self.replicas.append((h, p))
        for h, p in self.replicas:
            p.wait_line(lambda ln: ln.startswith("grpc "))

    def read_commit(self, start=0):
        line = self.trainer.wait_line(lambda ln: ln.startswith("COMMIT "), start=start)
        _, seq, probe = line.split(" ", 2)
        self.probes[int(seq)] = np.array(json.loads(probe))
        return int(seq)

    def commit(self, kind):
        n = len(self.trainer.lines)
        self.trainer.popen.stdin.write(kind + "\n")
        self.trainer.popen.stdin.flush()
        return self.read_commit(start=n)

    def rest(self, host, method, path, body=None, port=REST):
        """(status, parsed JSON or text) of one request from the client host (admin: on the replica's own)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{host.address if port != ADMIN else '127.0.0.1'}:{port}{path}",
                                     data=data, method=method)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with (self.client if port != ADMIN else host).inside():
            with opener.open(req, timeout=60) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if r.headers.get("content-type", "").startswith(
                    "application/json") else raw.decode())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with hosts.network_or_skip(tmp_path_factory.mktemp("fleet")) as net:
        f = Fleet(net)
        yield f


def _version(fleet, host):
    status, body = fleet.rest(host, "GET", "/v1/models/ctr")
    assert status == 200, body
    return int(body["model_version_status"][0]["version"])


def _wait_version(fleet, host, seq, timeout=120):
    deadline = time.monotonic() + timeout
    while (v := _version(fleet, host)) != seq:
        assert time.monotonic() < deadline, f"{host.name} still serves {v}, want {seq}"
        time.sleep(0.1)


def _predict(fleet, host):
    from ckpt_model import probe_inputs

    users, items = probe_inputs()
    status, out = fleet.rest(host, "POST", "/v1/models/ctr:predict",
                             {"inputs": {"users": users.tolist(), "items": items.tolist()}})
    assert status == 200, out
    return np.ravel(out["outputs"])


def test_each_replica_on_its_own_host_converges_to_each_commit_and_answers_from_it(fleet):
    seqs = [max(fleet.probes)]
    for kind in (None, "delta", "delta", "full", "delta"):
        if kind is not None:
            seqs.append(fleet.commit(kind))
        for h, _ in fleet.replicas:
            _wait_version(fleet, h, seqs[-1])
            np.testing.assert_allclose(_predict(fleet, h), fleet.probes[seqs[-1]], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{h.name} at version {seqs[-1]}")
    assert seqs == sorted(set(seqs))


def test_replicas_fetch_every_commit_from_the_object_store_and_no_host_keeps_a_checkpoint_file(fleet):
    from prometheus_client.parser import text_string_to_metric_families

    keys = fleet.store.keys("fleet/")
    committed = sorted(int(k.split("/")[1].split("-")[1]) for k in keys if k.endswith("/MANIFEST.json"))
    assert committed == sorted(fleet.probes), keys
    for h, _ in fleet.replicas:
        _, text = fleet.rest(h, "GET", "/metrics")
        samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if not s.labels}
        assert samples["evstore_serving_fetched_bytes_total"] > 0, h.name
        assert samples["evstore_serving_applied_sequence"] == max(fleet.probes), h.name
    for _, p in fleet.replicas:
        assert p.stop() == 0, open(p.log_path).read()[-3000:]
    fleet.trainer.popen.stdin.write("quit\n")
    fleet.trainer.popen.stdin.flush()
    assert fleet.trainer.wait(timeout=120) == 0, open(fleet.trainer.log_path).read()[-3000:]
    fleet.net.assert_no_checkpoint_files()
