"""The chief of a parameter-server training job (`evstore train-cluster`).

The chief connects to a cluster of PS and worker tasks (`evstore server`, see
evstore_app.cluster) with `ParameterServerStrategy`, builds a small CTR model on
the synthetic click stream (evstore_app.job.synthetic.ClickStream) whose
embedding tables are ShardedEmbeddingVariables with one shard per PS, and
trains it by scheduling one function per batch on a `ClusterCoordinator`.

Model: `logit = sum_f <emb_f(id_f), w_f> + w_hour * hour + bias` over the
fields user, item and category; sigmoid cross-entropy; evstore SGD (fused
sparse updates on the PS holding each shard). The global step is a PS-side
int64 variable incremented by each step (`assign_add`, exact under
concurrent workers) and stamped into the versions of the keys it updates.

Input position and checkpoints: batch b of the stream is a pure function of
(seed, b). The chief schedules batches in order; every `delta_every` batches
it waits for the scheduled steps (`coord.join()`) and commits a checkpoint
(the first one of a chain full, then deltas; a full every `full_every`
batches) whose metadata holds the position, the number of batches trained.
A restarted job restores the newest chain and resumes at that position, so
no batch is lost or trained twice (except by TF itself: a function running
on a worker that dies is re-run elsewhere, see "When a task dies" in
docs/guides/parameter-server.md).

`ClusterJob(local=True)` runs the same model and steps in this process with
unsharded EVs and no cluster: the single-process reference.
"""
import functools
import time

import numpy as np
import tensorflow as tf

import checkpoint
import evstore
from evstore.quality import ProgressiveQuality
from evstore_app.job.reference import Reference
from evstore_app.job.synthetic import ClickStream

__all__ = ["CtrModel", "CtrReference", "ClusterJob", "FIELDS", "run"]

FIELDS = (("user", 8), ("item", 8), ("category", 4))
BANK = 512


class CtrModel(tf.Module):
    """Embeddings of user, item and category, each dotted with a weight vector.

    Args:
      shards: shards of each embedding table (None: unsharded EVs).
      seed: seeds the initializer banks and the dense weights (two models
        with the same seed start equal, sharded or not).
      table: makes each table, table(name, dim, **ev_kwargs) (default: an
        EmbeddingVariable of `shards` shards).
      storage: the default tables' storage (evstore.TieredStorage: each
        shard's rows in a DRAM cache over a tier on its own task's disk).
    """

    def __init__(self, shards=None, seed=0, table=None, storage=None):
        super().__init__(name="ctr")
        rng = np.random.default_rng(seed)
        self.tables = {}
        self.weights = {}
        table = table or functools.partial(evstore.EmbeddingVariable, shards=shards, storage=storage)
        for field, dim in FIELDS:
            bank = rng.normal(0.0, 0.05, size=(BANK, dim)).astype(np.float32)
            self.tables[field] = table(field, dim, initializer=tf.constant_initializer(bank),
                                       initializer_bank_size=BANK)
            self.weights[field] = tf.Variable(rng.normal(0.0, 0.5, size=(dim,)).astype(np.float32), name=f"w_{field}")
        self.w_hour = tf.Variable(0.1, name="w_hour")
        self.bias = tf.Variable(-0.5, name="bias")

    def __call__(self, ids, hour, training=True):
        logit = self.w_hour * hour + self.bias
        # One exchange per parameter server for all tables (evstore/group.py).
        names = [f for f, _ in FIELDS]
        rows = evstore.embedding_lookup_group([self.tables[f] for f in names], [ids[f] for f in names],
                                              training=training)
        for field, r in zip(names, rows):
            logit += tf.reduce_sum(r * self.weights[field], axis=-1)
        return logit

    @property
    def train_vars(self):
        """What gradients are taken of: every (shard) EV, then the dense weights."""
        out = []
        for field, _ in FIELDS:
            t = self.tables[field]
            out.extend(t.trainable_variables)
        return out + [self.weights[f] for f, _ in FIELDS] + [self.w_hour, self.bias]

    def state(self):
        """Every table's rows (sorted by key: keys, values, versions, freqs) and dense weight, as numpy."""
        out = {}
        for field, _ in FIELDS:
            e = self.tables[field].export()
            keys = e["keys"].numpy()
            order = np.argsort(keys, kind="stable")
            for k in ("keys", "values", "versions", "freqs"):
                out[f"{field}/{k}"] = e[k].numpy()[order]
        for field, _ in FIELDS:
            out[f"w_{field}"] = self.weights[field].numpy()
        out["w_hour"], out["bias"] = self.w_hour.numpy(), self.bias.numpy()
        return out


class CtrReference(Reference):
    """The reference of a CtrModel (evstore_app/job/reference.py): a CtrModel
    of its own, built where the trained one is (`shards` shards, under the
    same strategy scope, so shard i of each of its tables sits beside shard i
    of the trained one), holding only the rows kept since its commit, in
    DRAM. `gate` / `min_examples`: Reference's."""

    def __init__(self, shards=None, seed=0, gate=None, min_examples=None):
        self.model = CtrModel(shards=shards, seed=seed)
        super().__init__(dict(self.model.tables), gate=gate, min_examples=min_examples)

    def live_evs(self, model):
        return dict(model.tables)

    def copy_dense(self, model):
        for field, _ in FIELDS:
            self.model.weights[field].assign(model.weights[field])
        self.model.w_hour.assign(model.w_hour)
        self.model.bias.assign(model.bias)


