"""checkpoint.CheckpointCallback: `model.fit` commits fulls and deltas between
training steps, each with the quality of the steps it covers (QualityMetric)
and the epoch and step it follows; a fit killed with SIGKILL mid-epoch and
started again resumes there and ends exactly as the uninterrupted fit."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def _fit(root, out, *kill):
    return subprocess.run([sys.executable, os.path.join(HERE, "fit_job.py"), str(root), str(out),
                           *map(str, kill)], capture_output=True, text=True, timeout=600)


def _manifests(root):
    ms = [json.loads((root / d / "MANIFEST.json").read_text()) for d in os.listdir(root)
          if d.startswith(("full-", "delta-"))]
    return sorted(ms, key=lambda m: m["seq"])


def test_a_fit_commits_between_steps_with_its_position_and_the_quality_of_the_steps_it_covers(tmp_path):
    """And, killed with SIGKILL mid-epoch and started again, resumes there and ends as the uninterrupted fit."""
    p = _fit(tmp_path / "a", tmp_path / "a.npz")
    assert p.returncode == 0, p.stderr[-3000:]
    ms = _manifests(tmp_path / "a")
    assert ms[0]["kind"] == "full" and all(m["kind"] == "delta" for m in ms[1:])
    # Deltas at steps 4, 8, 12 and at each epoch's end (the next epoch, step 0).
    assert [(m["metadata"]["epoch"], m["metadata"]["step"]) for m in ms[:5]] == [(0, 4), (0, 8), (0, 12), (1, 0),
                                                                                 (1, 4)]
    examples = [m["quality"]["examples"] for m in ms]
    assert examples[:5] == [128, 128, 128, 0, 128] and sum(examples) == 3 * 12 * 32
    assert all(m["quality"]["auc"] is None or 0 <= m["quality"]["auc"] <= 1 for m in ms)
    p = _fit(tmp_path / "b", tmp_path / "b_killed.npz", 1, 10)          # killed after step 10 of epoch 1
    assert p.returncode == -9 and not (tmp_path / "b_killed.npz").exists()
    assert _manifests(tmp_path / "b")[-1]["metadata"] == {"epoch": 1, "step": 8}
    p = _fit(tmp_path / "b", tmp_path / "b.npz")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert json.loads(str(b["resumed"]))["epoch"] == 1 and json.loads(str(b["resumed"]))["step"] == 8
    assert int(a["iterations"]) == int(b["iterations"]) == 36
    for k in a.files:
        if k != "resumed":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("kw", [{"delta_every": 0}, {"full_every": 2.5}, {"delta_every": True}])
def test_a_malformed_step_count_is_refused(kw):
    with pytest.raises(ValueError):
        checkpoint.CheckpointCallback("/tmp/unused", **kw)
