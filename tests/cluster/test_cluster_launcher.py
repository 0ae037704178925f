"""The cluster launcher: `evstore_app.cluster` (load_cluster, start_server,
LocalCluster) and `evstore server`, with real PS / worker processes, and what
TF's ClusterCoordinator does when a task dies (docs/guides/parameter-server.md, "When a task dies")."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from cluster_harness import ROOT, run_chief
from evstore_app import cluster
from evstore_app.cluster import LocalCluster

CHIEF = "cluster_chief_ev.py"


def expected_freqs(keys, steps):
    c = Counter(k for i in range(steps) for k in (i % 5, 100 + i % 3, 7))
    return [c[k] for k in keys]


def _bounded(proc, seconds=120):
    """Kills proc's process group after `seconds` (so a blocking read of its output ends); cancel() it."""
    t = threading.Timer(seconds, lambda: _killpg(proc.pid))
    t.daemon = True
    t.start()
    return t


def _killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_chief_trains_an_ev_on_a_ps_from_scheduled_functions(tmp_path):
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--scenario", "train", "--steps", 40])
    assert r["counter"] == 40
    assert r["freqs"] == expected_freqs(r["keys"], 40)
    assert r["exported_keys"] == r["keys"]


def test_an_ev_built_under_ps_strategy_without_a_device_scope_trains_exactly(tmp_path):
    """evstore/distribute.py lets ParameterServerStrategy scopes build the table asked
    for: with no tf.device it lives on the coordinator and every scheduled step reaches it."""
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--scenario", "train", "--steps", 40,
                                  "--placement", "none"])
    assert "/job:chief" in r["ev_device"]
    assert r["counter"] == 40
    freqs = expected_freqs(r["keys"], 40)
    assert r["freqs"] == freqs
    # zeros initializer, loss = sum of the rows, SGD(0.1): each occurrence subtracts 0.1 from every element
    for row, f in zip(r["rows"], freqs):
        assert max(abs(x + 0.1 * f) for x in row) < 1e-4


def test_local_cluster_spec_file_and_close_leave_no_process(tmp_path):
    lc = LocalCluster(num_ps=1, num_workers=1, directory=str(tmp_path))
    try:
        assert sorted(lc.spec) == ["chief", "ps", "worker"]
        assert [len(lc.spec[j]) for j in ("chief", "ps", "worker")] == [1, 1, 1]
        with open(lc.cluster_file) as f:
            assert json.load(f) == lc.spec
        assert cluster.load_cluster(lc.cluster_file) == lc.spec
        pids = [lc.process(j, 0).pid for j in ("ps", "worker")]
        assert all(_alive(p) for p in pids)
        assert "evstore server: ready job=ps task=0" in open(lc.log_path("ps", 0)).read()
        resolver = lc.resolver()
        assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")
    finally:
        lc.close()
    assert not any(_alive(p) for p in pids)
    assert lc.alive() == []
    lc.close()  # idempotent


def test_local_cluster_tasks_exit_when_their_owner_is_killed(tmp_path):
    # The owner dies by SIGKILL: no close(), no atexit. Its tasks notice and exit.
    code = ("import sys, time; from evstore_app.cluster import LocalCluster; "
            f"lc = LocalCluster(num_ps=1, num_workers=1, directory={str(tmp_path)!r}); "
            "print(*[p.pid for p in lc._procs.values()], flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    timer = _bounded(owner)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
        assert "(parent " in open(tmp_path / "ps-0.log").read()
    finally:
        timer.cancel()
        _killpg(owner.pid)
        owner.wait()
        for p in pids:
            _killpg(p)


def test_evstore_server_takes_cluster_and_task_from_tf_config(tmp_path):
    port = cluster._free_ports(1)[0]
    tf_config = {"cluster": {"ps": [f"127.0.0.1:{port}"]}, "task": {"type": "ps", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-m", "evstore_app", "server"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    timer = _bounded(proc)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("evstore server: ready job=ps task=0 "), ready + proc.stderr.read()
        assert f"address=127.0.0.1:{port}" in ready
        assert cluster._accepts(f"127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        timer.cancel()
        if proc.poll() is None:
            _killpg(proc.pid)
            proc.wait()


def test_evstore_server_rejects_a_task_out_of_range_before_serving(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}))
    r = subprocess.run([sys.executable, "-m", "evstore_app", "server", "--job", "ps", "--task", "3",
                        "--cluster", str(path)], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "task 3 is out of range for job 'ps', which has 1 task(s)" in r.stderr


def test_load_cluster_names_the_missing_or_malformed_file(tmp_path):
    with pytest.raises(ValueError, match="cluster file .*nope.json.* does not exist"):
        cluster.load_cluster(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ps: 1")
    with pytest.raises(ValueError, match="bad.json.* is not valid JSON"):
        cluster.load_cluster(str(bad))
    bad.write_text(json.dumps({"ps": ["localhost"]}))
    with pytest.raises(ValueError, match="job 'ps' task 0: address 'localhost' is not 'host:port'"):
        cluster.load_cluster(str(bad))
    bad.write_text(json.dumps({"ps": []}))
    with pytest.raises(ValueError, match="job 'ps' must list at least one"):
        cluster.load_cluster(str(bad))
    with pytest.raises(TypeError, match="cluster must be a file path, a dict or None"):
        cluster.load_cluster(42)


def test_load_cluster_reads_tf_config_and_names_its_missing_fields(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG environment variable is not set"):
        cluster.load_cluster()
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        cluster.load_cluster()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "ps", "index": 0}}))
    with pytest.raises(ValueError, match="TF_CONFIG has no 'cluster' field"):
        cluster.load_cluster()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["h:1"], "worker": ["h:2", "h:3"]}}))
    assert cluster.load_cluster() == {"ps": ["h:1"], "worker": ["h:2", "h:3"]}


