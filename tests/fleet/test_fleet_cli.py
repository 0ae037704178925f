"""`evstore train --serving-view`: every commit of the job holds the view
(and the job still restores its float32 state exactly); `evstore serve
--no-serving-view` serves the float32 rows of commits that have a view."""
import json
import os
import subprocess
import sys

import numpy as np

import checkpoint
import serving_loader
from ckpt_model import make_model, probe_inputs, train
from serve_proc import Server, admin, metrics, predict_columns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "data", "movielens", "ratings.csv")
SPEC = os.path.join(REPO, "examples", "movielens.json")


def test_train_with_a_serving_view_writes_it_into_every_commit(tmp_path):
    root = str(tmp_path / "ckpt")
    p = subprocess.run([sys.executable, "-m", "evstore_app.cli", "train", "--data", DATA, "--spec", SPEC,
                        "--checkpoints", root, "--max-rows", "6000", "--delta-every", "1", "--serving-view", "int8",
                        "--no-progress", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["restore_matches_trainer"] is True
    manifests = checkpoint.scan(checkpoint.Storage(root)).manifests.values()
    assert manifests and all(m.serving_view == {"dtype": "int8"} for m in manifests)
    assert all("serving.index" in m.files for m in manifests)


def test_serve_with_no_serving_view_serves_the_float32_rows_of_a_commit_with_a_view(tmp_path):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model, serving_view="int8")
    mgr.save_full()
    train(model, 3, 6)
    seq = mgr.save_delta()
    server = Server(str(tmp_path), export, root=mgr.root, extra=("--no-serving-view",))
    try:
        server.wait_version(seq)
        users, items = probe_inputs()
        got = np.asarray(predict_columns(server, {"users": users, "items": items}))
        # float32 rows: equal up to REST's JSON rounding (the int8 view is ~1e-3 off)
        np.testing.assert_allclose(got, model.predict([users, items], verbose=0), rtol=0, atol=1e-6)
        status, body = admin(server)
        assert status == 200 and body["serving_view"] == "float32", body
        assert metrics(server)["evstore_serving_applied_sequence"] == seq
    finally:
        server.stop()
