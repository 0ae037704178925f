"""Hold and roll back: a real `evstore serve` process pinned, rolled back to
earlier retained commits and resumed through its admin listener and
`evstore serve-admin`, checked against the trainer's predictions at each
commit; a rollback that cannot be staged changes nothing; the admin routes
are on their own listener (loopback, or behind a token), not on the REST port."""
import itertools
import os
import threading
import time

import numpy as np
import pytest

import checkpoint  # noqa: E402
import serving_loader  # noqa: E402
from ckpt_model import make_model, probe_inputs, train  # noqa: E402
from serve_proc import WAIT_S, Server, admin, evstore, last_line, metrics, predict_columns, wait_until  # noqa: E402
from serving_loader.model import RollbackError  # noqa: E402


def _probe():
    users, items = probe_inputs()
    return {"users": users, "items": items}


class Job:
    """A trainer committing to a root, with its probe predictions at every commit."""

    def __init__(self, tmp):
        self.model = make_model()
        train(self.model, 0, 2)
        self.export = str(tmp / "export")
        serving_loader.export_serving_model(self.model, self.export)
        self.mgr = checkpoint.CheckpointManager(str(tmp / "ckpt"), self.model, keep_chains=5)
        self.want = {}
        self.step = 2
        self._record(self.mgr.save_full())            # 1
        self.commit()                                  # 2
        self.commit()                                  # 3
        self.commit(full=True)                         # 4: a second chain
        self.commit()                                  # 5

    def _record(self, seq):
        users, items = probe_inputs()
        self.want[seq] = self.model.predict([users, items], verbose=0)
        return seq

    def commit(self, full=False):
        train(self.model, self.step, self.step + 1)
        self.step += 1
        return self._record(self.mgr.save_full() if full else self.mgr.save_delta())

    @property
    def newest(self):
        return max(self.want)

    def versions_matching(self, outputs):
        return [v for v, w in self.want.items() if np.allclose(np.asarray(outputs), w, rtol=1e-6, atol=1e-7)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    job = Job(tmp)
    seqs = sorted(job.want)
    for i, a in enumerate(seqs):   # every commit answers the probe differently: an answer names its version
        for b in seqs[i + 1:]:
            assert not np.allclose(job.want[a], job.want[b], rtol=1e-6, atol=1e-7), (a, b)
    server = Server(str(tmp), job.export, job.mgr.root, name="ctr")
    try:
        yield job, server
    finally:
        assert server.stop() == 0


def _serving(job, server, seq):
    assert server.version() == seq
    assert job.versions_matching(predict_columns(server, _probe())) == [seq]


def _at_newest(job, server):
    status, body = admin(server, "resume")
    assert status == 200 and body["version"] == job.newest and body["pinned"] is False, body


def test_rollback_serves_the_trainers_predictions_at_that_commit(served):
    job, server = served
    _at_newest(job, server)
    for seq in (2, 3, 1):      # into the older chain, forward in it, back to its full
        status, body = admin(server, "rollback", {"version": seq})
        assert status == 200, body
        assert body["version"] == seq and body["pinned"] is True and body["last_rollback"]["to"] == seq
        _serving(job, server, seq)


def test_pin_stops_applying_new_commits(served):
    job, server = served
    _at_newest(job, server)
    held = job.newest
    status, body = admin(server, "pin")
    assert status == 200 and body["pinned"] is True and body["version"] == held, body
    new = job.commit()
    wait_until(lambda: admin(server)[1]["newest_committed"] == new, f"the server to see commit {new}")
    _serving(job, server, held)


def test_resume_catches_up_to_the_newest_commit(served):
    job, server = served
    status, body = admin(server, "rollback", {"version": 2})
    assert status == 200 and body["pinned"] is True, body
    job.commit()
    status, body = admin(server, "resume")
    assert status == 200, body
    assert body["version"] == job.newest and body["pinned"] is False
    _serving(job, server, job.newest)
    new = job.commit()          # resumed: later commits are applied again
    wait_until(lambda: server.version() == new, f"commit {new} to be served")
    _serving(job, server, new)


def test_rollback_then_resume_serves_the_newest_commit_and_keeps_applying(served):
    job, server = served
    status, body = admin(server, "rollback", {"version": "3", "then": "resume"})   # a version as TF Serving writes it
    assert status == 200, body
    assert body["last_rollback"]["to"] == 3 and body["last_rollback"]["then"] == "resume"
    assert body["pinned"] is False and body["version"] == job.newest
    _serving(job, server, job.newest)


def test_each_answer_during_rollbacks_comes_from_exactly_one_committed_version(served):
    job, server = served
    _at_newest(job, server)
    stop, answers, errors = threading.Event(), [], []

    def storm():
        try:
            while not stop.is_set():
                answers.append(predict_columns(server, _probe()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=storm) for _ in range(2)]
    for t in threads:
        t.start()
    targets = [2, job.newest, 1, 3, job.newest - 1]
    deadline = time.time() + WAIT_S     # an upper bound, not a threshold: normally a few rounds
    try:
        for i in itertools.count():     # until the answers span several versions (the storm overlapped)
            seq = targets[i % len(targets)]
            status, body = admin(server, "rollback", {"version": seq})
            assert status == 200 and body["version"] == seq, body
            spanned = {tuple(job.versions_matching(a)) for a in list(answers)}
            if (i >= len(targets) and len(spanned) >= 3) or time.time() > deadline:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    seen = set()
    for a in answers:
        match = job.versions_matching(a)
        assert len(match) == 1, f"an answer matches the versions {match}, not exactly one"
        seen |= set(match)
    assert len(seen) >= 3 and seen <= set(targets) | {job.newest}


def test_rollback_to_a_commit_not_retained_is_404_and_changes_nothing(served):
    job, server = served
    _at_newest(job, server)
    status, body = admin(server, "rollback", {"version": 999})
    assert status == 404 and "not retained" in body["error"], body
    status, body = admin(server)
    assert body["pinned"] is False and body["version"] == job.newest
    _serving(job, server, job.newest)


@pytest.mark.parametrize("body", [{}, {"version": "two"}, {"version": 0}, {"version": True},
                                  {"version": 2, "then": "later"}, {"version": 2, "extra": 1}, [2]])
def test_a_bad_rollback_request_is_400_with_an_error_body(served, body):
    _, server = served
    status, answer = admin(server, "rollback", body)
    assert status == 400 and isinstance(answer["error"], str), answer


def test_rollback_and_pin_are_reported_in_metrics_and_the_admin_status(served):
    job, server = served
    before = metrics(server)["evstore_serving_rollbacks_total"]
    status, _ = admin(server, "rollback", {"version": 3})
    assert status == 200
    m = metrics(server)
    assert m["evstore_serving_rollbacks_total"] == before + 1
    assert m["evstore_serving_pinned"] == 1 and m["evstore_serving_last_rollback_sequence"] == 3
    assert m["evstore_serving_applied_sequence"] == 3
    assert m["evstore_serving_newest_committed_sequence"] == job.newest
    assert m["evstore_serving_rollback_failures_total"] == 0
    _, st = admin(server)
    assert st["last_rollback"]["to"] == 3 and st["last_rollback"]["then"] == "pin" and st["pinned"] is True
    assert set(job.want) <= set(st["retained"])
    _at_newest(job, server)
    assert metrics(server)["evstore_serving_pinned"] == 0


def test_serve_admin_cli_rolls_back_resumes_and_reports_a_refusal_in_one_line(served):
    job, server = served
    p = evstore("serve-admin", "--url", f"http://127.0.0.1:{server.admin_port}", "--model-name", "ctr", "rollback", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"version": 2' in p.stdout
    _serving(job, server, 2)
    p = evstore("serve-admin", "--url", f"http://127.0.0.1:{server.admin_port}", "--model-name", "ctr", "resume")
    assert p.returncode == 0 and f'"version": {job.newest}' in p.stdout, p.stderr[-2000:]
    p = evstore("serve-admin", "--url", f"http://127.0.0.1:{server.admin_port}", "--model-name", "ctr", "rollback", "999")
    assert p.returncode == 1
    assert last_line(p.stderr).startswith("evstore serve-admin: rollback refused (404): commit 999 is not retained")


# ---- in process --------------------------------------------------------------
def test_a_rollback_that_cannot_be_staged_keeps_the_served_version_and_the_pin(tmp_path):
    job = Job(tmp_path)
    sm = serving_loader.ServingModel(job.export, job.mgr.root)
    assert sm.version == job.newest
    d = os.path.join(job.mgr.root, "delta-0000000002")
    f = max((os.path.join(d, n) for n in os.listdir(d) if ".data-" in n), key=os.path.getsize)
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0x01
    open(f, "wb").write(bytes(b))
    with pytest.raises(RollbackError) as e:
        sm.rollback(3)                 # its chain runs through the corrupt delta 2
    assert e.value.status == 409 and os.path.basename(f) in e.value.message
    assert sm.version == job.newest and sm.pinned is False
    assert sm.rollback_failures == 1 and sm.rollbacks == 0
    users, items = probe_inputs()
    out, version = sm.predict({"users": users, "items": items})
    assert version == job.newest and job.versions_matching(out["outputs"]) == [job.newest]


def test_rollback_and_resume_without_a_checkpoint_root_are_refused(tmp_path):
    model = make_model()
    train(model, 0, 1)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    sm = serving_loader.ServingModel(export)          # the export as it is
    with pytest.raises(RollbackError) as e:
        sm.rollback(1)
    assert e.value.status == 409 and "no checkpoint root" in e.value.message
    assert sm.version is None and sm.rollback_failures == 0


# ---- the admin listener -------------------------------------------------------
def test_the_rest_port_does_not_answer_admin_routes(served):
    job, server = served
    _at_newest(job, server)
    for method, path in [("POST", "/v1/models/ctr/admin/pin"), ("POST", "/v1/models/ctr/admin/rollback"),
                         ("GET", "/v1/models/ctr/admin")]:
        status, body = server.call(method, path, {"version": 2} if method == "POST" else None)
        assert (status, body) == (400, {"error": f"Malformed request: {method} {path}"})
    status, body = admin(server)
    assert body["pinned"] is False and body["version"] == job.newest


def test_the_admin_listener_binds_loopback_and_serves_metrics(served):
    _, server = served
    assert _listening_address(server.admin_port) == "127.0.0.1"
    status, text = server.admin_call("GET", "/metrics")
    assert status == 200 and "evstore_serving_pinned" in text
    status, body = server.admin_call("POST", "/v1/models/ctr:predict", {"inputs": {}})
    assert status == 404 and "admin listener" in body["error"]


def _listening_address(port):
    """The IPv4 address a listening socket on `port` is bound to (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                return ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    raise AssertionError(f"nothing listens on port {port}")


def test_an_admin_listener_off_loopback_without_a_token_is_refused_at_start(tmp_path):
    p = evstore("serve", "--export", str(tmp_path), "--rest_api_port", "0", "--port", "-1",
                "--admin_host", "0.0.0.0")
    assert p.returncode == 1
    assert last_line(p.stderr).startswith("evstore serve: the admin listener on 0.0.0.0 (not loopback) needs a token")


def test_the_admin_token_is_required_when_given(served, tmp_path):
    job, _ = served
    token = tmp_path / "admin.token"
    token.write_text("s3cret-token-0123456789\n")
    server = Server(str(tmp_path), job.export, job.mgr.root, name="ctr", extra=["--admin_token_file", str(token)])
    try:
        path = "/v1/models/ctr/admin"
        assert server.admin_call("GET", path)[0] == 401
        assert server.admin_call("POST", f"{path}/pin", {}, {"Authorization": "Bearer s3cret-token-0123456788"})[0] == 401
        assert server.admin_call("GET", "/metrics")[0] == 401
        status, body = server.admin_call("GET", path, headers={"Authorization": "Bearer s3cret-token-0123456789"})
        assert status == 200 and body["pinned"] is False, body
        url = f"http://127.0.0.1:{server.admin_port}"
        p = evstore("serve-admin", "--url", url, "--model-name", "ctr", "pin")
        assert p.returncode == 1 and "(401)" in last_line(p.stderr)
        p = evstore("serve-admin", "--url", url, "--model-name", "ctr", "--token-file", str(token), "pin")
        assert p.returncode == 0 and '"pinned": true' in p.stdout, p.stderr[-2000:]
    finally:
        assert server.stop() == 0


def test_the_admin_port_is_8502_beside_the_default_rest_port_else_any_free_port():
    from serving_loader.admin_listener import default_port

    assert default_port(8501) == 8502 and default_port(None) == 8502
    assert default_port(0) == 0 and default_port(9000) == 0
