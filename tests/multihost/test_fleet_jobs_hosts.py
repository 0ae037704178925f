"""The serving fleet on many hosts, with each of the jobs that train on more
than one host: moto's S3 server on host `s3`; the trainer, either a
parameter-server job (its chief, tests/multihost/fleet_ps_chief.py, 2 PS and
2 workers: tests/host_cluster.py) or a synchronous job of 2 workers
(tests/multihost/fleet_sync_worker.py); three `evstore serve` replicas
(tests/multihost/fleet_hosts.py); the test's requests from host `client`.
Each process is on a host of its own; the hosts share the network and the
object store, nothing else: each task uploads its own part of each commit,
the export reaches each replica's host through the store. One fleet per job
kind serves the module's tests, in order."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hosts
from fleet_hosts import Replicas
from host_cluster import PORT, HostCluster

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, DELTA_EVERY, FULL_EVERY = 20, 4, 12   # commits at 4 (full), 8, 12 (full), 16, 20


class JobFleet:
    """The trainer (`kind` "ps" or "sync") and the replicas; `speakers` are the trainer processes
    that print the line protocol (fleet_ctr.py) and wait for the test after each commit."""

    def __init__(self, net, kind):
        self.net = net
        self.store = net.object_store()
        self.root, export_url = self.store.root("fleet"), self.store.root("export")
        args = ["--root", self.root, "--export-url", export_url, "--steps", STEPS, "--delta-every", DELTA_EVERY,
                "--full-every", FULL_EVERY]
        self.cluster = None
        if kind == "ps":
            self.cluster = HostCluster(net, num_ps=2, num_workers=2)
            self.speakers = [self.cluster.chief.start(
                [sys.executable, os.path.join(HERE, "fleet_ps_chief.py"), "--cluster", self.cluster.cluster_file,
                 *args], name="chief", stdin=subprocess.PIPE)]
        else:
            ws = [net.host(f"worker{r}") for r in range(2)]
            addresses = ",".join(f"{h.address}:{PORT}" for h in ws)
            self.speakers = [h.start([sys.executable, os.path.join(HERE, "fleet_sync_worker.py"), "--rank", r,
                                      "--workers", addresses, *args], name=f"worker{r}", stdin=subprocess.PIPE)
                             for r, h in enumerate(ws)]
        line = self.speakers[0].wait_line(lambda ln: ln.startswith("PROBE "))
        self.inputs = json.loads(line[len("PROBE "):])
        self.probes = {}
        self.read = [0] * len(self.speakers)
        self.next_commit()
        self.replicas = Replicas(net, export_url, self.root)

    def next_commit(self):
        """The seq of the trainer's next commit (its prediction into `probes`), None when it is done;
        every speaker must report the same."""
        got = set()
        for i, p in enumerate(self.speakers):
            line = p.wait_line(lambda ln: ln.startswith(("COMMIT ", "DONE")), start=self.read[i])
            self.read[i] = p.lines.index(line, self.read[i]) + 1
            got.add(line)
        assert len(got) == 1, got   # sync: both workers predict the same from the same commit
        line = got.pop()
        if line == "DONE":
            return None
        _, seq, probe = line.split(" ", 2)
        self.probes[int(seq)] = np.array(json.loads(probe))
        return int(seq)

    def go_on(self):
        for p in self.speakers:
            p.popen.stdin.write("\n")
            p.popen.stdin.flush()

    def stop_trainer(self):
        codes = []
        for p in self.speakers:
            p.popen.stdin.close()
        for p in self.speakers:
            codes.append(p.wait(timeout=120))
        if self.cluster is not None:
            self.cluster.close()
        return codes


@pytest.fixture(scope="module", params=["ps", "sync"])
def fleet(request, tmp_path_factory):
    with hosts.network_or_skip(tmp_path_factory.mktemp(f"fleet-{request.param}")) as net:
        yield JobFleet(net, request.param)


def test_each_replica_converges_to_each_commit_of_the_job_and_answers_from_it(fleet):
    seq = max(fleet.probes)
    seqs = []
    while seq is not None:
        seqs.append(seq)
        fleet.replicas.wait_version(seq)
        for h in fleet.replicas.hosts:
            np.testing.assert_allclose(fleet.replicas.predict(h, fleet.inputs), fleet.probes[seq], rtol=1e-5,
                                       atol=1e-6, err_msg=f"{h.name} at version {seq}")
        fleet.go_on()
        seq = fleet.next_commit()
    assert len(seqs) == STEPS // DELTA_EVERY and seqs == sorted(set(seqs))


def test_replicas_fetch_every_commit_from_the_object_store_and_no_host_keeps_a_checkpoint_file(fleet):
    keys = fleet.store.keys("fleet/")
    kinds = {int(k.split("/")[1].split("-")[1]): k.split("/")[1].split("-")[0]
             for k in keys if k.endswith("/MANIFEST.json")}
    assert sorted(kinds) == sorted(fleet.probes), keys
    assert list(kinds.values()).count("full") == 2, kinds
    for h in fleet.replicas.hosts:
        m = fleet.replicas.metrics(h)
        assert m["evstore_serving_fetched_bytes_total"] > 0, h.name
        assert m["evstore_serving_applied_sequence"] == max(fleet.probes), h.name
    assert fleet.replicas.stop() == [0, 0, 0]
    assert fleet.stop_trainer() == [0] * len(fleet.speakers), [open(p.log_path).read()[-3000:] for p in fleet.speakers]
    fleet.net.assert_no_checkpoint_files()
