"""The quality gate of a served model: a commit whose manifest quality fails the
gate stays committed but is not served; the model holds the last good version,
reports it, and serves again from the first later commit that passes, applying
the chain up to it. Commits too small to judge wait and are judged together
(merged records); a hold past its bound is reported and, if the operator says
so, ends. A full repairs a broken chain whatever its quality; commits without
quality never block; pin and rollback keep working; a malformed gate is
refused at start with one line."""
import os

import numpy as np
import pytest

import checkpoint
import serving_loader
from ckpt_model import make_model, probe_inputs, train
from serve_proc import Server, admin, evstore, last_line, metrics, wait_until
from evstore.quality import measure
from serving_loader.gate import Gate, GateError, GateState

GATE = "auc >= served - 0.05, logloss <= served * 1.2"


def q(auc, logloss=0.5, examples=1000):
    return {"auc": auc, "logloss": logloss, "examples": examples, "label_rate": 0.3}


def scored(n, poisoned=False, seed=0):
    """A measured record (with its mergeable histogram) of `n` examples whose
    scores rank the labels well (AUC about 0.92), or inverted (`poisoned`:
    the labels of a good model's scores flipped, AUC about 0.08)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(float)
    scores = 1 / (1 + np.exp(-(1.2 * (2 * y - 1) + rng.normal(0, 1.2, n) - 0.8)))
    return measure(1 - y if poisoned else y, scores)


class Job:
    """A trainer committing to a root, with its probe predictions at every commit."""

    def __init__(self, tmp):
        self.model = make_model()
        train(self.model, 0, 2)
        self.step = 2
        self.export = str(tmp / "export")
        serving_loader.export_serving_model(self.model, self.export)
        self.mgr = checkpoint.CheckpointManager(str(tmp / "ckpt"), self.model, keep_chains=None)
        self.want = {}

    def commit(self, quality=None, full=False):
        if self.want:
            train(self.model, self.step, self.step + 1)
            self.step += 1
        seq = (self.mgr.save_full if full or not self.want else self.mgr.save_delta)(quality=quality)
        self.want[seq] = self.model.predict(list(probe_inputs()), verbose=0)
        return seq

    def serves(self, sm, seq):
        users, items = probe_inputs()
        out, version = sm.predict({"users": users, "items": items})
        return version == seq and np.allclose(out["outputs"], self.want[seq], rtol=1e-6, atol=1e-7)


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path)


@pytest.fixture(scope="module")
def committed_job(tmp_path_factory):
    """One job with one commit, shared by tests that only read it (a refused gate changes nothing)."""
    job = Job(tmp_path_factory.mktemp("gate"))
    job.commit(q(0.8))
    return job


def test_gate_holds_a_failing_commit_and_serves_from_the_next_passing_one(job):
    first = job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)
    assert job.serves(sm, first)
    bad = job.commit(q(0.60))
    assert sm.poll() == first and job.serves(sm, first)
    st = sm.admin_status()
    assert st["held"] is True and st["held_version"] == first and st["held_commits"] == [bad]
    assert "auc 0.6 is not >= 0.75" in st["held_reason"] and st["held_back_total"] == 1
    worse = job.commit(q(0.70))
    assert sm.poll() == first and sm.admin_status()["held_commits"] == [bad, worse]
    good = job.commit(q(0.78))
    assert sm.poll() == good and job.serves(sm, good)          # the chain applied up to it: bad, worse, good
    assert sm.applied_seqs[-3:] == [bad, worse, good]
    st = sm.admin_status()
    assert st["held"] is False and st["held_version"] is None and st["held_back_total"] == 2
    assert sm.served_quality == q(0.78)


def test_the_reference_is_the_served_commit_so_a_gradual_change_passes_step_by_step(job):
    job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate="auc >= served - 0.05")
    for auc in (0.77, 0.74, 0.71):
        seq = job.commit(q(auc))
        assert sm.poll() == seq


def test_a_failing_full_is_held_while_the_served_chain_is_intact(job):
    first = job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)
    full = job.commit(q(0.50), full=True)
    assert sm.poll() == first and sm.admin_status()["held_commits"] == [full]
    after = job.commit(q(0.79))
    assert sm.poll() == after and job.serves(sm, after)   # the new chain, loaded up to the commit that passed


def test_a_full_repairs_a_broken_chain_past_held_commits_whatever_its_quality(job):
    first = job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)
    held = job.commit(q(0.50))
    broken = job.commit(q(0.80))
    data = [f for f in job.mgr.history[-1].files if f.startswith("ckpt.data")][0]
    with open(os.path.join(job.mgr.root, job.mgr.history[-1].dir, data), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")                     # a corrupt delta after the held one: the chain is broken
    assert sm.poll() == first and sm.failures == 1
    assert sm.admin_status()["held_commits"] == [held]
    full = job.commit(q(0.40), full=True)              # fails the gate, but nothing else can repair the chain
    assert sm.poll() == full and job.serves(sm, full)
    assert broken not in sm.applied_seqs


def test_commits_without_quality_are_never_held(job):
    first = job.commit()                                # an old trainer: no quality in the manifests
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate="auc >= 0.9, auc >= served - 0.01")
    assert job.serves(sm, first)
    seq = job.commit()
    assert sm.poll() == seq
    seq = job.commit(q(0.95))                           # nothing served to compare with: only auc >= 0.9 judged
    assert sm.poll() == seq
    seq = job.commit()
    assert sm.poll() == seq and sm.admin_status()["held_back_total"] == 0


def test_small_poisoned_commits_are_never_served_unjudged(job):
    """The reported failure: poisoned commits of 256, 44 and 768 examples (each under
    min_examples 1000) were served unjudged, and the next, large one held the server on them."""
    clean = job.commit(scored(5000, seed=1))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate="default")
    small = [job.commit(scored(n, poisoned=True, seed=2 + i)) for i, n in enumerate((256, 44))]
    assert sm.poll() == clean                        # 300 examples: too few to judge, they wait
    st = sm.admin_status()
    assert st["waiting_commits"] == small and st["waiting_examples"] == 300 and not st["held"]
    small.append(job.commit(scored(768, poisoned=True, seed=4)))
    assert sm.poll() == clean                        # 1,068 examples together: judged, and they fail
    st = sm.admin_status()
    assert st["held"] and st["held_version"] == clean and st["held_commits"] == small
    assert st["held_reason"].startswith(f"commit {small[0]}: judged with commit {small[-1]}: auc 0.0")
    assert st["held_back_total"] == 3 and st["waiting_commits"] == []
    large = job.commit(scored(8932, poisoned=True, seed=5))
    assert sm.poll() == clean and sm.admin_status()["held_commits"] == small + [large]
    assert clean not in small and all(s not in sm.applied_seqs for s in small + [large])


def test_small_commits_wait_and_are_served_together_once_they_pass(job):
    first = job.commit(scored(5000, seed=1))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate="default")
    a, b = job.commit(scored(400, seed=2)), job.commit(scored(400, seed=3))
    assert sm.poll() == first and sm.admin_status()["waiting_commits"] == [a, b]
    c = job.commit(scored(400, seed=4))
    assert sm.poll() == c and job.serves(sm, c) and sm.applied_seqs[-3:] == [a, b, c]
    st = sm.admin_status()
    assert st["reference"]["examples"] == 1200 and st["waiting_commits"] == [] and not st["held"]


def test_commits_after_a_failed_run_are_judged_on_their_own_examples(job):
    first = job.commit(scored(5000, seed=1))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate="default")
    bad = job.commit(scored(2000, poisoned=True, seed=2))
    good = [job.commit(scored(600, seed=3 + i)) for i in range(2)]    # not merged with the failed commit
    assert sm.poll() == good[-1] and sm.applied_seqs[-3:] == [bad] + good
    assert sm.admin_status()["held_back_total"] == 1


def test_records_without_a_histogram_are_judged_alone_and_a_small_one_waits(job):
    job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)   # min_examples 1000 by default
    lucky = job.commit(q(0.95, examples=999))      # too few to judge, and nothing to merge it with: it waits
    assert sm.poll() == lucky - 1 and sm.admin_status()["waiting_commits"] == [lucky]
    seq = job.commit(q(0.76))                      # judged alone, against 0.80 (not 0.95)
    assert sm.poll() == seq and sm.admin_status()["reference"] == q(0.76)
    assert sm.admin_status()["held_back_total"] == 0


def test_a_hold_past_its_bound_is_reported_and_the_server_holds_on(job):
    first = job.commit(scored(5000, seed=1))
    gate = GateState(Gate.parse("default"), max_hold_commits=3)
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=gate)
    for i in range(2):
        job.commit(scored(1000, poisoned=True, seed=2 + i))
    assert sm.poll() == first and sm.admin_status()["overdue"] is False
    job.commit(scored(1000, poisoned=True, seed=4))
    assert sm.poll() == first
    st = sm.admin_status()
    assert st["overdue"] is True and st["behind_commits"] == 3 and st["overdue_total"] == 1
    good = job.commit(scored(5000, seed=5))
    assert sm.poll() == good and sm.admin_status()["overdue"] is False


def test_past_its_bound_an_operator_may_have_the_server_serve_on(job):
    first = job.commit(scored(5000, seed=1))
    gate = GateState(Gate.parse("default"), max_hold_s=0, past_max_hold="serve")   # any hold is past the bound
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=gate)
    bad = job.commit(scored(1000, poisoned=True, seed=2))
    assert sm.poll() == bad and job.serves(sm, bad)
    st = sm.admin_status()
    assert st["served_past_hold_total"] == 1 and st["overdue_total"] == 1 and st["overdue"] is False
    assert st["reference"]["auc"] < 0.3        # the gate judges what follows against what it serves now


@pytest.mark.parametrize("kw", [{"max_hold_commits": 0}, {"max_hold_s": -1}, {"past_max_hold": "maybe"}])
def test_a_malformed_hold_bound_is_refused(kw):
    with pytest.raises(ValueError):
        GateState(Gate.parse("default"), **kw)


def test_a_metric_missing_from_a_commit_is_not_judged(job):
    job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)
    one_class = {"auc": None, "logloss": 0.55, "examples": 5000, "label_rate": 1.0}
    seq = job.commit(one_class)
    assert sm.poll() == seq


def test_pin_and_rollback_work_with_a_held_commit(job):
    first = job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root, gate=GATE)
    bad = job.commit(q(0.50))
    assert sm.poll() == first
    assert sm.pin() == first and sm.poll() == first
    assert sm.rollback(bad) == bad and job.serves(sm, bad) and sm.pinned   # the operator serves it anyway
    assert sm.rollback(first, then="resume") == first and job.serves(sm, first)
    assert sm.admin_status()["held_commits"] == [bad] and not sm.pinned  # the gate holds again
    good = job.commit(q(0.79))
    assert sm.poll() == good and job.serves(sm, good)


def test_without_a_gate_every_commit_is_served(job):
    job.commit(q(0.80))
    sm = serving_loader.ServingModel(job.export, job.mgr.root)
    seq = job.commit(q(0.10, 5.0))
    assert sm.poll() == seq and "held" not in sm.admin_status()


@pytest.mark.parametrize("text", ["", "auc >=", "auc >= 0.5,", "accuracy >= 0.5", "auc >= best", "auc == served",
                                  "auc >= served.precision", "auc >= __import__('os')", "auc >= 'x'",
                                  "0.5 <= auc", "auc >= 0.5 >= 0.1"])
def test_a_malformed_gate_is_refused_with_a_one_line_error(committed_job, text):
    with pytest.raises(GateError) as e:
        serving_loader.ServingModel(committed_job.export, committed_job.mgr.root, gate=text)
    assert "\n" not in str(e.value) and str(e.value)


def test_the_default_gate_parses_and_names_its_clauses():
    g = Gate.parse("default")
    assert [c.text for c in g.clauses] == ["auc >= reference - 0.01", "reference.auc >= 0.5 + (served - 0.5) / 2",
                                           "auc >= 0.5 + (served - 0.5) / 2"]
    assert g.decide(dict(q(0.60), reference=q(0.62)), q(0.80)).count("is not") == 3


def test_reference_names_the_same_examples_scored_by_the_model_a_commit_replaces():
    g = Gate.parse("auc >= reference - 0.01, logloss <= reference.logloss * 1.1")
    harder_window = dict(q(0.70, 0.60), reference=q(0.705, 0.61))
    assert g.decide(harder_window, q(0.80, 0.50)) is None              # worse than served, not than its predecessor
    worse = dict(q(0.70, 0.60), reference=q(0.75, 0.50))
    assert g.decide(worse, q(0.80)) == ("auc 0.7 is not >= 0.74 (auc >= reference - 0.01); "
                                        "logloss 0.6 is not <= 0.55 (logloss <= reference.logloss * 1.1)")
    assert g.decide(q(0.10), q(0.80)) is None                          # a record without a reference: not judged


def test_the_default_gate_holds_poison_that_the_reference_alone_passes():
    """On poisoned labels the trained model beats the reference (which scores them worse still), even
    once it ranks them well: the trusted reference's lost lift holds it; a harder window passes."""
    default, alone = Gate.parse("default"), Gate.parse("auc >= reference - 0.01")
    served = q(0.80)
    for poisoned in (dict(q(0.30), reference=q(0.22)), dict(q(0.72), reference=q(0.25))):   # learned, later
        assert alone.decide(poisoned, served) is None and default.decide(poisoned, served) is not None
    harder = dict(q(0.70), reference=q(0.70))
    assert default.decide(harder, served) is None and Gate.parse(GATE).decide(harder, served) is not None
    assert default.decide(q(0.60), served) is not None     # without a reference: the model's own lift


