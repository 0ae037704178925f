"""A sharded serving fleet with every process on a host of its own (tests/hosts.py):
moto's S3 server on host `s3` (the one root), the trainer
(tests/multihost/fleet_trainer.py, its "user" EV trained as 2 shards, an
export of evstore tables) on `trainer`, `evstore serve --shard i/2` on `shard0`
and `shard1`, the front (`evstore serve --shards`) on `front`, the test's
requests from `client`. The export and every commit reach the hosts through
the store (tests/multihost/replica.py)."""
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

import hosts

HERE = os.path.dirname(os.path.abspath(__file__))
REST, GRPC, ADMIN, SHARD = 8501, 8500, 8502, 8600


class ShardedFleet:
    def __init__(self, net):
        self.net = net
        self.store = net.object_store()
        self.root = self.store.root("fleet")
        self.export_url = self.store.root("export")
        self.client = net.host("client")
        self.trainer = net.host("trainer").start(
            [sys.executable, f"{HERE}/fleet_trainer.py", "--root", self.root, "--export-url", self.export_url,
             "--user-shards", "2", "--tables", "evstore"], name="trainer", stdin=subprocess.PIPE)
        self.probes = {}
        self.read_commit()
        self.shard_hosts = [net.host(f"shard{i}") for i in range(2)]
        self.shards = [self.start_shard(i) for i in range(2)]
        self.front_host = net.host("front")
        self.front = self.front_host.start(
            [sys.executable, f"{HERE}/replica.py", self.export_url, "--checkpoints", self.root,
             "--shards", ",".join(f"{h.address}:{SHARD}" for h in self.shard_hosts),
             "--host", self.front_host.address, "--port", str(GRPC), "--rest_api_port", str(REST),
             "--admin_port", str(ADMIN), "--model_name", "ctr", "--poll-every", "0.2"], name="front")
        for p in self.shards:
            p.wait_line(lambda ln: ln.startswith("shard "))
        self.front.wait_line(lambda ln: ln.startswith("grpc "))

    def start_shard(self, i):
        h = self.shard_hosts[i]
        return h.start([sys.executable, f"{HERE}/replica.py", self.export_url, "--checkpoints", self.root,
                        "--shard", f"{i}/2", "--shard-evs", "user", "--host", h.address, "--port", str(SHARD),
                        "--tiered-dram-bytes", "512"], name=f"shard{i}-{time.monotonic_ns()}")

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

    def rest(self, method, path, body=None, admin=False):
        """(status, parsed JSON) of one request: from the client host, or the admin listener on the front's."""
        data = json.dumps(body).encode() if body is not None else None
        host = self.front_host if admin else self.client
        url = f"http://{'127.0.0.1' if admin else self.front_host.address}:{ADMIN if admin else REST}{path}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with host.inside():
            try:
                with opener.open(urllib.request.Request(url, data=data, method=method), timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

    def version(self):
        status, body = self.rest("GET", "/v1/models/ctr")
        assert status == 200, body
        return int(body["model_version_status"][0]["version"])

    def wait_version(self, seq, timeout=120):
        deadline = time.monotonic() + timeout
        while (v := self.version()) != seq:
            assert time.monotonic() < deadline, f"the front still serves {v}, want {seq}"
            time.sleep(0.1)

    def call(self, *args):
        """shard_call.py ARGS on the client host: its stdout lines as JSON."""
        p = self.client.start([sys.executable, f"{HERE}/shard_call.py", *map(str, args)],
                              name=f"call-{time.monotonic_ns()}")
        assert p.wait(timeout=120) == 0, open(p.log_path).read()[-3000:]
        return [json.loads(ln) for ln in p.lines]

    def predict_rest(self, offset=0):
        """The probe's predict over REST (its users + `offset`)."""
        from ckpt_model import probe_inputs

        users, items = probe_inputs()
        return self.rest("POST", "/v1/models/ctr:predict",
                         {"inputs": {"users": (users + offset).tolist(), "items": items.tolist()}})


def test_a_sharded_fleet_on_hosts_of_its_own_serves_each_commit_whole_and_survives_a_shard_killed_mid_publish(
        tmp_path):
    with hosts.network_or_skip(tmp_path) as net:
        f = ShardedFleet(net)
        front = f"{f.front_host.address}:{GRPC}"
        # each commit, a delta and a full among them, is served by the whole fleet, answers as trained
        seqs = [max(f.probes)]
        for kind in (None, "delta", "full"):
            if kind is not None:
                seqs.append(f.commit(kind))
            f.wait_version(seqs[-1])
            status, out = f.predict_rest()
            assert status == 200, out
            np.testing.assert_allclose(np.ravel(out["outputs"]), f.probes[seqs[-1]], rtol=1e-5, atol=1e-6)
            assert f.version() == seqs[-1]
        v = seqs[-1]
        # the next commit is staged on both shards, then shard 1 is killed before the fleet publishes it
        assert f.rest("POST", "/v1/models/ctr/admin/pin", admin=True)[0] == 200
        seq = f.commit("delta")
        staged = f.call("stage", seq, v, *(f"{h.address}:{SHARD}" for h in f.shard_hosts))
        assert [s["staged"] for s in staged] == [seq, seq] and [s["version"] for s in staged] == [v, v]
        f.shards[1].kill()
        assert f.rest("POST", "/v1/models/ctr/admin/resume", admin=True)[0] in (200, 409)
        # requests needing rows the front does not hold for v yet fail, naming the shard; the probe's rows
        # were brought for v before the kill: the probe is still answered, at v
        status, body = f.predict_rest(offset=1000)
        assert status == 503 and "shard 1/2" in body["error"], body
        (got,) = f.call("predict", front, 2000)
        assert got["code"] == "UNAVAILABLE" and "shard 1/2" in got["details"], got
        status, out = f.predict_rest()
        assert status == 200, out
        np.testing.assert_allclose(np.ravel(out["outputs"]), f.probes[v], rtol=1e-5, atol=1e-6)
        assert f.version() == v   # the front polls every 0.2 s: the fleet holds v while shard 1 is down
        # back on its host: it rejoins at the fleet's version, then the fleet publishes the new commit
        f.shards[1] = f.start_shard(1)
        f.shards[1].wait_line(lambda ln: ln.startswith("shard "))
        f.wait_version(seq)
        status, out = f.predict_rest()
        assert status == 200, out
        np.testing.assert_allclose(np.ravel(out["outputs"]), f.probes[seq], rtol=1e-5, atol=1e-6)
        f.trainer.popen.stdin.write("quit\n")
        f.trainer.popen.stdin.flush()
        assert f.trainer.wait(timeout=120) == 0
        for p in [f.front] + f.shards:
            assert p.stop() == 0, open(p.log_path).read()[-3000:]
        # The trainer's saves wrote nothing on its disk, nor did a shard loading a new full: it streams
        # its partition from the bucket into its tables (checkpoint/object_source.py).
        net.assert_no_checkpoint_files()
