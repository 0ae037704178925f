"""Sharded serving (docs/guides/sharded-serving.md): shards holding partitions of the
large EVs (serving_loader/shard_model.py, on grpcio: shard_service.py) and a
front (serving_loader/front.py) that answers TF Serving's APIs, fans each
request's lookups out to the shards and publishes every commit on all of
them at once. Specified against a single tiered replica of the same export.
(The fleet with each shard and the front on a host of its own, a shard killed
mid-publish: tests/multihost/test_sharded_hosts.py.)"""
import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest

import checkpoint
import evstore
import serving_loader
from serving_loader.front import FrontModel
from serving_loader.model import NothingToServeError
from serving_loader.shard_model import ShardModel
from serving_loader.shard_service import SERVICE, ShardServer

from ckpt_model import ev, make_model, train   # tests/checkpoint, registered by tests/conftest.py

DRAM_BYTES = 512   # the shards' tier: a few rows in DRAM, the rest on disk


def _probe():
    """Every key the job trains on and some it never saw."""
    users = np.arange(0, 600, dtype=np.int64).reshape(-1, 2)
    items = (np.arange(len(users), dtype=np.int32) % 60).reshape(-1, 1)
    return {"users": users, "items": items}


@pytest.fixture
def job(tmp_path):
    """A model whose "user" EV is trained as 2 shards (the route the serving shards use), its export of
    evstore tables, a full checkpoint and the single tiered replica the fleet is compared with."""
    model = make_model(user_shards=2)
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export, tables="evstore")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    single = serving_loader.ServingModel(export, mgr.root, storage=evstore.TieredStorage(DRAM_BYTES,
                                                                                         path=str(tmp_path / "t1")))
    yield model, export, mgr, single
    single.close()


class Fleet:
    """N in-process shards on 127.0.0.1 and their front."""

    def __init__(self, tmp_path, export, root, n, evs=("user",), disk_bytes=(None, None)):
        self.shards = [ShardModel(export, root, i, n, evs=list(evs),
                                  storage=evstore.TieredStorage(DRAM_BYTES, path=str(tmp_path / f"s{i}")),
                                  disk_bytes=disk_bytes[i])
                       for i in range(n)]
        self.servers = [ShardServer(s) for s in self.shards]
        self.front = FrontModel(export, root, [f"127.0.0.1:{s.port}" for s in self.servers], wait_s=10)

    def close(self):
        self.front.close()
        for srv, s in zip(self.servers, self.shards):
            srv.stop(0)
            s.close()


def _same(front, single, inputs=None):
    got, gv = front.predict(inputs or _probe())
    want, wv = single.predict(inputs or _probe())
    assert gv == wv
    np.testing.assert_array_equal(got["outputs"], want["outputs"])


@pytest.mark.parametrize("trained_shards", [2, None], ids=["trainer-route-matches", "unsharded-in-checkpoint"])
def test_a_fleet_answers_what_a_single_tiered_replica_answers_at_every_version_each_shard_reading_its_part(
        tmp_path, trained_shards):
    model = make_model(user_shards=trained_shards)
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export, tables="evstore")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    single = serving_loader.ServingModel(export, mgr.root, storage=evstore.TieredStorage(DRAM_BYTES,
                                                                                         path=str(tmp_path / "t1")))
    fleet = Fleet(tmp_path, export, mgr.root, 2)
    try:
        _same(fleet.front, single)
        rows = [s.rows()["user"] for s in fleet.shards]
        assert min(rows) > 0 and sum(rows) == single.rows()["user"]
        if trained_shards == 2:   # each shard streamed the full from its own part's files only
            assert all(s.bytes_read_last < single.last_fetched_bytes for s in fleet.shards)
        for step in (3, 5):
            train(model, step, step + 2)
            ev(model, "user").remove(np.arange(step, 40, 3, dtype=np.int64))   # deleted keys in the delta
            seq = mgr.save_delta()
            assert fleet.front.poll() == single.poll() == seq
            assert [s.version for s in fleet.shards] == [seq, seq]
            _same(fleet.front, single)
            if trained_shards == 2:   # each shard read its own part of the delta, not the other's
                assert all(s.bytes_read_last < single.last_fetched_bytes for s in fleet.shards)
                assert sum(s.bytes_read_last for s in fleet.shards) < 1.5 * single.last_fetched_bytes
        assert sum(s.rows()["user"] for s in fleet.shards) == single.rows()["user"]
    finally:
        fleet.close()
        single.close()