def test_start_server_rejects_an_unknown_job_or_task_out_of_range():
    spec = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    with pytest.raises(ValueError, match=r"job 'evaluator' is not in the cluster \(jobs: \['ps', 'worker'\]\)"):
        cluster.start_server("evaluator", 0, spec)
    with pytest.raises(ValueError, match="task 2 is out of range for job 'worker', which has 2 task"):
        cluster.start_server("worker", 2, spec)
    with pytest.raises(ValueError, match="task -1 is out of range"):
        cluster.start_server("ps", -1, spec)


def test_local_cluster_reports_a_server_that_cannot_start(tmp_path):
    # An interpreter that exits at once stands for a task that dies before serving.
    with pytest.raises(RuntimeError, match="ps task 0 exited with code 3 before serving; log tail"):
        LocalCluster(num_ps=1, num_workers=1, directory=str(tmp_path), python=_exiting_python(tmp_path))
    with pytest.raises(ValueError, match="num_ps must be an int >= 1"):
        LocalCluster(num_ps=0)


def _exiting_python(tmp_path):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'no server here' >&2\nexit 3\n")
    script.chmod(0o755)
    return str(script)


# --- failure handling (TF 2.21's ClusterCoordinator; README: Distributed training) ---


def test_killed_worker_the_remaining_worker_finishes_every_scheduled_step(tmp_path):
    actions = []
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--scenario", "kill-worker", "--steps", 200],
                      actions=actions)
        assert ("worker", 1) not in lc.alive()
    assert actions == [("kill", "worker", 1)]
    assert r["counter_at_kill"] < 100  # killed while the first half was still running
    assert r["fetched"] == 100  # every function scheduled after the kill returned a value
    # At least once, not atomically: the function the killed worker was running is re-run on
    # the other worker, and whichever of its PS updates (the counter, the lookup's frequency
    # counts, the apply) had landed before the kill land twice; each at most once extra.
    assert r["counter"] in (200, 201)
    freqs = dict(zip(r["keys"], r["freqs"]))
    expected = dict(zip(r["keys"], expected_freqs(r["keys"], 200)))
    assert freqs[7] - expected[7] in (0, 1)  # key 7 is in every step
    assert sum(freqs.values()) - sum(expected.values()) in (0, 3)


def test_killed_ps_makes_join_raise_unavailable_error(tmp_path):
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--scenario", "kill-ps", "--steps", 2000])
    assert r["join_error"] == "UnavailableError" and r["join_error_is_unavailable"]
    # The functions still pending were cancelled: their fetch raises CancelledError.
    assert r["fetch_errors"] == ["CancelledError"]


def test_restarted_worker_is_picked_up_again_by_the_coordinator(tmp_path):
    actions = []
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--scenario", "restart-worker", "--steps", 80],
                      actions=actions)
    assert actions == [("kill", "worker", 1), ("restart", "worker", 1), ("kill", "worker", 0)]
    # The last 40 steps ran after worker 0 died: only the restarted worker 1 could run them.
    assert r["scheduled"] == 120
    assert 120 <= r["counter"] <= 122
