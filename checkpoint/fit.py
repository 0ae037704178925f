"""Checkpoints from `model.fit`: a Keras callback that commits between training steps (docs/guides/keras.md).

    model.compile(optimizer=evstore.optimizers.Adam(1e-3), loss="binary_crossentropy",
                  metrics=[checkpoint.QualityMetric()])          # optional: each commit's quality
    cb = checkpoint.CheckpointCallback("/data/ckpt", delta_every=100, full_every=5000)
    model.fit(dataset, epochs=5, callbacks=[cb])                 # a restarted fit resumes exactly

`CheckpointCallback` commits a delta every `delta_every` training steps and
a full every `full_every` (and a delta at the end of each epoch and of
training), from `on_train_batch_end`: between two steps, so every commit is
the exact state after a step. Each commit's metadata is the input position
it can know, `{"epoch": e, "step": s}`: `s` batches of epoch `e` trained (at
the end of an epoch: the next epoch, step 0). On `on_train_begin` it
restores the newest chain of the root, like `keras.callbacks.BackupAndRestore`,
and resumes there: fit starts at epoch `e`, and the first `s` batches of
that epoch are read and skipped, not trained (the model's `train_function`
only draws them from the iterator). With deterministic input (the same
batches in the same order each time the dataset is iterated) a fit killed
at any point and run again ends exactly as the uninterrupted one.

`QualityMetric` is a Keras metric that keeps the per-label score histograms
of evstore.quality. Keras computes compiled metrics from the forward pass of
each training step, before the update: progressive validation. The callback
gives each commit the record of the steps since the previous commit (the
histograms' difference), which the quality gate and the trainer's guard
judge (docs/guides/quality-gate.md). Without the metric commits carry no
quality.

Under the strategies of docs/guides/keras.md: without one, under
OneDeviceStrategy, a MirroredStrategy of one device and
CentralStorageStrategy a root becomes a CheckpointManager. Keras 3's
model.fit does not train under ParameterServerStrategy: it has no
ClusterCoordinator support, and its input fails on the coordinator before
any callback runs (tests/cluster/test_cluster_fit_callback.py); a
parameter-server job commits with a CheckpointManager between the steps it
schedules (docs/guides/parameter-server.md). Under MultiWorkerMirroredStrategy, where the model's tables
are collective (each worker holds a shard), a root becomes a
SyncCheckpointManager: every worker runs fit and the callback, and each commit
is collective, at the same step on every worker (steps are counted alike on
all of them). With a QualityMetric each worker gives the commit the
histograms of its own examples since the previous commit, and the chief adds
them (evstore.quality.merge): the commit's record covers every worker's
examples of the steps it follows. Tested without a strategy
(tests/checkpoint/test_fit_callback.py) and with two workers under
MultiWorkerMirroredStrategy (tests/collective/test_collective_fit.py), a
SIGKILL mid-epoch and a resume included.
"""
import keras
import numpy as np
import tensorflow as tf

from checkpoint.collect import collect
from checkpoint.manager import CheckpointManager
from evstore import quality as _quality

__all__ = ["CheckpointCallback", "QualityMetric"]


class QualityMetric(keras.metrics.Metric):
    """Per-label histograms of the predicted probabilities (evstore.quality's
    HIST_BINS bins in logit) and the summed cross-entropy, over the examples
    of the metric's state; `result()` is their AUC. `y_pred`: probabilities
    of the positive class; `y_true`: 0 / 1."""

    def __init__(self, name="evstore_quality", **kwargs):
        super().__init__(name=name, **kwargs)
        n = _quality.HIST_BINS
        self.pos = self.add_variable(shape=(n,), initializer="zeros", dtype="float64", name="pos")
        self.neg = self.add_variable(shape=(n,), initializer="zeros", dtype="float64", name="neg")
        self.loss = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="loss")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y = tf.reshape(tf.cast(y_true, tf.float64), [-1])
        p = tf.clip_by_value(tf.reshape(tf.cast(y_pred, tf.float64), [-1]), 1e-7, 1 - 1e-7)
        z = tf.clip_by_value(tf.math.log(p) - tf.math.log1p(-p), -_quality.HIST_LOGIT, _quality.HIST_LOGIT)
        scale = _quality.HIST_BINS / (2 * _quality.HIST_LOGIT)
        b = tf.minimum(tf.cast((z + _quality.HIST_LOGIT) * scale, tf.int32), _quality.HIST_BINS - 1)
        pos = y > 0.5
        n = _quality.HIST_BINS
        self.pos.assign_add(tf.math.bincount(tf.boolean_mask(b, pos), minlength=n, maxlength=n, dtype=tf.float64))
        self.neg.assign_add(tf.math.bincount(tf.boolean_mask(b, ~pos), minlength=n, maxlength=n, dtype=tf.float64))
        self.loss.assign_add(-tf.reduce_sum(y * tf.math.log(p) + (1 - y) * tf.math.log1p(-p)))

    def counts(self, strategy=None):
        """(pos, neg, loss) as numpy: the state's histograms and summed loss.

        With `strategy` (the model's), those of this process's replicas only:
        the metric's variables sum on read over every replica, which under
        MultiWorkerMirroredStrategy is a collective across the workers."""
        if strategy is None:
            pos, neg, loss = (v.numpy() for v in (self.pos, self.neg, self.loss))
        else:
            pos, neg, loss = (np.sum([np.asarray(r) for r in strategy.experimental_local_results(v.value)], axis=0)
                              for v in (self.pos, self.neg, self.loss))
        return np.asarray(pos, np.int64), np.asarray(neg, np.int64), float(loss)

    def result(self):
        pos, neg = self.pos, self.neg
        below = tf.cumsum(neg) - neg
        n_pos, n_neg = tf.reduce_sum(pos), tf.reduce_sum(neg)
        return tf.math.divide_no_nan(tf.reduce_sum(pos * (below + 0.5 * neg)), n_pos * n_neg)


