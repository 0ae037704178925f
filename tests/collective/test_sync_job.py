"""`evstore train-sync`: the CTR job trained synchronously by 2 local worker
processes (evstore_app.job.sync_train) equals the one-process job, through a
worker killed mid-run (the launcher restarts every worker from the last
commit) and through a whole-job stop and rerun."""
import functools
import json
import re
import os
import subprocess
import sys

import numpy as np

import sync_harness as h

STEPS, BATCH, DELTA = 12, 64, 4


@functools.lru_cache(maxsize=None)
def reference():
    from evstore_app.job.cluster_train import ClusterJob
    job = ClusterJob(local=True, batch_size=BATCH)
    job.train(STEPS)
    return job.model.state()


def train_sync(tmp, run, extra_env=None, max_restarts=3):
    """Runs the CLI; returns (exit code, stdout, stderr)."""
    env = dict(h.env(), **(extra_env or {}))
    argv = [sys.executable, "-m", "evstore_app", "train-sync", "--workers", "2", "--checkpoints", str(tmp / "ckpt"),
            "--steps", str(STEPS), "--batch-size", str(BATCH), "--delta-every-steps", str(DELTA),
            "--max-restarts", str(max_restarts), "--directory", str(tmp / run), "--state-out", str(tmp / "state")]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)
    return p.returncode, p.stdout, p.stderr


def assert_equals_reference(tmp):
    from evstore_app.job.sync_train import merge_states
    got = merge_states([dict(np.load(tmp / "state" / f"state-{r}.npz")) for r in range(2)])
    want = reference()
    assert sorted(got) == sorted(want)
    for k in want:
        if want[k].dtype.kind == "f":
            np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)   # keys, versions, frequencies exactly


def test_a_killed_worker_stops_the_step_and_the_job_restarts_from_the_last_commit_with_nothing_lost(tmp_path):
    code, out, err = train_sync(tmp_path, "run", {"EVSTORE_SYNC_KILL_AT": "1:7"})   # worker 1 SIGKILLs itself
    assert code == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["restarts"] == 1 and res["resumed_at"] == 4      # the commit at batch 4
    assert res["position"] == res["global_step"] == STEPS
    assert "worker 1 exited with code -9; stopping every worker" in err
    # the survivor's next collective failed: it stopped by itself, saying why
    # (the launcher sees that exit at its next poll, or at the same poll as worker 1's on a loaded machine)
    assert re.search(r"worker 0 (stopped by itself|exited) with code 75", err), err[-3000:]
    assert "another worker is gone and the collective runtime cannot continue" in open(tmp_path / "run" / "worker-0.log").read()
    assert_equals_reference(tmp_path)


def test_a_stopped_job_resumes_from_its_last_commit_when_run_again(tmp_path):
    code, out, err = train_sync(tmp_path, "run1", {"EVSTORE_SYNC_KILL_AT": "0:6"}, max_restarts=0)
    assert code == 1 and "run the job again to resume from its last commit" in err, err[-3000:]
    assert not list((tmp_path / "state").glob("*.npz"))     # no worker finished
    code, out, err = train_sync(tmp_path, "run2")
    assert code == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["restarts"] == 0 and res["resumed_at"] == 4 and res["global_step"] == STEPS
    assert_equals_reference(tmp_path)


def _qualities(root):
    """{position: quality record} of every commit under `root`."""
    out = {}
    for path in sorted(root.glob("*/MANIFEST.json")):
        m = json.loads(path.read_text())
        out[m["metadata"]["position"]] = m.get("quality")
    return out


def test_each_commit_carries_the_quality_of_every_workers_examples_as_one_process_measures_it(tmp_path):
    code, out, err = train_sync(tmp_path, "run")
    assert code == 0, err[-3000:]
    from evstore_app.job.cluster_train import ClusterJob
    one = ClusterJob(local=True, batch_size=BATCH, checkpoints=str(tmp_path / "one"), delta_every=DELTA)
    one.train(STEPS)
    got, want = _qualities(tmp_path / "ckpt"), _qualities(tmp_path / "one")
    assert sorted(got) == sorted(want) == list(range(DELTA, STEPS + 1, DELTA))
    for pos, q in got.items():
        assert q["examples"] == want[pos]["examples"] == DELTA * BATCH   # both workers' halves of each batch
        assert q["label_rate"] == want[pos]["label_rate"]
        assert abs(q["logloss"] - want[pos]["logloss"]) < 1e-5, pos
        assert abs(q["auc"] - want[pos]["auc"]) < 1e-3, pos             # scores equal to 1e-5: near-ties may swap


def test_a_job_whose_root_lease_another_writer_holds_commits_nothing_and_says_why(tmp_path):
    import checkpoint
    from checkpoint.lease import Lease
    (tmp_path / "ckpt").mkdir()
    holder = Lease(checkpoint.Storage(str(tmp_path / "ckpt")), timeout=600)    # a live writer of this host
    holder.acquire()
    try:
        code, out, err = train_sync(tmp_path, "run", max_restarts=0)
    finally:
        holder.release()
    assert code == 1, err[-3000:]
    logs = [(tmp_path / "run" / f"worker-{r}.log").read_text() for r in range(2)]
    assert "LeaseHeldError" in logs[0] and f"pid {os.getpid()}" in logs[0]            # the chief: the holder
    assert "the chief (worker 0) does not hold the root's writer lease" in logs[1]   # worker 1: the same save fails
    assert not list((tmp_path / "ckpt").glob("*/MANIFEST.json"))