class ClusterJob:
    """The chief of a PS training job on the click stream (or, `local=True`, the same job in-process).

    Args:
      cluster: the cluster (a JSON file, a dict or None: `TF_CONFIG`; see
        evstore_app.cluster.load_cluster). Ignored when `local`.
      checkpoints: checkpoint root every task can reach (None: no checkpoints).
      batch_size: examples per batch (one scheduled step).
      seed: the stream's and the model's seed.
      learning_rate: SGD learning rate.
      delta_every: batches between checkpoints (a delta, or the chain's first full).
      full_every: batches between fulls (None: only the first checkpoint is a full).
      keep_chains: chains kept under `checkpoints`.
      shards: shards per table (default: the number of PS tasks).
      local: train in this process with unsharded EVs (no cluster).
      storage: the tables' storage (CtrModel's; None: all rows in DRAM).
      lease_timeout, take_over: the checkpoint root's writer lease
        (CheckpointManager's): a new chief on another host, after the old
        one's host died, waits `lease_timeout` seconds for the dead holder's
        lease to go stale, or takes it at once with `take_over=True` (the
        operator asserts the old chief is gone).
      serving_view: None, or the dtype of a serving view in every commit
        (CheckpointManager's; each PS streams its part's view).
      reference: score every batch with the reference model too (a
        CtrReference), recorded in each commit's quality['reference'] (False:
        records carry none); `reference_gate`, `reference_min_examples`: its
        judgement (Reference's gate and min_examples).

    Raises:
      ValueError: a bad cluster or argument (the message names it).
    """

    def __init__(self, cluster=None, checkpoints=None, batch_size=256, seed=0, learning_rate=0.05,
                 delta_every=20, full_every=None, keep_chains=3, shards=None, local=False, storage=None,
                 lease_timeout=60.0, take_over=False, serving_view=None, reference=True, reference_gate=None,
                 reference_min_examples=None):
        for name, v in (("batch_size", batch_size), ("delta_every", delta_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int)
                                       or full_every < 1):
            raise ValueError(f"full_every must be an int >= 1 or None, got {full_every!r}")
        self.stream = ClickStream(seed=seed, batch_size=batch_size, users=20_000, items=10_000)
        self.delta_every, self.full_every = delta_every, full_every
        self.coord = None
        if local:
            self.strategy = tf.distribute.get_strategy()
            self.num_ps = 0
            shards = None
        else:
            from evstore_app.cluster import load_cluster

            spec = load_cluster(cluster)
            if "ps" not in spec or "worker" not in spec or "chief" not in spec:
                raise ValueError(f"cluster: a PS job needs 'chief', 'ps' and 'worker' jobs, got {sorted(spec)}")
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
            self.strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
            self.coord = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
            self.num_ps = len(spec["ps"])
            shards = self.num_ps if shards is None else shards
        with self.strategy.scope():   # shard i on PS i % num_ps
            self.model = CtrModel(shards=shards, seed=seed, storage=storage)
            self.optimizer = evstore.optimizers.SGD(learning_rate)
            # Built here, under the scope (its variables on the PS), not inside a scheduled function;
            # an EV's optimizer variable is its proxy (what `apply` maps it to).
            self.optimizer.build([v.proxy if isinstance(v, evstore.EmbeddingVariable) else v
                                  for v in self.model.train_vars])
            self.global_step = tf.Variable(0, dtype=tf.int64, name="step", trainable=False)
            # Only a job that commits has records to carry the reference's scores.
            self.reference = (CtrReference(shards=shards, seed=seed, gate=reference_gate,
                                           min_examples=reference_min_examples)
                              if reference and checkpoints is not None else None)
        self.manager = None
        if checkpoints is not None:
            self.manager = checkpoint.CheckpointManager(
                checkpoints, self.model, global_step=self.global_step, keep_chains=keep_chains,
                lease_timeout=lease_timeout, take_over=take_over, serving_view=serving_view,
                on_evict=None if self.reference is None else self.reference.evicted)
        if self.reference is not None:
            self.reference.restart(self.model)
        self.position = 0
        self.commits = []          # (seq, kind, position) of this process's commits
        self.progressive = ProgressiveQuality()   # scored batches, keyed by the position after each
        self._scored = []          # (position, labels, step output) not yet in `progressive`
        self._step = self._make_step()

    def _make_step(self):
        model, opt, step, strategy = self.model, self.optimizer, self.global_step, self.strategy
        ref = None if self.reference is None else self.reference.model

        def fn(user, item, category, hour, label):
            ids = {"user": user, "item": item, "category": category}
            variables = model.train_vars
            with tf.GradientTape() as tape:
                logits = model(ids, hour)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(label, logits))
            grads = tape.gradient(loss, variables)
            # The reference's scores: its rows of these ids were kept before the step was scheduled (`train`).
            ref_scores = tf.zeros([0]) if ref is None else tf.sigmoid(ref(ids, hour, training=False))
            opt.apply_gradients(zip(grads, variables), global_step=step.assign_add(1))
            return loss, tf.sigmoid(logits), ref_scores   # scores from before this step's update: progressive

        @tf.function
        def train_step(user, item, category, hour, label):
            return strategy.run(fn, args=(user, item, category, hour, label))

        return train_step

    def quality(self):
        """The quality record of the batches trained since the last commit
        (called under the manager's lock by each save, after `join`)."""
        for position, labels, out in self._scored:
            out = out.fetch() if hasattr(out, "fetch") else out   # a scheduled step's RemoteValue
            self.progressive.record(position, labels, np.asarray(out[1]),
                                    None if self.reference is None else np.asarray(out[2]))
        self._scored = []
        last = self.manager.last_committed
        q = self.progressive.since(None if last is None else int(last.metadata["position"]))
        if self.reference is not None:
            self.reference.advance(q, self.model)
        return q

    def batch(self, b):
        """Batch b's step arguments (user, item, category, hour, label tensors)."""
        cols, label = self.stream.batch(b)
        return tuple(tf.constant(cols[c]) for c in ("user", "item", "category", "hour")) + (tf.constant(label),)

    def resume(self):
        """Restores the newest chain if there is one; returns the position (batches trained) to resume at."""
        if self.manager is None or self.manager.latest() is None:
            return self.position
        meta = self.manager.restore()
        self.position = int(meta["position"])
        if self.reference is not None:
            self.reference.restart(self.model)
        return self.position

    def join(self):
        """Waits until every scheduled step ran (raises what a step raised)."""
        if self.coord is not None:
            self.coord.join()

    def save(self):
        """Waits for the scheduled steps and commits a checkpoint at the current position; returns its seq."""
        self.join()
        return commit_position(self.manager, self.position, self.full_every, self.commits, quality=self.quality)

    def train(self, steps, sync=False, on_commit=None):
        """Trains batches `position .. steps - 1`, committing every `delta_every` batches and at the end.

        Args:
          steps: the position to train up to (total batches of the job).
          sync: wait for each step before scheduling the next (a fixed order of
            updates, as in a single process); otherwise steps run concurrently
            on every worker.
          on_commit: called as on_commit(seq, position) after each commit.
        """
        while self.position < steps:
            args = self.batch(self.position)
            if self.reference is not None:
                # From the chief, in batch order, done before the step that updates them is scheduled:
                # whatever steps still run, a row is kept before any update of it since the reference's commit.
                self.reference.keep_ids({"user": args[0], "item": args[1], "category": args[2]})
            if self.coord is not None:
                out = self.coord.schedule(self._step, args=args)
                if sync:
                    self.coord.join()
            else:
                out = self._step(*args)
            self.position += 1
            if self.manager is not None:
                self._scored.append((self.position, args[-1].numpy(), out))
            if self.manager is not None and self.position % self.delta_every == 0:
                seq = self.save()
                if on_commit:
                    on_commit(seq, self.position)
        self.join()
        if self.manager is not None and (not self.commits or self.commits[-1][2] != self.position):
            seq = self.save()
            if on_commit:
                on_commit(seq, self.position)
        return self.position