def _positive_int(name, v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"CheckpointCallback: {name} must be a number of steps >= 1 or None, got {v!r}")


def _manager(root, model, keep_chains, serving_view, storage_options):
    """A SyncCheckpointManager when the model's tables are split over several workers, else a CheckpointManager."""
    workers = {getattr(t, "num_workers", 1) for t in collect(model).sharded.values()}
    if max(workers, default=1) > 1:
        from checkpoint.sync import SyncCheckpointManager
        if serving_view is not None:
            raise ValueError("CheckpointCallback: serving_view is not written by synchronous (collective) commits")
        return SyncCheckpointManager(root, model, keep_chains=keep_chains, storage_options=storage_options)
    return CheckpointManager(root, model, keep_chains=keep_chains, serving_view=serving_view,
                             storage_options=storage_options)


class CheckpointCallback(keras.callbacks.Callback):
    """Commits fulls and deltas between the training steps of `model.fit` and
    resumes a restarted fit where the newest commit left it (module docstring).

    Args:
      root: a checkpoint root (path or fsspec URL), or a CheckpointManager of
        the fitted model (then `keep_chains`, `serving_view`,
        `storage_options` are its own). A root becomes a SyncCheckpointManager
        when the model's tables are collective (MultiWorkerMirroredStrategy),
        else a CheckpointManager.
      delta_every: training steps between deltas (None: only at the end of
        each epoch and of training).
      full_every: training steps between fulls (None: only the first commit
        of a new root is a full).
      restore: restore the newest chain on `on_train_begin` and resume there.
      keep_chains, serving_view, storage_options: CheckpointManager's.

    Attributes after `on_train_begin`: `manager`; `resumed` ({"epoch",
    "step", "seq"} restored, or None).

    Raises:
      ValueError: a step count that is not an integer >= 1.
    """

    def __init__(self, root, delta_every=None, full_every=None, restore=True, keep_chains=3, serving_view=None,
                 storage_options=None):
        super().__init__()
        _positive_int("delta_every", delta_every)
        _positive_int("full_every", full_every)
        self._root = root
        self.delta_every, self.full_every, self.restore = delta_every, full_every, restore
        self._manager_kw = dict(keep_chains=keep_chains, serving_view=serving_view, storage_options=storage_options)
        self.manager = root if isinstance(root, CheckpointManager) else None
        self.resumed = None
        self._epoch, self._step, self._steps_since_full = 0, 0, 0
        self._seen = None      # the quality metric's counts at the last commit (or the epoch's start)
        self._sync = False     # the manager is a SyncCheckpointManager: collective commits

    # ---- quality ---------------------------------------------------------------
    def _metric(self):
        for m in getattr(self.model, "metrics", []):
            for sub in [m] + list(getattr(m, "metrics", [])):   # Keras wraps compiled metrics in a container
                if isinstance(sub, QualityMetric):
                    return sub
        return None

    def _quality(self):
        """The record of the steps since the last commit (None: no QualityMetric). Collective commits: this
        worker's examples only; the SyncCheckpointManager adds the workers' histograms."""
        m = self._metric()
        if m is None:
            return None
        now = m.counts(self.model.distribute_strategy if self._sync else None)
        pos, neg, loss = now
        if self._seen is not None:
            pos, neg, loss = pos - self._seen[0], neg - self._seen[1], loss - self._seen[2]
        self._seen = now
        return _quality.from_hist(pos, neg, max(loss, 0.0))

    # ---- commits ---------------------------------------------------------------
    def _commit(self, full=False):
        meta = {"epoch": self._epoch, "step": self._step}
        q = self._quality()
        if full or self.manager.last_committed is None:
            self.manager.save_full(metadata=meta, quality=q)
            self._steps_since_full = 0
        else:
            self.manager.save_delta(metadata=meta, quality=q)

    def on_train_begin(self, logs=None):
        if self.manager is None:
            self.manager = _manager(self._root, self.model, **self._manager_kw)
        from checkpoint.sync import SyncCheckpointManager
        self._sync = isinstance(self.manager, SyncCheckpointManager)
        if self.restore and self.manager.latest() is not None:
            meta = self.manager.restore()
            self._epoch, self._step = int(meta.get("epoch", 0)), int(meta.get("step", 0))
            self.resumed = {"epoch": self._epoch, "step": self._step, "seq": self.manager.last_committed.seq}
            self.model._initial_epoch = self._epoch   # what BackupAndRestore sets: fit starts at this epoch
            if self._step:
                self._skip(self._step)

    def _skip(self, n):
        """The next `n` calls of the model's train_function draw a batch and train nothing."""
        train, left = self.model.train_function, [n]

        def skip(iterator):
            next(iterator)
            left[0] -= 1
            if left[0] == 0:
                self.model.train_function = train
            return {}
        self.model.train_function = skip

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if not (self.resumed and epoch == self.resumed["epoch"]):
            self._step = 0
        self._seen = None   # Keras reset the metrics

    def on_train_batch_end(self, batch, logs=None):
        if self.resumed and self._epoch == self.resumed["epoch"] and batch < self.resumed["step"]:
            return   # a skipped batch of the resumed epoch
        self._step = batch + 1
        self._steps_since_full += 1
        if self.full_every is not None and self._steps_since_full >= self.full_every:
            self._commit(full=True)
        elif self.delta_every is not None and self._step % self.delta_every == 0:
            self._commit()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step = epoch + 1, 0
        self._commit()

    def on_train_end(self, logs=None):
        if self.manager is not None and self.manager.last_committed is None:
            self._commit()
