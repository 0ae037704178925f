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

The reference is exact (every row value of every EV and every dense weight
of the commit; not the optimizer's slots, which scoring does not read) and
copy-on-write: it reads the trained model's rows, except those training or
eviction changed since the reference's commit, whose values at the commit it
keeps in its own tables. Before a batch is scored or trained the rows of its
keys not kept yet are copied in (`keep`: their values now are still the
commit's), and a save's eviction hands over the rows it removes
(`evicted`, CheckpointManager's on_evict). So its memory is bounded by the
keys of the batches since its commit (the delta's), and moving it to a new
commit drops the kept rows and copies the dense weights: nothing is O(rows of
the table). Moves happen under the checkpoint manager's lock at a commit's
seal, after the save's eviction, so the reference is the committed state. A
second forward pass per batch remains; scoring admits no key and changes no
frequency of either model (inference lookups).
"""
import numpy as np
import tensorflow as tf

from evstore.gate import DEFAULT_GATE, Gate
from evstore.quality import merge
from evstore_app.job.model import build_model, field_ev

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """A copy-on-write copy of a build_model model of `spec` (module
    docstring), scoring batches; `advance` folds in each commit's record and
    moves to the trained model's state when the run of
    commits since the last judged one passes `gate` (a gate expression,
    None: DEFAULT_GATE; runs of `min_examples`, None:
    DEFAULT_MIN_EXAMPLES). GateError for a malformed one."""

    def __init__(self, spec, seed=0, gate=None, min_examples=None):
        self.spec = spec
        self.gate = Gate.parse(DEFAULT_GATE if gate is None else gate, min_examples=min_examples)
        self.model = build_model(spec, seed=seed)
        self._own = {f["name"]: field_ev(self.model, f["name"]) for f in spec["sparse"]}   # the kept rows
        self._live, self._field_of = {}, {}   # the trained model's EVs (move_to)
        self.served = None   # the record of the run that passed last (`served` of the judgement)
        self._since = []     # records of the commits since the last judged run

    def predict(self, x):
        """The reference's probabilities for model inputs `x` (keeps their rows first: `keep`)."""
        self.keep(x)
        return self.model.predict_on_batch(x).reshape(-1)

    def keep(self, x):
        """Copies into the reference the rows of the keys of inputs `x` it
        does not hold yet, from the trained model: call it before the trained
        model trains on `x`, so their values are still the reference commit's
        (a key the table does not hold reads its default value, as it did)."""
        for f in self.spec["sparse"]:   # one native op per field (a split field's padding "" too: never read)
            self._own[f["name"]].keep_from(self._live[f["name"]], x[f"{f['name']}_ids"])

    def evicted(self, ev, keys, values):
        """A save's eviction removed `keys` (rows `values`) from the trained
        model's EV `ev` (CheckpointManager's on_evict): keeps the rows of
        those the reference does not hold yet."""
        name = self._field_of.get(id(ev))
        if name is None or not len(keys):
            return
        own = self._own[name]
        fresh = np.logical_not(own.admitted(keys).numpy())
        if fresh.any():
            own.load(keys[fresh], values[fresh])

    def move_to(self, model):
        """Makes `model`'s current state the reference (training goes on
        from it): drops the kept rows, copies the dense weights."""
        self._live = {f["name"]: field_ev(model, f["name"]) for f in self.spec["sparse"]}
        self._field_of = {id(ev): name for name, ev in self._live.items()}
        for name, own in self._own.items():
            empty = tf.zeros([0], own.key_dtype)
            own.load(empty, tf.zeros([0, own.dim]), clear=True)
        for src_layer, dst_layer in zip(model.layers, self.model.layers):
            if src_layer.weights and not hasattr(dst_layer, "ev") and not hasattr(dst_layer, "embedding"):
                dst_layer.set_weights(src_layer.get_weights())   # dense layers (an Embedding's rows: above)

    def restart(self, model):
        """Training goes on from `model` (a new job, a resume): it is the reference, nothing judged yet."""
        self.move_to(model)
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
            self.move_to(model)
            self.served = run