def test_a_clause_may_judge_the_reference_models_metric():
    g = Gate.parse("reference.logloss <= served * 1.5")
    assert g.decide(dict(q(0.7, 0.5), reference=q(0.7, 0.9)), q(0.8, 0.5)) == \
        "reference.logloss 0.9 is not <= 0.75 (reference.logloss <= served * 1.5)"


def test_serve_refuses_a_malformed_gate_at_start_in_one_line(tmp_path, job):
    job.commit(q(0.8))
    p = evstore("serve", "--export", job.export, "--checkpoints", job.mgr.root, "--gate", "auc >= served -",
                "--port", "-1", "--rest_api_port", "0")
    assert p.returncode == 1
    assert last_line(p.stderr).startswith("evstore serve: gate clause 1 'auc >= served -': not an expression")


def test_a_served_process_reports_the_hold_in_status_admin_and_metrics(tmp_path, job):
    first = job.commit(q(0.80))
    bad = job.commit(q(0.50))
    server = Server(str(tmp_path), job.export, job.mgr.root, name="ctr",
                    extra=["--gate", GATE, "--gate-max-hold-commits", "1"])
    try:
        status, body = server.call("GET", "/v1/models/ctr")
        (v,) = body["model_version_status"]
        assert status == 200 and v["version"] == str(first) and v["state"] == "AVAILABLE"
        assert v["status"]["error_message"].startswith(f"held by the quality gate: commit {bad}: auc 0.5 is not")
        _, st = admin(server)
        assert st["held"] is True and st["held_version"] == first and st["held_commits"] == [bad]
        assert st["gate"] == GATE and st["overdue"] is True and st["max_hold_commits"] == 1
        m = metrics(server)
        assert m["evstore_serving_gate_held"] == 1 and m["evstore_serving_gate_held_version"] == first
        assert m["evstore_serving_gate_held_commits"] == 1 and m["evstore_serving_gate_held_back_total"] == 1
        assert m["evstore_serving_gate_overdue"] == 1 and m["evstore_serving_gate_behind_commits"] == 1
        assert m["evstore_serving_gate_overdue_holds_total"] == 1
        good = job.commit(q(0.80))
        wait_until(lambda: admin(server)[1]["version"] == good, f"commit {good} served")
        m = metrics(server)
        assert m["evstore_serving_gate_held"] == 0 and m["evstore_serving_gate_held_version"] == -1
        assert m["evstore_serving_gate_held_back_total"] == 1 and m["evstore_serving_gate_overdue"] == 0
        _, body = server.call("GET", "/v1/models/ctr")
        assert body["model_version_status"][0]["status"]["error_message"] == ""
    finally:
        assert server.stop() == 0


