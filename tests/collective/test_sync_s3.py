"""`evstore train-sync` with an S3 root (moto's server on 127.0.0.1) as the
only storage the workers share: each worker uploads its own part, the chief
merges the part indexes and commits; a killed worker, a killed chief and a
rerun of the whole job resume exactly from the object store."""
import json
import os
import sys

import numpy as np
import pytest

import checkpoint
import test_sync_job as sj

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint")


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    sys.path.insert(0, HELPERS)
    from s3_server import moto_bucket
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with moto_bucket(log, before_stop=checkpoint.lease._release_all) as bucket:
        yield bucket


def train_sync(tmp, root, run, extra_env=None, max_restarts=3):
    env = dict(sj.h.env(), **(extra_env or {}))
    argv = [sys.executable, "-m", "evstore_app", "train-sync", "--workers", "2", "--checkpoints", root,
            "--steps", str(sj.STEPS), "--batch-size", str(sj.BATCH), "--delta-every-steps", str(sj.DELTA),
            "--max-restarts", str(max_restarts), "--directory", str(tmp / run), "--state-out", str(tmp / "state")]
    import subprocess
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)
    return p.returncode, p.stdout, p.stderr


def manifests(root):
    import fsspec
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    found = [json.loads(fs.cat_file(p)) for p in fs.glob(root[len("s3://"):] + "/*/MANIFEST.json")]
    return sorted(found, key=lambda m: m["seq"])


def test_sync_job_on_s3_survives_a_killed_worker_and_commits_merged_checkpoints(tmp_path, s3_bucket):
    root = f"s3://{s3_bucket}/sync-kill-worker"
    code, out, err = train_sync(tmp_path, root, "run", {"EVSTORE_SYNC_KILL_AT": "1:7"})
    assert code == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["restarts"] == 1 and res["resumed_at"] == 4 and res["position"] == res["global_step"] == sj.STEPS
    sj.assert_equals_reference(tmp_path)
    ms = manifests(root)
    assert [m["metadata"]["position"] for m in ms] == [4, 8, 12]
    for m in ms:
        assert m["deleted_complete"] is True   # replicas read no filtered keys of a merged commit
        assert sorted(n for n in m["evs"] if n.startswith("user/")) == ["user/part_0", "user/part_1"]
        assert not [f for f in m["files"] if "part" in f]   # one merged bundle: ckpt.index + ckpt.data-*


def test_sync_job_on_s3_resumes_after_the_chief_dies_and_restores_into_one_process(tmp_path, s3_bucket):
    from evstore_app.job.cluster_train import ClusterJob
    from evstore_app.job.sync_train import merge_states

    root = f"s3://{s3_bucket}/sync-kill-chief"
    code, out, err = train_sync(tmp_path, root, "run1", {"EVSTORE_SYNC_KILL_AT": "0:6"}, max_restarts=0)
    assert code == 1 and "run the job again to resume from its last commit" in err, err[-3000:]
    code, out, err = train_sync(tmp_path, root, "run2")
    assert code == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["restarts"] == 0 and res["resumed_at"] == 4 and res["global_step"] == sj.STEPS
    sj.assert_equals_reference(tmp_path)
    # The 2-worker chain into one process, bit for bit the workers' final state.
    one = ClusterJob(local=True, batch_size=sj.BATCH, checkpoints=root)
    assert one.resume() == sj.STEPS
    got = one.model.state()
    want = merge_states([dict(np.load(tmp_path / "state" / f"state-{r}.npz")) for r in range(2)])
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
