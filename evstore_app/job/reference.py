"""The reference model of a training job: the model a commit replaces, scoring the same examples.

A quality gate that compares a commit's progressive quality with the served
commit's compares two windows of data, and windows differ in difficulty. The
trainer therefore also scores every batch with a second copy of the model,
the *reference*: the trainer's model as of the last commit that ended a run
passing the trainer's own judgement, the gate a server applies (evstore.gate:
DEFAULT_GATE, or `evstore train --guard`'s expression, judging runs of
`min_examples` as `Gate.admit` does). Each commit's quality record then
carries `reference`, the reference's record on the same examples
(evstore.quality), which a gate names as `reference` (evstore/gate.py). A
server with the same gate serves the same runs, so the reference is the model
the served commit replaces: a model trusted, not the newest one (a poisoned
stretch fails, and the reference stays the model before it).

The copy is exact (every row value of every EV and every dense weight; not
the optimizer's slots, which scoring does not read) and is taken under the
checkpoint manager's lock at the commit's seal, so it is the committed
state. It costs one export and import of each table per judged run, and a
second forward pass per batch; scoring with it admits no key and changes no
frequency (an inference lookup).
"""
import numpy as np

from evstore.gate import DEFAULT_GATE, Gate
from evstore.quality import merge
from evstore_app.job.model import build_model, field_ev

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """A copy of a build_model model of `spec`, scoring batches; `advance`
    folds in each commit's record and takes a new copy when the run of
    commits since the last judged one passes `gate` (a gate expression,
    None: DEFAULT_GATE; runs of `min_examples`, None:
    DEFAULT_MIN_EXAMPLES). GateError for a malformed one."""

    def __init__(self, spec, seed=0, gate=None, min_examples=None):
        self.spec = spec
        self.gate = Gate.parse(DEFAULT_GATE if gate is None else gate, min_examples=min_examples)
        self.model = build_model(spec, seed=seed)
        self.served = None   # the record of the run that passed last (`served` of the judgement)
        self._since = []     # records of the commits since the last judged run

    def predict(self, x):
        """The reference's probabilities for model inputs `x`."""
        return self.model.predict_on_batch(x).reshape(-1)

    def copy_from(self, model):
        """Makes the reference an exact copy of `model`'s rows and dense weights."""
        for f in self.spec["sparse"]:
            src, dst = field_ev(model, f["name"]), field_ev(self.model, f["name"])
            rows = src.export()
            dst.load(rows["keys"], rows["values"], clear=True)
        for src_layer, dst_layer in zip(model.layers, self.model.layers):
            if src_layer.weights and not hasattr(dst_layer, "ev") and not hasattr(dst_layer, "embedding"):
                dst_layer.set_weights(src_layer.get_weights())   # dense layers (an Embedding's rows: above)

    def restart(self, model):
        """Training goes on from `model` (a new job, a resume): it is the reference, nothing judged yet."""
        self.copy_from(model)
        self.served, self._since = None, []

    def advance(self, quality, model):
        """A commit with record `quality` is sealed from `model` (called
        under the manager's lock): when the run since the last judged commit
        covers min_examples it is judged, and if it passes, `model` becomes
        the reference and the run `served`."""
        if quality is None:
            return
        self._since.append(quality)
        run = merge(self._since) or quality
        if not self.gate.judged(run):
            return
        self._since = []
        if self.gate.decide(run, self.served) is None:
            self.copy_from(model)
            self.served = run
