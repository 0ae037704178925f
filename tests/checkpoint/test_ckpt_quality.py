"""Every commit carries its quality: the progressive-validation record of the data
trained since the previous commit (evstore.quality) is in MANIFEST.json, under the
manifest's schema and checksum; a malformed record writes nothing and loses
nothing; a commit without one is written as before."""
import json
import os

import numpy as np
import pytest

import checkpoint
from checkpoint.errors import CorruptCheckpointError
from checkpoint.manifest import Manifest
from ckpt_model import assert_same_state, make_model, state, train
from evstore import quality
from evstore.quality import ProgressiveQuality, auc, hist_auc, logloss, measure, merge, normalize

Q = {"auc": 0.75, "logloss": 0.5, "examples": 4096, "label_rate": 0.25}


def _manifest(root, m):
    return json.loads((root / m.dir / "MANIFEST.json").read_text())


def test_a_commit_carries_its_quality_in_the_manifest(tmp_path):
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 2)
    mgr.save_full(quality=Q)
    train(model, 2, 3)
    mgr.save_delta(quality=lambda: dict(Q, auc=np.float32(0.5), label_rate=float("nan")))
    full, delta = mgr.history
    assert _manifest(tmp_path, full)["quality"] == Q and full.quality == Q
    assert _manifest(tmp_path, delta)["quality"] == dict(Q, auc=0.5, label_rate=None)   # NaN: not recorded
    assert [m.quality for m in mgr.chain()] == [Q, dict(Q, auc=0.5, label_rate=None)]


def test_the_quality_is_covered_by_the_manifest_checksum(tmp_path):
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.save_full(quality=Q)
    path = tmp_path / mgr.history[-1].dir / "MANIFEST.json"
    path.write_text(path.read_text().replace('"auc": 0.75', '"auc": 0.95'))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        Manifest.from_json(path.read_text(), str(path))


def test_a_commit_without_quality_has_no_quality_field(tmp_path):
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.save_full()
    assert "quality" not in _manifest(tmp_path, mgr.history[-1]) and mgr.latest().quality is None


@pytest.mark.parametrize("bad, error", [
    ({"auc": 0.7}, ValueError), (dict(Q, accuracy=0.9), ValueError), (dict(Q, auc=1.5), ValueError),
    (dict(Q, examples=-1), TypeError), (dict(Q, examples=2.5), TypeError), (dict(Q, logloss="low"), TypeError),
    ([0.7, 0.5], TypeError)])
def test_a_malformed_quality_is_refused_and_the_next_save_carries_every_change(tmp_path, bad, error):
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.save_full()
    train(model, 0, 3)
    with pytest.raises(error):
        mgr.save_delta(quality=bad)
    with pytest.raises(error):
        mgr.save_delta(quality=lambda: bad)    # a callable's record is checked under the lock: aborted
    assert [d for d in os.listdir(tmp_path) if d.startswith(("full-", "delta-"))] == [mgr.history[0].dir]
    mgr.save_delta(quality=Q)
    fresh = make_model()
    checkpoint.CheckpointManager(str(tmp_path), fresh, lease=False).restore()
    assert_same_state(state(fresh), state(model))


def test_measure_is_auc_logloss_examples_and_label_rate():
    y = np.array([0, 0, 1, 1, 1, 0])
    p = np.array([0.1, 0.4, 0.35, 0.8, 0.8, 0.8])
    r = measure(y, p)
    pairs = [(a, b) for a in p[y == 1] for b in p[y == 0]]
    assert r["auc"] == pytest.approx(np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs]))
    assert r["logloss"] == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    assert r["examples"] == 6 and r["label_rate"] == 0.5
    assert measure([1, 1], [0.5, 0.6])["auc"] is None and np.isnan(auc([1, 1], [0.5, 0.6]))
    empty = measure([], [])
    assert {k: v for k, v in empty.items() if k != "hist"} == {"auc": None, "logloss": None, "examples": 0,
                                                               "label_rate": None}
    assert np.isnan(logloss([], []))


def test_progressive_quality_answers_the_batches_after_a_position():
    pq = ProgressiveQuality()
    pq.record(2, [0, 1], [0.2, 0.9])
    pq.record(4, [1, 0], [0.3, 0.6])
    assert pq.since(None)["examples"] == 4
    assert pq.since(2) == measure([1, 0], [0.3, 0.6])
    assert pq.since(4)["examples"] == 0


def test_records_of_adjacent_stretches_merge_into_the_record_of_all_of_them():
    rng = np.random.default_rng(0)
    parts = []
    for n in (44, 256, 768, 3000):
        y = (rng.random(n) < 0.2).astype(float)
        parts.append((y, 1 / (1 + np.exp(-(1.5 * y + rng.normal(0, 1, n) - 2)))))
    whole = measure(np.concatenate([y for y, _ in parts]), np.concatenate([p for _, p in parts]))
    m = merge(measure(y, p) for y, p in parts)
    assert m["examples"] == whole["examples"] and m["hist"]["pos"] == whole["hist"]["pos"]
    assert m["label_rate"] == pytest.approx(whole["label_rate"]) and m["logloss"] == pytest.approx(whole["logloss"])
    assert abs(m["auc"] - whole["auc"]) < 0.005 and abs(hist_auc(whole) - whole["auc"]) < 0.005
    assert normalize(m) == m                     # a merged record is a valid record


def test_a_record_without_a_histogram_does_not_merge():
    assert merge([Q, measure([0, 1], [0.2, 0.8])]) is None and merge([]) is None


@pytest.mark.parametrize("hist", [{"pos": [1], "neg": [0], "loss": 0.1}, {"pos": [0] * 160, "neg": [0] * 160},
                                  {"pos": [-1] + [0] * 159, "neg": [0] * 160, "loss": 0.0},
                                  {"pos": [0] * 160, "neg": [0] * 160, "loss": 0.0}])
def test_a_malformed_histogram_is_refused(hist):
    with pytest.raises(ValueError):
        normalize(dict(Q, hist=hist))      # the last: counts 0 examples, the record 4096


def test_a_record_carries_the_reference_models_record_of_the_same_examples_and_both_merge():
    rng = np.random.default_rng(3)
    y = (rng.random(4000) < 0.3).astype(float)
    good, worse = y * 0.6 + rng.random(4000) * 0.4, y * 0.2 + rng.random(4000) * 0.8
    r = quality.measure(y, good, reference=worse)
    assert r["reference"] == quality.measure(y, worse) and r["reference"]["auc"] < r["auc"]
    halves = [quality.measure(y[a:b], good[a:b], reference=worse[a:b]) for a, b in ((0, 1500), (1500, 4000))]
    m = quality.merge(halves)
    assert m["reference"]["examples"] == 4000 and abs(m["reference"]["auc"] - r["reference"]["auc"]) < 0.005
    assert "reference" not in quality.merge([halves[0], quality.measure(y[1500:], good[1500:])])
    assert quality.merge([halves[0], quality.measure([], [])])["reference"] == halves[0]["reference"]


def test_a_reference_of_other_examples_is_refused():
    r = quality.measure([0, 1, 1], [0.2, 0.7, 0.6], reference=[0.3, 0.4, 0.5])
    r["reference"] = quality.measure([0, 1], [0.3, 0.4])
    with pytest.raises(ValueError, match="a reference scores the same examples"):
        quality.normalize(r)
