"""The reference model of a training job: the model a commit replaces, scoring the same examples.

`Reference` is the one definition (its judgement, copy-on-write and moves);
`ReferenceModel` is that of `evstore train` / `demo` (a build_model model),
`cluster_train.CtrReference` that of `evstore train-cluster`.

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
import abc

import numpy as np
import tensorflow as tf

from evstore.gate import DEFAULT_GATE, Gate
from evstore.quality import merge
from evstore_app.job.model import build_model, field_ev

__all__ = ["Reference", "ReferenceModel"]


class Reference(abc.ABC):
    """The copy-on-write reference of a trainer's model, whatever builds the
    model (module docstring): the reference's own EVs `own` ({name: EV},
    each the trained model's EV of that name in dim, key dtype and shards),
    its judgement (`advance`) and its moves. A subclass says where a model's
    EVs and dense weights are (`live_evs`, `copy_dense`) and scores batches
    with its own model. `gate` / `min_examples`: the judgement a run of
    commits must pass for the reference to move to it (a gate expression,
    None: DEFAULT_GATE; None: DEFAULT_MIN_EXAMPLES). GateError for a
    malformed one."""

    def __init__(self, own, gate=None, min_examples=None):
        self.gate = Gate.parse(DEFAULT_GATE if gate is None else gate, min_examples=min_examples)
        self._own = own                       # the kept rows, by EV name
        self._live, self._field_of = {}, {}   # the trained model's EVs (move_to)
        self.served = None   # the record of the run that passed last (`served` of the judgement)
        self._since = []     # records of the commits since the last judged run

    @abc.abstractmethod
    def live_evs(self, model):
        """{name: EV} of the trained `model`, named as `own`."""

    @abc.abstractmethod
    def copy_dense(self, model):
        """Sets the reference's dense weights to `model`'s."""

    def keep_ids(self, ids):
        """Copies into the reference the rows of ids {name: ids} it does not
        hold yet, from the trained model: call it before the trained model
        trains on them, so their values are still the reference commit's (a
        key the table does not hold reads its default value, as it did).
        Returns how many rows were copied, once they are (remote shards too)."""
        # One native op per EV (per shard of a sharded one).
        return sum(int(self._own[name].keep_from(self._live[name], x)) for name, x in ids.items())

    def evicted(self, ev, keys, values):
        """A save's eviction removed `keys` (rows `values`) from the trained
        model's EV `ev` (or a shard of it; CheckpointManager's on_evict):
        keeps the rows of those the reference does not hold yet."""
        name = self._field_of.get(id(ev))
        if name is None or not len(keys):
            return
        own = self._own[name]
        fresh = np.logical_not(np.asarray(own.admitted(keys)))
        if fresh.any():
            own.load(keys[fresh], values[fresh])

    def move_to(self, model):
        """Makes `model`'s current state the reference (training goes on
        from it): drops the kept rows, copies the dense weights."""
        self._live = self.live_evs(model)
        self._field_of = {id(e): name for name, ev in self._live.items() for e in [ev, *getattr(ev, "shards", ())]}
        for own in self._own.values():
            own.load(tf.zeros([0], own.key_dtype), tf.zeros([0, own.dim]), clear=True)
        self.copy_dense(model)

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


class ReferenceModel(Reference):
    """The reference of a build_model model of `spec`: a copy-on-write copy
    (module docstring) scoring batches of model inputs. `gate` /
    `min_examples`: Reference's."""

    def __init__(self, spec, seed=0, gate=None, min_examples=None):
        self.spec = spec
        self.model = build_model(spec, seed=seed)
        super().__init__({f["name"]: field_ev(self.model, f["name"]) for f in spec["sparse"]}, gate=gate,
                         min_examples=min_examples)

    def live_evs(self, model):
        return {f["name"]: field_ev(model, f["name"]) for f in self.spec["sparse"]}

    def copy_dense(self, model):
        for src_layer, dst_layer in zip(model.layers, self.model.layers):
            if src_layer.weights and not hasattr(dst_layer, "ev") and not hasattr(dst_layer, "embedding"):
                dst_layer.set_weights(src_layer.get_weights())   # dense layers (an Embedding's rows: the EVs)

    def predict(self, x):
        """The reference's probabilities for model inputs `x` (keeps their rows first: `keep`)."""
        self.keep(x)
        return self.model.predict_on_batch(x).reshape(-1)

    def keep(self, x):
        """`keep_ids` of model inputs `x` (a split field's padding "" too: never read)."""
        self.keep_ids({f["name"]: x[f"{f['name']}_ids"] for f in self.spec["sparse"]})