def test_a_stream_of_small_commits_with_a_poisoned_stretch_is_never_served_poisoned(tmp_path):
    """The reported stream: a delta every 256 examples (every commit under min_examples), the
    labels inverted for a stretch; the gated server never serves a commit that trained on it."""
    from evstore_app.job.synthetic import SPEC, ClickStream
    from evstore_app.job.trainer import Trainer

    tr = Trainer(dict(SPEC, batch_size=128), str(tmp_path / "ckpt"), keep_chains=None)
    serving_loader.ensure_serving_export(tr.model, str(tmp_path / "export"))
    stream = ClickStream(seed=0, batch_size=128)
    tr.manager.save_full(metadata=tr.metadata(), quality=tr.quality)
    sm = serving_loader.ServingModel(str(tmp_path / "export"), tr.manager.root, gate="default")
    poisoned, clean = set(), []
    for b in range(56):
        cols, y = stream.batch(b)
        x = tr.inputs(cols)
        tr.train(x, 1 - y if 24 <= b < 34 else y, b + 1, tr.predict(x))
        if b % 2 == 1:
            seq = tr.manager.save_delta(metadata=tr.metadata(), quality=tr.quality)
            (poisoned.add(seq) if 24 <= b < 35 else clean.append(seq))
            sm.poll()
    served = set(sm.gate.served_versions)
    assert len(poisoned) == 5 and not poisoned & served                  # never served, however small
    assert set(clean[:12]) & served and sm.gate.held_back_total >= 5     # it served before the stretch
