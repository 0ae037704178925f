"""`evstore train --guard`: every commit of `evstore train` carries its progressive
quality; when a commit's quality collapses past the guard, the trainer stops
committing (exit 3, one clear message), optionally restores the last good commit,
and a later run resumes exactly from it."""
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evstore.quality import merge
from evstore_app.job.synthetic import SPEC, ClickStream

BATCHES, POISON_FROM = 140, 80     # batches of 512 of the demo's click stream; labels shuffled from batch 80 on
GUARD = "auc >= served - 0.1"


def _evstore(*args):
    return subprocess.run([sys.executable, "-m", "evstore_app.cli", *args], capture_output=True, text=True,
                          timeout=600)


def _data(path, poison):
    stream, rng = ClickStream(seed=0, batch_size=512), np.random.default_rng(1)
    cols = {k: [] for k in ("user", "item", "category", "hour", "click")}
    for b in range(BATCHES):
        c, y = stream.batch(b)
        cols["click"].append(rng.permutation(y) if poison and b >= POISON_FROM else y)
        for k in ("user", "item", "category", "hour"):
            cols[k].append(c[k])
    pq.write_table(pa.table({k: np.concatenate(v) for k, v in cols.items()}), path)
    return str(path)


def _commits(root):
    ms = [json.loads((root / d / "MANIFEST.json").read_text()) for d in os.listdir(root)
          if d.startswith(("full-", "delta-"))]
    return sorted(ms, key=lambda m: m["seq"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(dict(SPEC, data={"format": "parquet"})))
    return tmp, str(spec), _data(tmp / "poisoned.parquet", True), _data(tmp / "clean.parquet", False)


def test_every_commit_of_train_carries_the_quality_of_the_data_since_the_previous_one(files, tmp_path):
    _, spec, _, clean = files
    root = tmp_path / "ckpt"
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--max-rows", "20480",
                 "--delta-every", "0.5", "--no-progress", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr[-3000:]
    ms = _commits(root)
    assert all(set(m["quality"]) - {"reference"} == {"auc", "logloss", "examples", "label_rate", "hist"} for m in ms)
    # the reference model's scores of the same examples (none in a commit of no examples)
    assert all("reference" in m["quality"] for m in ms[1:] if m["quality"]["examples"])
    trained = [m["metadata"]["examples"] - (prev["metadata"]["examples"]) for prev, m in zip(ms, ms[1:])]
    assert [m["quality"]["examples"] for m in ms[1:]] == trained and sum(trained) == 20480
    # Every commit's record, however the schedule cut them: together, the 20,480 examples the stream ranks well.
    whole = merge(m["quality"] for m in ms[1:])
    assert whole["examples"] == 20480 and 0.6 < whole["auc"] < 1


def test_train_without_the_reference_model_writes_records_without_reference(files, tmp_path):
    _, spec, _, clean = files
    root = tmp_path / "ckpt"
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--max-rows", "4096",
                 "--no-reference", "--no-progress", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr[-3000:]
    ms = _commits(root)
    assert sum(m["quality"]["examples"] for m in ms) == 4096 and not any("reference" in m["quality"] for m in ms)


def test_the_guard_stops_committing_restores_the_last_good_commit_and_the_resumed_run_is_exact(files, tmp_path):
    _, spec, poisoned, clean = files
    root, out = tmp_path / "ckpt", tmp_path / "o1"
    # Clean rows up to the stretch: commits whose quality is the guard's reference when the run resumes.
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--delta-every", "0.5",
                 "--max-rows", str(POISON_FROM * 512), "--no-progress", "--out", str(tmp_path / "o0"))
    assert p.returncode == 0, p.stderr[-3000:]
    p = _evstore("train", "--data", poisoned, "--spec", spec, "--checkpoints", str(root), "--delta-every", "0.5",
                 "--no-progress", "--out", str(out), "--guard", GUARD, "--guard-restore")
    assert p.returncode == 3, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    ms = {m["seq"]: m for m in _commits(root)}
    good = ms[s["guard"]["last_good"]]      # the newest commit whose run the guard passed
    assert s["guard"]["restored"] is True and s["guard"]["newest"] == max(ms)
    msg = [ln for ln in p.stderr.splitlines() if ln.startswith("evstore train: guard tripped at row")]
    assert len(msg) == 1 and f"commit is {good['seq']}, restored" in msg[0]
    assert POISON_FROM * 512 < s["guard"]["position"] <= BATCHES * 512    # at a scheduled or the final delta
    assert s["guard"]["quality"]["auc"] < 0.6                             # shuffled labels
    # The refused commit is not there; the trainer holds exactly the last good commit.
    assert s["position"] == good["metadata"]["position"] < s["guard"]["position"]
    assert s["restore_matches_trainer"] is True
    # Fixed data: the next run resumes at that commit's row (a branch from it when unjudged commits
    # followed it) and trains every later row once.
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--delta-every", "0.5",
                 "--no-progress", "--out", str(tmp_path / "o2"), "--guard", GUARD, "--from-seq", str(good["seq"]))
    assert p.returncode == 0, p.stderr[-3000:]
    s2 = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert f"resuming at row {good['metadata']['position']:,} of {BATCHES * 512:,}" in p.stderr
    assert s2["examples"] == s2["position"] == BATCHES * 512
    assert s2["examples_this_session"] == BATCHES * 512 - good["metadata"]["position"]
    assert s2["restore_matches_trainer"] is True and "guard" not in s2


def test_train_from_seq_continues_the_branch_of_an_older_commit(files, tmp_path):
    _, spec, _, clean = files
    root = tmp_path / "ckpt"
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--delta-every", "0.2",
                 "--max-rows", str(20 * 512), "--no-progress", "--out", str(tmp_path / "o0"))
    assert p.returncode == 0, p.stderr[-3000:]
    old = {m["seq"]: m for m in _commits(root)}
    back = sorted(old)[-2]                          # an older commit: its chain goes on past it
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(root), "--delta-every", "0.2",
                 "--max-rows", str(30 * 512), "--no-progress", "--out", str(tmp_path / "o1"), "--from-seq", str(back))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming at row {old[back]['metadata']['position']:,} of {30 * 512:,}" in p.stderr
    new = [m for m in _commits(root) if m["seq"] not in old]
    assert new[0]["parent"] == back and new[-1]["metadata"]["examples"] == 30 * 512
    s = json.loads((tmp_path / "o1" / "summary.json").read_text())
    assert s["restore_matches_trainer"] is True     # the newest chain is the branch: restored, it equals the trainer


def test_train_from_a_commit_the_root_does_not_hold_is_refused_in_one_line(files, tmp_path):
    _, spec, _, clean = files
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(tmp_path / "ckpt"),
                 "--from-seq", "7", "--no-progress", "--out", str(tmp_path / "o"))
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("evstore train: ") and "no committed checkpoint 7" in p.stderr


def test_a_malformed_guard_is_refused_before_training_in_one_line(files, tmp_path):
    _, spec, _, clean = files
    p = _evstore("train", "--data", clean, "--spec", spec, "--checkpoints", str(tmp_path / "ckpt"),
                 "--guard", "auc >= served -", "--no-progress")
    assert p.returncode == 1 and not (tmp_path / "ckpt").exists()
    assert p.stderr.strip().splitlines()[-1].startswith("evstore train: gate clause 1 'auc >= served -'")
