"""The training loop shared by `evstore demo` and `evstore train`.

Each batch is first predicted (progressive evaluation: every event is scored
before the model trains on it), then trained on under the checkpoint
manager's lock, so every scheduled delta or full is the exact state after a
batch and records the input position (`{"position": ..., "examples": ...}`)
that a restarted job resumes from: no example lost or trained twice. The
scores of the examples trained since the last commit give that commit's
quality record (evstore.quality, `Trainer.quality`), stored in its manifest,
with the same examples' scores by the reference model (the model the commit
replaces, evstore_app/job/reference.py) in the record's `reference`.
"""
import threading
import time

import numpy as np
import tensorflow as tf

import checkpoint
from evstore.quality import ProgressiveQuality, auc
from evstore_app.job.model import build_model, field_ev, model_inputs
from evstore_app.job.reference import ReferenceModel

__all__ = ["Trainer", "auc"]

# TensorBoard scalars through tf.summary.write (tf.summary.scalar needs the
# tensorboard package, which the job does not depend on).
_SCALAR = tf.compat.v1.SummaryMetadata(plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))


def _scalar(tag, value):
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=_SCALAR)


class Trainer:
    """A model built from `spec`, trained batch by batch, checkpointed under `root`
    (`serving_view`: also a lower-precision view of the served rows in every
    commit, CheckpointManager's argument). `reference`: score every batch
    with the reference model too (module docstring; False: records carry no
    `reference`); `reference_gate` / `reference_min_examples`: the judgement
    a run must pass for the reference to become its model (None:
    evstore.gate.DEFAULT_GATE / DEFAULT_MIN_EXAMPLES; `evstore train --guard`
    passes its own)."""

    def __init__(self, spec, root, keep_chains=3, seed=0, serving_view=None, reference=True,
                 reference_gate=None, reference_min_examples=None):
        self.spec = spec
        self.model = build_model(spec, seed=seed)
        self.reference = (ReferenceModel(spec, seed=seed, gate=reference_gate, min_examples=reference_min_examples)
                          if reference else None)
        if self.reference is not None:
            self.reference.restart(self.model)
        self.manager = checkpoint.CheckpointManager(
            root, self.model, keep_chains=keep_chains, serving_view=serving_view,
            on_evict=None if self.reference is None else self.reference.evicted)
        self.position = 0
        self.examples = 0
        self.losses = []
        self.stop_event = threading.Event()
        self.started = time.time()
        self.resumed_at = None   # input position restored from the root (None: a new job)
        self.examples_at_start = 0
        self.timeline = []       # (seconds, examples, rows per EV, stats per EV)
        self.progressive = ProgressiveQuality()   # scores of the batches trained, keyed by examples after each

    @property
    def evs(self):
        return {f["name"]: field_ev(self.model, f["name"]) for f in self.spec["sparse"]}

    def metadata(self):
        return {"position": self.position, "examples": self.examples}

    def quality(self):
        """The quality record of the examples trained since the last commit
        (called under the manager's lock by each save, which it judges for
        the reference model: `ReferenceModel.advance`)."""
        last = self.manager.last_committed
        q = self.progressive.since(None if last is None else int(last.metadata.get("examples", 0)))
        if self.reference is not None:
            self.reference.advance(q, self.model)
        return q

    def resume(self, seq=None):
        """Restores the newest chain if the root has one (or the chain ending
        at commit `seq`: ValueError when the root has no such commit); returns
        the position to resume from."""
        if seq is not None:
            try:
                have = {m.seq for m in self.manager.chain(seq)}
            except checkpoint.CheckpointError:
                have = set()
            if seq not in have:
                raise ValueError(f"{self.manager.root} holds no committed checkpoint {seq} to resume from "
                                 "(`evstore ckpt inspect ROOT` lists them)")
            meta = self.manager.restore(seq=seq)
        elif self.manager.latest() is None:
            return 0
        else:
            meta = self.manager.restore()
        pos = meta.get("position", 0)
        self.position = pos if isinstance(pos, dict) else int(pos)   # a dict: a Kafka stream's offsets
        self.examples = self.examples_at_start = int(meta.get("examples", 0))
        self.resumed_at = self.position
        self.progressive = ProgressiveQuality()   # scores of batches after the commit restored belong to no commit
        if self.reference is not None:
            self.reference.restart(self.model)
        return self.position

    @property
    def session_examples(self):
        """Examples trained by this process (not counting those restored)."""
        return self.examples - self.examples_at_start

    def predict(self, x):
        """The model's probabilities for inputs `x`."""
        return self.model.predict_on_batch(x).reshape(-1)

    def score(self, x):
        """(the model's probabilities for `x`, the reference model's or None):
        a batch's progressive scores, before training on it."""
        if self.reference is None:
            return self.predict(x), None
        p = self.predict(x)
        with self.manager.lock:   # not while a commit's seal moves the reference
            return p, self.reference.predict(x)

    def train(self, x, y, position, scores=None, reference=None):
        """Trains on one batch. `scores` / `reference`: its predictions by the
        model and the reference model before training (`score`; progressive
        validation), recorded for the next commit's quality."""
        with self.manager.lock:
            if self.reference is not None:
                self.reference.keep(x)   # the reference's values of the rows this batch changes
            loss = float(self.model.train_on_batch(x, y.reshape(-1, 1)))
            self.position = position
            self.examples += len(y)
            if scores is not None:
                self.progressive.record(self.examples, y, scores, reference)
        self.losses.append(loss)
        return loss

    def inputs(self, cols):
        return model_inputs(self.spec, cols)

    def snapshot_stats(self):
        stats = {n: ev.stats() for n, ev in self.evs.items()}
        self.timeline.append({"t": round(time.time() - self.started, 2), "examples": self.examples,
                              "rows": {n: int(s["admitted"]) for n, s in stats.items()},
                              "filtered": {n: int(s["filtered"]) for n, s in stats.items()},
                              "evicted": {n: int(s.get("evicted", 0)) for n, s in stats.items()}})
        return stats

    def write_summaries(self, writer, step, extra=None):
        if writer is None:
            return
        with writer.as_default(step=step):
            if self.losses:
                _scalar("train/loss", np.mean(self.losses[-50:]))
            last = self.timeline[-1] if self.timeline else None
            if last:
                for n, r in last["rows"].items():
                    _scalar(f"table/{n}/rows", r)
                    _scalar(f"table/{n}/filtered", last["filtered"][n])
                    _scalar(f"table/{n}/evicted", last["evicted"][n])
                _scalar("train/examples_per_s", self.session_examples / max(time.time() - self.started, 1e-9))
            for k, v in (extra or {}).items():
                if v == v:  # not nan
                    _scalar(k, v)
        writer.flush()