def test_a_predict_storm_while_deltas_land_never_mixes_versions(tmp_path, job):
    model, export, mgr, single = job
    fleet = Fleet(tmp_path, export, mgr.root, 2)
    expected = {single.version: single.predict(_probe())[0]["outputs"]}
    answers, stop = [], threading.Event()

    def storm():
        while not stop.is_set():
            answers.append(fleet.front.predict(_probe()))

    threads = [threading.Thread(target=storm) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for step in range(3, 11, 2):
            train(model, step, step + 2)
            ev(model, "user").remove(np.arange(step, 60, 4, dtype=np.int64))
            seq = mgr.save_delta()
            assert fleet.front.poll() == single.poll() == seq
            expected[seq] = single.predict(_probe())[0]["outputs"]
    finally:
        stop.set()
        for t in threads:
            t.join()
        fleet.close()
    seen = {v for _, v in answers}
    assert len(seen) >= 3, seen
    for out, version in answers:   # every answer is exactly the single replica's at the version it names
        np.testing.assert_array_equal(out["outputs"], expected[version])


def test_a_shard_that_cannot_stage_holds_the_fleet_and_gate_pin_rollback_act_on_the_fleet(tmp_path, job):
    model, export, mgr, single = job
    fleet = Fleet(tmp_path, export, mgr.root, 2)
    try:
        v1 = fleet.front.version
        at_v1 = single.predict(_probe())[0]["outputs"]
        train(model, 3, 5)
        seq = mgr.save_delta()
        victim = _data_file_of(mgr, seq, "user/part_1")   # shard 1 cannot read the commit: its part is damaged
        good = open(victim, "rb").read()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        open(victim, "wb").write(bytes(bad))
        assert fleet.front.poll() == v1
        assert "shard 1/2" in fleet.front.last_error and "corrupt" in fleet.front.last_error
        assert fleet.front.failures == 1
        assert [s.version for s in fleet.shards] == [v1, v1] and fleet.shards[0].pending_target == seq
        out, version = fleet.front.predict(_probe())
        assert version == v1
        np.testing.assert_array_equal(out["outputs"], at_v1)
        open(victim, "wb").write(good)   # repaired: the fleet moves on at its next poll (a shard's failure is retried)
        assert fleet.front.poll() == seq == single.poll()
        _same(fleet.front, single)
        # pin, rollback, resume: the whole fleet
        fleet.front.pin()
        train(model, 5, 7)
        newest = mgr.save_delta()
        assert fleet.front.poll() == seq
        assert fleet.front.rollback(v1) == v1
        assert [s.version for s in fleet.shards] == [v1, v1]
        _same_at(fleet.front, single, v1)
        assert fleet.front.resume() == newest == single.poll()
        assert [s.version for s in fleet.shards] == [newest, newest]
        _same(fleet.front, single)
    finally:
        fleet.close()


def _part_row_bytes(model):
    """Bytes of the rows of each part of the trainer's "user" EV (dim 8, float32): a shard's partition."""
    return [int(p.size()) * 4 * 8 for p in ev(model, "user").shards]


def test_a_shard_past_its_disk_budget_refuses_the_commit_by_name_and_the_fleet_holds_its_version(tmp_path, job):
    model, export, mgr, single = job
    room = 2 * 4 * 8   # two more rows than the full's partition
    fleet = Fleet(tmp_path, export, mgr.root, 2, disk_bytes=[b + room for b in _part_row_bytes(model)])
    try:
        v1 = fleet.front.version
        at_v1 = single.predict(_probe())[0]["outputs"]
        before = [ev(model, "user").shards[i].size() for i in range(2)]
        train(model, 3, 9)   # new users on both shards, more than two each
        assert all(ev(model, "user").shards[i].size() > before[i] + 2 for i in range(2))
        seq = mgr.save_delta()
        assert fleet.front.poll() == v1
        err = fleet.front.last_error
        assert f"commit {seq} needs" in err and "disk budget" in err and "--tier-disk-bytes" in err
        assert "shard 0/2" in err and "shard 1/2" in err
        assert [s.version for s in fleet.shards] == [v1, v1]
        out, version = fleet.front.predict(_probe())
        assert version == v1
        np.testing.assert_array_equal(out["outputs"], at_v1)
    finally:
        fleet.close()


def test_a_fleet_whose_partition_of_the_full_exceeds_a_shards_disk_budget_does_not_start(tmp_path, job):
    model, export, mgr, _ = job
    small = [b - 4 * 8 for b in _part_row_bytes(model)]   # one row short of each partition
    with pytest.raises(NothingToServeError, match=r"shard 0/2: commit 1 needs .* disk budget"):
        Fleet(tmp_path, export, mgr.root, 2, disk_bytes=small)


def m_dir(mgr, seq):
    return checkpoint.chain.scan(checkpoint.storage.Storage(mgr.root)).manifests[seq].dir


def _data_file_of(mgr, seq, ev_part):
    """The data file of the commit holding `ev_part`'s values."""
    from checkpoint.index import data_file, parse_index

    d = os.path.join(mgr.root, m_dir(mgr, seq))
    num, entries = parse_index(open(os.path.join(d, "ckpt.index"), "rb").read(), "index")
    e = entries[f"{ev_part}-values"]
    return os.path.join(d, data_file("ckpt", e.shard_id, num))


def _same_at(front, single, version):
    """front's answer equals the single replica's after it rolls back to `version`."""
    single.rollback(version, then="pin")
    _same(front, single)
    single.resume()


def test_the_shard_port_answers_hostile_bytes_with_clean_errors_and_keeps_serving(tmp_path, job):
    _, export, mgr, _ = job
    fleet = Fleet(tmp_path, export, mgr.root, 1)
    port = fleet.servers[0].port
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            lookup = ch.unary_unary(f"/{SERVICE}/Lookup")
            stage = ch.unary_unary(f"/{SERVICE}/Stage")
            for method, body, code in ((lookup, b"\xff\x00garbage", grpc.StatusCode.INVALID_ARGUMENT),
                                       (lookup, b"", grpc.StatusCode.INVALID_ARGUMENT),      # no version
                                       (stage, b"{not json", grpc.StatusCode.INVALID_ARGUMENT),
                                       (stage, b'{"target": -3}', grpc.StatusCode.INVALID_ARGUMENT),
                                       (stage, b'{"target": 99}', grpc.StatusCode.FAILED_PRECONDITION),
                                       (stage, b"x" * 10000, grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.RpcError) as e:
                    method(body, timeout=30)
                assert e.value.code() == code, (body[:20], e.value)
            from tensorflow_serving.apis import predict_pb2

            req = predict_pb2.PredictRequest()
            req.model_spec.version.value = fleet.front.version
            req.inputs["user"].dtype = 1                 # float keys for an int64 EV
            req.inputs["user"].tensor_shape.dim.add().size = 10 ** 12   # and a huge claimed size
            with pytest.raises(grpc.RpcError) as e:
                lookup(req.SerializeToString(), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            req.model_spec.version.value = 12345
            del req.inputs["user"]
            req.inputs["nope"].dtype = 9
            with pytest.raises(grpc.RpcError) as e:
                lookup(req.SerializeToString(), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in e.value.details()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:   # not HTTP/2 at all
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
            s.recv(4096)
        _oversized_and_flooded(fleet.shards[0], fleet.front.version)
        slow = socket.create_connection(("127.0.0.1", port), timeout=30)   # a client that never sends
        out, version = fleet.front.predict(_probe())   # still serving
        assert version == mgr.latest_seq() if hasattr(mgr, "latest_seq") else version is not None
        slow.close()
    finally:
        fleet.close()


def test_the_fronts_row_cache_is_emptied_at_a_poll_once_over_its_bound_and_answers_stay_exact(tmp_path, job):
    _, export, mgr, single = job
    fleet = Fleet(tmp_path, export, mgr.root, 2)
    try:
        fleet.front.max_cached_rows = 10
        _same(fleet.front, single)
        assert fleet.front.remote["user"].size() > 10
        fleet.front.poll()
        assert fleet.front.remote["user"].size() == 0
        _same(fleet.front, single)
    finally:
        fleet.close()


def _oversized_and_flooded(shard, version):
    """A second port on `shard` with small caps: a request over the size cap gets RESOURCE_EXHAUSTED, a
    flood of concurrent lookups gets answers or RESOURCE_EXHAUSTED, and the port answers afterwards."""
    from tensorflow_serving.apis import predict_pb2

    from serving_loader.tensor_proto import array_to_tensor

    server = ShardServer(shard, max_request_bytes=4096, max_concurrent=4, workers=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            lookup = ch.unary_unary(f"/{SERVICE}/Lookup")
            req = predict_pb2.PredictRequest()
            req.model_spec.version.value = version
            array_to_tensor(np.arange(10_000, dtype=np.int64), req.inputs["user"])
            with pytest.raises(grpc.RpcError) as e:
                lookup(req.SerializeToString(), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = predict_pb2.PredictRequest()
            small.model_spec.version.value = version
            array_to_tensor(np.arange(100, dtype=np.int64), small.inputs["user"])
            body = small.SerializeToString()
            calls = [lookup.future(body, timeout=60) for _ in range(200)]
            codes = set()
            for c in calls:
                try:
                    c.result()
                    codes.add(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.add(err.code())
            assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED} and grpc.StatusCode.OK in codes
            resp = predict_pb2.PredictResponse.FromString(lookup(body, timeout=30))
            assert resp.outputs["user"].tensor_shape.dim[0].size == 100
    finally:
        server.stop(0)


class _ShardProcess:
    """`evstore serve --shard i/n` in a process of its own on 127.0.0.1:`port` (SIGKILL-able)."""

    def __init__(self, export, root, i, n, port, tier):
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--checkpoints", root,
             "--shard", f"{i}/{n}", "--shard-evs", "user", "--port", str(port), "--tiered-dram-bytes",
             str(DRAM_BYTES), "--tier-path", tier], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if line.startswith("shard "):
                return
        raise AssertionError(f"shard {i}/{n} exited with {self.proc.wait()}")

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replica_killed_under_a_predict_storm_is_failed_over_and_rejoins_at_the_fleets_version(tmp_path, job):
    model, export, mgr, single = job
    (tmp_path / "victim").mkdir()
    port = _free_port()
    victim = _ShardProcess(export, mgr.root, 1, 2, port, str(tmp_path / "victim"))   # shard 1, replica 0
    others = [ShardModel(export, mgr.root, i, 2, evs=["user"],
                         storage=evstore.TieredStorage(DRAM_BYTES, path=str(tmp_path / f"r{i}")))
              for i in (0, 0, 1)]
    servers = [ShardServer(s) for s in others]
    a = [f"127.0.0.1:{s.port}" for s in servers]
    front = FrontModel(export, mgr.root, [[a[0], a[1]], [f"127.0.0.1:{port}", a[2]]], wait_s=60)
    rng = np.random.default_rng(3)
    answers, errors, stop = [], [], threading.Event()

    def storm():   # users never cached at the version: every request asks both shards
        while not stop.is_set():
            inputs = {"users": rng.integers(0, 1 << 40, size=(4, 2)), "items": np.zeros([4, 1], np.int32)}
            try:
                answers.append((inputs, *front.predict(inputs)))
            except Exception as e:  # noqa: BLE001 - any failed answer fails the test
                errors.append(e)

    threads = [threading.Thread(target=storm) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        v1 = front.version
        while len(answers) < 20:
            stop.wait(0.05)
        victim.kill()
        seqs = []
        for step in (3, 5):   # the fleet moves on with shard 1's other replica
            train(model, step, step + 2)
            seqs.append(mgr.save_delta())
            assert front.poll() == seqs[-1]
        n = len(answers)
        while len(answers) < n + 20:
            stop.wait(0.05)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        victim = _ShardProcess(export, mgr.root, 1, 2, port, str(tmp_path / "victim"))   # restarted, serving nothing
        deadline = time.monotonic() + 60
        while not all(front.fleet.usable.values()):   # at a poll once its channel reconnects: rejoins, used again
            assert time.monotonic() < deadline, front.last_error
            front.poll()
            stop.wait(0.2)
        assert [st["version"] for st, _ in front.fleet.status()] == [seqs[-1]] * 4
        assert all(front.fleet.usable.values())
        train(model, 7, 9)
        newest = mgr.save_delta()
        assert front.poll() == newest
        assert [st["version"] for st, _ in front.fleet.status()] == [newest] * 4
        got, version = front.predict(_probe())
        assert version == newest == single.poll()
        np.testing.assert_array_equal(got["outputs"], single.predict(_probe())[0]["outputs"])
    finally:
        stop.set()
        for t in threads:
            t.join()
        front.close()
        victim.kill()
        for srv, s in zip(servers, others):
            srv.stop(0)
            s.close()
    versions = sorted({v for _, _, v in answers})
    assert versions[0] == v1 and versions[-1] == seqs[-1], versions
    for v in versions:   # every answer equals the single replica's at the version it names
        single.rollback(v, then="pin")
        for inputs, out, version in answers:
            if version == v:
                np.testing.assert_array_equal(out["outputs"], single.predict(inputs)[0]["outputs"])


@pytest.fixture
def lone_shard(tmp_path, job):
    """Serves the whole "user" EV of `job`'s model from one shard: call it with ShardServer's keyword
    arguments (token=, tls=); returns (the shard, its address). Stopped and closed at teardown."""
    _, export, mgr, _ = job
    made = []

    def serve(**server_kw):
        shard = ShardModel(export, mgr.root, 0, 1, evs=["user"],
                           storage=evstore.TieredStorage(DRAM_BYTES, path=str(tmp_path / "s0")))
        made.append([shard, None])
        made[-1][1] = server = ShardServer(shard, **server_kw)
        return shard, f"127.0.0.1:{server.port}"

    yield serve
    for shard, server in made:
        if server is not None:
            server.stop(0)
        shard.close()


def _front_answers_as_single(job, address, **front_kw):
    """A front over the shard at `address` (FrontModel's keyword arguments) answers as the single replica."""
    _, export, mgr, single = job
    front = FrontModel(export, mgr.root, [address], wait_s=10, **front_kw)
    try:
        _same(front, single)
    finally:
        front.close()


def test_a_shard_with_a_token_answers_only_callers_that_send_it(job, lone_shard):
    _, export, mgr, _ = job
    token = "s3cret-fleet-token-0123456789"
    shard, address = lone_shard(token=token)
    with grpc.insecure_channel(address) as ch:
        for method, body in (("Status", b"{}"), ("Stage", b'{"target": 1}'), ("Lookup", b"")):
            for md in (None, (("authorization", "Bearer wrong-token-0123456789"),)):
                with pytest.raises(grpc.RpcError) as e:
                    ch.unary_unary(f"/{SERVICE}/{method}")(body, timeout=10, metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "--shard-token-file" in e.value.details()
    assert shard.version is None   # nothing staged by the refused calls
    with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
        FrontModel(export, mgr.root, [address], wait_s=0)
    _front_answers_as_single(job, address, token=token)


def _self_signed(tmp_path):
    """(key PEM, certificate PEM) for 127.0.0.1, made by openssl."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "shard.key", tmp_path / "shard.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=evstore-shard", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key.read_bytes(), cert.read_bytes()


def test_a_shard_over_tls_serves_a_front_that_trusts_its_certificate_and_no_plaintext_caller(tmp_path, job,
                                                                                              lone_shard):
    _, export, mgr, _ = job
    key, cert = _self_signed(tmp_path)
    _, address = lone_shard(tls=(key, cert))
    with grpc.insecure_channel(address) as ch:   # plaintext gets no answer
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(f"/{SERVICE}/Status")(b"{}", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    (tmp_path / "other").mkdir()
    _, other_cert = _self_signed(tmp_path / "other")
    with pytest.raises(ConnectionError, match="unavailable"):   # a certificate the front does not trust
        FrontModel(export, mgr.root, [address], wait_s=0, tls_ca=other_cert)
    _front_answers_as_single(job, address, tls_ca=cert)
