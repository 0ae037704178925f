"""The streaming job: `evstore demo` and `evstore train` as real processes,
asserting what their summaries claim; the stream, the spec and AUC."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from evstore_app.job.spec import SpecError, load_spec
from evstore_app.job.synthetic import ClickStream
from evstore_app.job.trainer import auc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shared dataset when this checkout sits next to ../shared, else the slice shipped with the tests.
_SHARED = os.path.join(os.path.dirname(REPO), "shared", "data", "movielens-small", "ratings.csv")
MOVIELENS = _SHARED if os.path.exists(_SHARED) else os.path.join(REPO, "tests", "data", "movielens-slice",
                                                                  "ratings.csv")
SPEC = os.path.join(REPO, "examples", "movielens.json")


def _evstore(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "evstore_app.cli", *args], capture_output=True, text=True,
                       timeout=timeout)
    return p


def test_demo_serves_every_commit_restores_exactly_and_live_beats_frozen(tmp_path):
    out = tmp_path / "demo"
    p = _evstore("demo", "--minutes", "0.6", "--out", str(out), "--delta-every", "2", "--full-every", "15",
                 "--warmup-batches", "30", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["serving"]["served_every_commit"] and s["serving"]["served_final"]
    assert s["serving"]["committed_after_first_full"] >= 5
    assert s["restore_matches_trainer"] is True
    assert s["auc"]["live"] > s["auc"]["frozen"]
    assert s["checkpoints"]["fulls"] >= 2 and s["checkpoints"]["deltas"] >= 5
    assert "progressive AUC" in p.stdout and os.listdir(out / "tensorboard")
    assert (out / "export" / "saved_model.pb").exists() and s["export"]["serve"] in p.stdout   # next to checkpoints/


def test_train_on_movielens_resumes_from_the_saved_position(tmp_path):
    root = str(tmp_path / "ckpt")
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", root, "--max-rows", "12000",
                 "--delta-every", "1", "--no-progress", "--out", str(tmp_path / "o1"))
    assert p.returncode == 0, p.stderr[-3000:]
    first = json.loads((tmp_path / "o1" / "summary.json").read_text())
    assert first["position"] == 12000 and first["restore_matches_trainer"] is True
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", root, "--max-rows", "20000",
                 "--delta-every", "1", "--no-progress", "--out", str(tmp_path / "o2"))
    assert p.returncode == 0, p.stderr[-3000:]
    second = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert second["position"] == 20000 and second["examples"] == 20000   # 8000 new: none twice, none lost
    assert second["restore_matches_trainer"] is True
    assert 0.5 < second["auc"]["live"] < 1.0


def test_sigterm_stops_the_demo_gracefully_with_a_final_delta_served(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "evstore_app.cli", "demo", "--minutes", "10", "--out", str(out),
                             "--delta-every", "1", "--warmup-batches", "20", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = out / "checkpoints"
    deadline = time.time() + 240
    while not any(d.startswith("delta-") for d in (os.listdir(root) if root.exists() else [])):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["train_seconds"] < 300
    last = max((d for d in os.listdir(root) if d.startswith(("full-", "delta-"))), key=lambda d: int(d[-10:]))
    meta = json.loads((root / last / "MANIFEST.json").read_text())["metadata"]
    assert meta["examples"] == s["examples"]                  # the final delta holds everything trained
    assert s["serving"]["served_every_commit"] and s["restore_matches_trainer"] is True


def test_bad_spec_is_a_clear_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"label": {"column": "rating"}, "sparse": [{"name": "u", "column": "userId",
                                                                          "dim": 0}]}))
    p = _evstore("train", "--data", MOVIELENS, "--spec", str(bad), "--checkpoints", str(tmp_path / "c"))
    assert p.returncode == 1 and "sparse[0].dim must be a positive int" in p.stderr


def test_spec_rejects_duplicate_fields_and_unknown_filters():
    base = {"label": {"column": "y"}, "sparse": [{"name": "a", "column": "a", "dim": 4}] * 2}
    with pytest.raises(SpecError, match="two sparse fields are named 'a'"):
        load_spec(base)
    with pytest.raises(SpecError, match="filter"):
        load_spec({"label": {"column": "y"}, "sparse": [{"name": "a", "column": "a", "dim": 4,
                                                         "filter": {"sometimes": 1}}]})


def test_synthetic_stream_is_reproducible_and_drifts():
    a, b = ClickStream(seed=3, batch_size=256), ClickStream(seed=3, batch_size=256)
    (ca, ya), (cb, yb) = a.batch(17), b.batch(17)
    assert all(np.array_equal(ca[k], cb[k]) for k in ca) and np.array_equal(ya, yb)
    early = set(a.batch(0)[0]["user"].tolist())
    late = set(a.batch(5000)[0]["user"].tolist())
    assert len(late - early) > len(late) // 4      # new users keep arriving
    assert 0.05 < float(np.mean(np.concatenate([a.batch(i)[1] for i in range(20)]))) < 0.95


def test_auc_matches_the_rank_statistic():
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([0, 0, 1, 1], [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert auc([0, 1, 1, 0], [0.1, 0.4, 0.35, 0.8]) == 0.5
    assert np.isnan(auc([1, 1], [0.2, 0.3]))
