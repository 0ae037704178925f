"""The trainer scores every batch with the reference model too (the model a commit replaces), so a
commit's quality record carries both models' records of the same examples, and the default gate
compares like with like beside the served commit: on the issue's synthetic stream of small commits it
never serves a poisoned commit, serves good models on a harder window (where a fixed served reference
holds them), and serves again within a few commits once a good model follows."""
import logging

import numpy as np

import checkpoint
import serving_loader
from evstore.gate import DEFAULT_GATE
from evstore.quality import measure
from evstore_app.job.model import build_model
from evstore_app.job.synthetic import SPEC, ClickStream
from evstore_app.job.trainer import Trainer

BATCH = 128


def test_each_commit_records_the_reference_models_scores_of_its_examples_exactly(tmp_path):
    """With runs of 256 examples judged by a gate every run passes, the reference of each commit is the
    model of the one before it."""
    spec = dict(SPEC, batch_size=BATCH)
    tr = Trainer(spec, str(tmp_path / "ckpt"), keep_chains=None, reference_gate="examples >= 0",
                 reference_min_examples=2 * BATCH)
    stream = ClickStream(seed=1, batch_size=BATCH)
    tr.manager.save_full(metadata=tr.metadata(), quality=tr.quality)
    batches = {}
    for b in range(6):
        cols, y = stream.batch(b)
        x = tr.inputs(cols)
        batches[b] = (x, y)
        tr.train(x, y, b + 1, *tr.score(x))
        if b % 2 == 1:
            tr.manager.save_delta(metadata=tr.metadata(), quality=tr.quality)
    chain = tr.manager.chain()
    assert [m.quality["examples"] for m in chain[1:]] == [2 * BATCH] * 3
    for prev, m in zip(chain[1:], chain[2:]):
        model = build_model(spec)
        checkpoint.CheckpointManager(tr.manager.root, model).restore(seq=prev.seq)
        b0 = prev.metadata["position"]
        y = np.concatenate([batches[b][1] for b in (b0, b0 + 1)])
        p = np.concatenate([model.predict_on_batch(batches[b][0]).reshape(-1) for b in (b0, b0 + 1)])
        assert m.quality["reference"] == measure(y, p)     # the restored predecessor, bit for bit


def test_a_reference_commits_behind_with_rows_trained_and_evicted_since_scores_as_that_commit_restored(tmp_path):
    """The reference keeps only the rows changed since its commit (copy-on-write). Runs of three
    one-batch deltas are judged, so each record's reference is up to three commits behind; few users
    and items recur often, and eviction at every save drops the keys not updated in the last step,
    so most keys are trained or evicted after the reference's commit."""
    spec = dict(SPEC, batch_size=BATCH, sparse=[dict(f, evict={"global_step": 1}) if "evict" in f else f
                                                for f in SPEC["sparse"]])
    tr = Trainer(spec, str(tmp_path / "ckpt"), keep_chains=None, reference_gate="examples >= 0",
                 reference_min_examples=3 * BATCH)
    stream = ClickStream(seed=2, batch_size=BATCH, users=300, items=200)
    tr.manager.save_full(metadata=tr.metadata(), quality=tr.quality)
    batches = {}
    for b in range(9):
        cols, y = stream.batch(b)
        batches[b] = (tr.inputs(cols), y)
        tr.train(*batches[b], b + 1, *tr.score(batches[b][0]))
        tr.manager.save_delta(metadata=tr.metadata(), quality=tr.quality)
    assert all(ev.stats()["evicted"] > 0 for n, ev in tr.evs.items() if n != "category")
    chain = tr.manager.chain()
    for m in chain[1:]:
        ref_seq = chain[0].seq + 3 * ((m.seq - chain[0].seq - 1) // 3)   # moved at every third delta
        model = build_model(spec)
        checkpoint.CheckpointManager(tr.manager.root, model).restore(seq=ref_seq)
        x, y = batches[m.metadata["position"] - 1]
        assert m.quality["reference"] == measure(y, model.predict_on_batch(x).reshape(-1)), m.seq


def test_the_default_gate_holds_poison_serves_a_harder_window_and_a_good_branch(tmp_path):
    """A delta every batch of 256 examples (each under min_examples); batches 20-35 a harder window
    (weaker signal for any model), 50-58 inverted labels; then the operator branches from the served
    commit (`train --from-seq`) and trains on clean data."""
    logging.getLogger("evstore.serving").setLevel(logging.ERROR)
    hard = lambda b: 0.35 if 20 <= b < 35 else 1.0   # noqa: E731
    tr = Trainer(dict(SPEC, batch_size=2 * BATCH), str(tmp_path / "ckpt"), keep_chains=None)
    export = str(tmp_path / "export")
    serving_loader.ensure_serving_export(tr.model, export)
    stream = ClickStream(seed=0, batch_size=2 * BATCH, signal=hard)
    tr.manager.save_full(metadata=tr.metadata(), quality=tr.quality)
    gates = {"default": DEFAULT_GATE, "served": "auc >= served - 0.01, logloss <= served * 1.05",
             "reference": "auc >= reference - 0.01"}
    sms = {k: serving_loader.ServingModel(export, tr.manager.root, gate=g) for k, g in gates.items()}
    kinds = {}

    def step(b, poisoned=False):
        cols, y = stream.batch(b)
        x = tr.inputs(cols)
        tr.train(x, 1 - y if poisoned else y, b + 1, *tr.score(x))
        seq = tr.manager.save_delta(metadata=tr.metadata(), quality=tr.quality)
        kinds[seq] = "poisoned" if poisoned else "hard" if hard(b) < 1 else "easy"
        for sm in sms.values():
            sm.poll()

    for b in range(58):
        step(b, poisoned=50 <= b < 58)
    good = sms["default"].version
    assert kinds[good] == "easy"
    tr.resume(seq=good)                                # the branch from the last served commit
    branch_start = max(kinds) + 1
    for b in range(58, 68):
        step(b)
    served = {k: set(sm.gate.served_versions) for k, sm in sms.items()}
    poisoned = {s for s, k in kinds.items() if k == "poisoned"}
    harder = {s for s, k in kinds.items() if k == "hard"}
    assert len(poisoned) == 8 and not poisoned & served["default"]    # never served, however small
    assert poisoned & served["reference"]          # like with like alone passes poison: it must sit beside served
    assert harder & served["default"] and not harder & served["served"]   # a fixed reference holds a harder window
    again = min(s for s in served["default"] if s >= branch_start)
    assert again - branch_start < 8, (again, branch_start)   # serving again within 8 commits (2 judged runs)
