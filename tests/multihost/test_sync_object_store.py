"""A synchronous job (`python -m evstore_app.job.sync_train`, 2 workers) with
each worker on a host of its own (tests/hosts.py) and an S3 root as the only
storage they share: every worker uploads its own part, the chief merges and
commits. Worker 0, the chief, is SIGKILLed at batch 7: worker 1 stops by
itself; both are started again (the orchestrator's part) and resume from the
object store; the job ends equal to the one-process job, every merged commit
says deleted_complete, and a process on a third host restores the 2-worker
chain into one process bit for bit. No host keeps a checkpoint byte outside
the object store."""
import json
import os
import sys

import numpy as np

import hosts

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "collective"))
import test_sync_job as sj  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 2222


def start_workers(net, ws, root, env0=None):
    addrs = ",".join(f"{h.address}:{PORT}" for h in ws)
    return [h.start([sys.executable, "-m", "evstore_app.job.sync_train", "--rank", str(r), "--workers", addrs,
                     "--checkpoints", root, "--steps", str(sj.STEPS), "--batch-size", str(sj.BATCH),
                     "--delta-every", str(sj.DELTA), "--result", "/tmp/result.json", "--state-out", "/tmp/state.npz"],
                    name=f"sync-{r}", env=env0 if r == 0 else None)
            for r, h in enumerate(ws)]


def test_sync_job_on_hosts_commits_to_s3_and_resumes_after_the_chief_is_killed_exactly(tmp_path):
    from evstore_app.job.sync_train import merge_states

    with hosts.network_or_skip(tmp_path / "net") as net:
        store = net.object_store()
        root = store.root("sync-job")
        ws = [net.host(f"w{r}") for r in range(2)]
        first = start_workers(net, ws, root, env0={"EVSTORE_SYNC_KILL_AT": "0:7"})
        assert first[0].wait(timeout=hosts.STARTUP_S) == -9
        assert first[1].wait(timeout=hosts.STARTUP_S) == 75   # its next collective failed: it stopped by itself
        keys = store.keys("sync-job/")
        assert sum(k.endswith("MANIFEST.json") for k in keys) == 1, keys   # the commit at batch 4
        net.assert_no_checkpoint_files()   # no worker wrote a checkpoint byte to its disk: parts streamed
        again = start_workers(net, ws, root)
        for p in again:
            assert p.wait(timeout=hosts.STARTUP_S) == 0, open(p.log_path).read()[-3000:]
        results = [json.load(open(os.path.join(h.tmp, "result.json"))) for h in ws]
        assert [r["resumed_at"] for r in results] == [4, 4]
        assert all(r["position"] == r["global_step"] == sj.STEPS for r in results)
        states = [dict(np.load(os.path.join(h.tmp, "state.npz"))) for h in ws]
        got, want = merge_states(states), sj.reference()
        assert sorted(got) == sorted(want)
        for k in want:
            if want[k].dtype.kind == "f":
                np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=k)
            else:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        solo = net.host("solo")
        p = solo.start([sys.executable, os.path.join(HERE, "restore_one.py"), root, "/tmp/one.npz"], name="restore")
        assert p.wait(timeout=hosts.STARTUP_S) == 0, open(p.log_path).read()[-3000:]
        assert not [k for k in store.keys("sync-job/") if "/.sink-" in k]   # every streamed part was renamed
        info = json.loads(p.lines[-1])
        assert info["position"] == sj.STEPS and info["deleted_complete"] == [True] * 3   # full 4, deltas 8, 12
        one = dict(np.load(os.path.join(solo.tmp, "one.npz")))
        for k in got:
            np.testing.assert_array_equal(one[k], got[k], err_msg=k)
        net.assert_no_checkpoint_files()   # the restarts and `solo` read what they loaded from the bucket