def commit_position(manager, position, full_every, commits, quality=None):
    """Commits a checkpoint with the input position as metadata (the chain's
    first a full, then deltas, a full every `full_every` batches) and
    `quality` (the manager's quality= argument); appends (seq, kind,
    position) to `commits`; returns the seq."""
    full = manager.last_committed is None or (full_every is not None and position % full_every == 0)
    meta = {"position": position}
    seq = manager.save_full(meta, quality=quality) if full else manager.save_delta(meta, quality=quality)
    commits.append((seq, "full" if full else "delta", position))
    return seq


def run(cluster=None, checkpoints=None, steps=100, batch_size=256, seed=0, learning_rate=0.05, delta_every=20,
        full_every=None, sync=False, reference=True, log=print):
    """`evstore train-cluster`: resume from `checkpoints`, train up to `steps` batches, commit; returns a summary."""
    t0 = time.time()
    job = ClusterJob(cluster, checkpoints=checkpoints, batch_size=batch_size, seed=seed,
                     learning_rate=learning_rate, delta_every=delta_every, full_every=full_every,
                     reference=reference)
    start = job.resume()
    log(f"evstore train-cluster: {job.num_ps} PS, tables in {job.num_ps} shards; resuming at batch {start}")
    job.train(steps, sync=sync, on_commit=lambda seq, pos: log(f"committed seq={seq} position={pos}"))
    return {"resumed_at": start, "position": job.position, "global_step": int(job.global_step.numpy()),
            "commits": len(job.commits), "rows": {f: int(job.model.tables[f].size()) for f, _ in FIELDS},
            "seconds": round(time.time() - t0, 1)}
