"""`evstore train --serving-view`: every commit of the job holds the view
(and the job still restores its float32 state exactly)."""
import json
import os
import subprocess
import sys

import checkpoint

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
