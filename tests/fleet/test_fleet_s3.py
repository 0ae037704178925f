"""A fleet on one object-store root: a trainer and three
`evstore serve` replicas against one S3 server (moto's, a separate process on
127.0.0.1, through s3fs). Each replica converges to each new commit, serves
from the commit's bfloat16 view, reads far less than the commit holds, and
reports per commit on /metrics the bytes it fetched, its apply duration and
the lag from the commit's time to served."""

import time

import numpy as np
import pytest

import checkpoint
import serving_loader
from ckpt_model import make_model, probe_inputs, train
from s3_server import moto_bucket
from serve_proc import Server, admin, metrics, predict_columns

REPLICAS = 3


@pytest.fixture
def s3_root(tmp_path):
    """s3://<bucket>/fleet on a moto S3 server process; AWS_* variables
    (inherited by the replicas) point at it."""
    with moto_bucket(tmp_path / "moto.log", before_stop=checkpoint.lease._release_all) as bucket:
        yield f"s3://{bucket}/fleet"


def test_three_replicas_on_one_s3_root_converge_to_each_commit_and_report_it(tmp_path, s3_root):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(s3_root, model, serving_view="bfloat16")
    mgr.save_full()
    replicas = []
    try:
        for i in range(REPLICAS):
            replicas.append(Server(str(tmp_path), export, root=s3_root, name="ctr"))
        users, items = probe_inputs()
        for k in range(3):
            train(model, 3 + 3 * k, 6 + 3 * k)
            saving = time.time()   # the commit's recorded time is later: lag is at most the time since
            seq = mgr.save_delta()
            m = mgr.chain()[-1]
            want = model.predict([users, items], verbose=0)
            for r in replicas:
                r.wait_version(seq)
                got = np.asarray(predict_columns(r, {"users": users, "items": items}))
                assert np.abs(got - want).max() <= 1e-2   # the bfloat16 view's tolerance (test_serving_view)
                s = metrics(r)
                assert s["evstore_serving_applied_sequence"] == seq
                assert 0 < s["evstore_serving_last_commit_fetched_bytes"] < m.total_bytes / 2
                # Apply (stage + publish) starts after the scan found the commit, so it is part of the lag
                # from the commit's time to served, which ended before this read.
                apply_s, lag_s = (s["evstore_serving_last_commit_apply_seconds"],
                                  s["evstore_serving_last_commit_lag_seconds"])
                assert 0 < apply_s <= lag_s <= time.time() - saving, (apply_s, lag_s)
                assert s["evstore_serving_fetched_bytes_total"] >= s["evstore_serving_last_commit_fetched_bytes"]
                status, body = admin(r)
                assert status == 200 and body["serving_view"] == "bfloat16", body
    finally:
        for r in replicas:
            r.stop()
