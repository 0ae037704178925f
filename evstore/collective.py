"""Synchronous training with model-parallel EVs on TensorFlow's collective runtime.

Under `tf.distribute.MultiWorkerMirroredStrategy` (W worker processes, one
CPU replica each) a `CollectiveEmbeddingVariable` is one embedding table split
by key over the workers: key k belongs to worker `shard_index(k, W)` (the
route of ShardedEmbeddingVariable, "mix64-v1", so checkpoints of either
restore into the other), and each worker holds its shard as an ordinary local
EmbeddingVariable (`cev.local`, named `<name>/part_<rank>`): filters,
eviction, versions, dirty sets and checkpoints work per shard.

One step of `embedding_lookup_group(cevs, ids)` (the training lookup of every
table of the step, in one exchange):

  1. each worker deduplicates each table's ids (unique keys with their
     occurrence counts) and orders them by owner;
  2. an all-gather of the [W owners x T tables] key counts: every worker
     then knows every (source, owner, table) count, so all of them compute the
     same padded sizes (all-to-all inputs must have identical shapes);
  3. one all-to-all of the keys and counts of every table ([W, M, 2] int64,
     M = the largest per-pair key count of the step, padding masked by the
     counts); each owner deduplicates what it received, sums the counts (so
     frequencies and admission equal one process's) and runs the counted
     find-or-insert on its shard;
  4. one all-to-all of the rows back ([W, Mf] float32, every table packed);
  5. backward: the gradient of the received rows goes back by the reverse
     all-to-all, and the owner gets `IndexedSlices(summed row gradients,
     distinct keys)` for its shard, which the fused optimizer applies there.

Four collectives per step whatever the number of tables (an all-gather and
three all-to-alls), never one of zero elements (sizes are at least 1), each
with its own instance key from a per-process counter variable (every worker
runs the same sequence of lookups, so the keys agree; a key is never reused
with another shape, which the collective runtime refuses). Bytes moved per
worker and step: about (1 - 1/W) * U * (16 + 8 d) for U distinct ids (keys
and counts out, rows back, gradients out), plus padding.

Dense variables are the strategy's business: mirrored, their gradients
all-reduced. EV gradients are not all-reduced: the owner's gradient is
already the sum over the workers of their gradients, which is what the
strategy's SUM all-reduce gives a dense variable, so a loss scaled like the
strategy expects (`tf.nn.compute_average_loss` with the global batch size,
or Keras's per-replica scaling) trains both alike, and W workers on W slices
of a batch equal one process on the whole batch.

With one worker (or no strategy) a CollectiveEmbeddingVariable is its one
local shard and a lookup is a plain local lookup.
"""
import weakref
import zlib

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context

from evstore import distribute as _distribute
from evstore._ops import gen
from evstore.group import embedding_lookup_group as _local_group
from evstore.schema import SHARD_ROUTE
from evstore.substitution import substitute_for
from evstore.variable import EmbeddingVariable, UnshardedEmbeddingVariable

__all__ = ["CollectiveEmbeddingVariable", "embedding_lookup_group", "exchange_stats", "GROUP_KEY"]

GROUP_KEY = 0x45565359      # the collective group of evstore's exchanges (distinct from the strategy's small keys)
_KEYS_PER_EXCHANGE = 4      # instance keys used by one exchange: gather, keys out, rows back, gradients back
_INSTANCE_BASE = 1 << 24    # above the strategy's instance keys


def _local_creator(next_creator, **kwargs):
    """Creates a plain local variable whatever strategy is in scope (a
    mirrored variable would be broadcast at creation, and a zero-size one is a
    zero-element collective, which the runtime does not survive)."""
    del next_creator
    return resource_variable_ops.ResourceVariable(
        initial_value=kwargs.get("initial_value"), trainable=kwargs.get("trainable", True),
        name=kwargs.get("name"), dtype=kwargs.get("dtype"), shape=kwargs.get("shape"))


def _workers(strategy):
    """(rank, number of workers) of this process under `strategy` (None: one process)."""
    if strategy is None:
        return 0, 1
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise TypeError("CollectiveEmbeddingVariable needs a tf.distribute.MultiWorkerMirroredStrategy "
                        f"(or none), got {type(strategy).__name__}")
    resolver = strategy.cluster_resolver
    num_workers = len(resolver.cluster_spec().as_dict().get("worker", [])) or 1
    chief = len(resolver.cluster_spec().as_dict().get("chief", []))
    if chief:
        raise ValueError("CollectiveEmbeddingVariable: give the cluster workers only (no 'chief' task); worker 0 "
                         "acts as chief")
    if strategy.num_replicas_in_sync != num_workers:
        raise ValueError(f"CollectiveEmbeddingVariable needs one replica per worker, got "
                         f"{strategy.num_replicas_in_sync} replicas on {num_workers} workers")
    rank = int(resolver.task_id or 0) if num_workers > 1 else 0
    return rank, num_workers


_COUNTER = []   # the per-process instance-key counter (one variable)


def _counter():
    if not _COUNTER:
        with tf.init_scope(), tf.variable_creator_scope(_local_creator):
            _COUNTER.append(tf.Variable(tf.constant(0, tf.int32), trainable=False, name="evstore_collective_step"))
    return _COUNTER[0]


class CollectiveEmbeddingVariable(EmbeddingVariable, tf.Module, collective_implementation=True):
    """An embedding table split by key over the workers of a MultiWorkerMirroredStrategy.

    Args:
      name: the table's name; worker r's shard is the EV `<name>/part_<r>`.
      dim: embedding width.
      strategy: the MultiWorkerMirroredStrategy (default: the one in scope;
        none in scope: one worker, the whole table local).
      **ev_kwargs: every other EmbeddingVariable argument (key_dtype,
        initializer, filter, evict, ...), given to the local shard.

    It is an EmbeddingVariable (`isinstance(cev, evstore.EmbeddingVariable)`),
    of the sharded kind (`cev.sharded` is True: it is saved as parts
    `<name>/part_<i>`); `cev.shards` are the parts this process holds,
    `(cev.local,)`. The per-table methods (`size`, `stats`, `evict`,
    `frequency`, `version`, `admitted`, `remove`, `load`, the snapshot calls)
    act on this worker's shard: keys owned by another worker are absent here.

    Look it up with `evstore.collective.embedding_lookup_group` (or
    `evstore.embedding_lookup` / `evstore.embedding_lookup_group`, which
    dispatch here); train it with an evstore optimizer like any variable:
    `tape.gradient(loss, [cev, w])` is the gradient of the local shard
    (`cev.handle` is `cev.local.handle`), and `apply_gradients` takes `cev`
    itself as `cev.local`. Every worker must create the same tables in the
    same order and run the same lookups.

    Raises:
      TypeError: a strategy other than MultiWorkerMirroredStrategy.
      ValueError: more than one replica per worker, a 'chief' task, or any
        argument an EmbeddingVariable refuses.
    """

    def __init__(self, name, dim, strategy=None, **ev_kwargs):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        for bad in ("shards", "devices"):
            if ev_kwargs.get(bad) is not None:
                raise ValueError(f"CollectiveEmbeddingVariable shards by worker; {bad}= is not an argument of it")
        super().__init__(name=None)
        if strategy is None and tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
        self._rank, self._num_workers = _workers(strategy)
        self._ev_name = name
        with tf.init_scope(), tf.variable_creator_scope(_local_creator), _distribute.building_parts():
            self._local = UnshardedEmbeddingVariable(f"{name}/part_{self._rank}", dim, **ev_kwargs)
        self._local._collective_parent = weakref.ref(self)
        if self._num_workers > 1:
            _counter()

    # Lets tf.GradientTape take the table itself as a source, as it takes an
    # UnshardedEmbeddingVariable: its handle is the local shard's proxy, where
    # the all-to-all's backward pass delivers this worker's row gradients. Not
    # while a SavedModel is written (it is a module there).
    @property
    def _should_act_as_resource_variable(self):
        if save_context.in_save_context():
            raise AttributeError("_should_act_as_resource_variable")
        return True

    @property
    def handle(self):
        """The local shard's proxy handle: where tapes deliver this worker's gradients."""
        return self._local.handle

    @property
    def name(self):
        return self._ev_name

    @property
    def local(self):
        """This worker's shard: the EV of the keys k with shard_index(k, num_workers) == rank."""
        return self._local

    @property
    def rank(self):
        return self._rank

    @property
    def num_workers(self):
        return self._num_workers

    @property
    def shard_info(self):
        """The checkpoint manifest's "shard" entry of the local shard (checkpoint/shards.py)."""
        return {"ev": self._ev_name, "index": self._rank, "count": self._num_workers, "route": SHARD_ROUTE}

    @property
    def sharded(self):
        return True

    def _lookup(self, ids, training, proxy=None):
        return embedding_lookup_group([self], [ids], training=training, proxies=None if proxy is None else [proxy])[0]

    def _group_lookup(self):
        return embedding_lookup_group

    @property
    def shards(self):
        """The parts this process holds: `(cev.local,)`."""
        return (self._local,)

    @property
    def dim(self):
        return self._local.dim

    @property
    def key_dtype(self):
        return self._local.key_dtype

    @property
    def trainable(self):
        return self._local.trainable

    @property
    def variables(self):
        return [self._local]

    @property
    def default_value(self):
        return self._local.default_value

    @property
    def filter(self):
        return self._local.filter

    @property
    def evict_policies(self):
        return self._local.evict_policies

    def _key_tensor(self, ids, what="keys"):
        return self._local._key_tensor(ids, what)

    # ---- this worker's shard -------------------------------------------------
    def size(self):
        return self._local.size()

    def stats(self):
        return self._local.stats()

    def evict(self, global_step=None):
        return self._local.evict(global_step)

    def frequency(self, keys):
        return self._local.frequency(keys)

    def version(self, keys):
        return self._local.version(keys)

    def admitted(self, keys):
        return self._local.admitted(keys)

    def remove(self, keys):
        return self._local.remove(keys)

    def load(self, *args, **kwargs):
        return self._local.load(*args, **kwargs)

    def begin_export(self, return_keys=True):
        return self._local.begin_export(return_keys)

    def commit_export(self, snapshot_id):
        return self._local.commit_export(snapshot_id)

    def abort_export(self, snapshot_id):
        return self._local.abort_export(snapshot_id)

    def export(self):
        """The whole table, as `EmbeddingVariable.export()` (keys, values,
        versions, freqs, slots, filtered_keys, filtered_freqs), on every worker.

        With several workers this is collective: every worker must call it at
        the same point of its program. Each exports its shard and three
        all-gathers (rows, their integer fields, the filtered keys; each padded
        to the largest shard, never of zero elements) join the shards, worker
        0's first. `cev.local.export()` is this worker's shard alone. Eager only.

        Raises:
          RuntimeError: called in a graph with more than one worker.
          ValueError: the workers' shards hold different optimizer slots (a
            shard that no apply has reached yet has none).
        """
        part = self._local.export()
        W = self._num_workers
        if W == 1:
            return part
        if not tf.executing_eagerly():
            raise RuntimeError(f"CollectiveEmbeddingVariable '{self.name}'.export() joins the workers' shards "
                               "eagerly; in a graph export `cev.local`")
        names = sorted(part["slots"])
        n, m = int(tf.size(part["keys"])), int(tf.size(part["filtered_keys"]))
        sig = zlib.crc32("\0".join(names).encode())
        sizes = all_gather_ints([n, m, sig], W)
        if len(set(sizes[:, 2].tolist())) != 1:
            raise ValueError(f"CollectiveEmbeddingVariable '{self.name}': the workers' shards hold different "
                             "optimizer slots (export after every shard has been trained, or export cev.local)")
        d = self.dim
        rows = tf.concat([part["values"]] + [part["slots"][k] for k in names], 1)
        ints = tf.stack([tf.cast(part["keys"], tf.int64), part["versions"], part["freqs"]], 1)
        filtered = tf.stack([tf.cast(part["filtered_keys"], tf.int64), part["filtered_freqs"]], 1)
        ik = _counter().assign_add(1) * _KEYS_PER_EXCHANGE + _INSTANCE_BASE
        rows = _gather_padded(rows, sizes[:, 0], ik, W)
        ints = _gather_padded(ints, sizes[:, 0], ik + 1, W)
        filtered = _gather_padded(filtered, sizes[:, 1], ik + 2, W)
        kd = self.key_dtype
        return {"keys": tf.cast(ints[:, 0], kd), "values": rows[:, :d], "versions": ints[:, 1], "freqs": ints[:, 2],
                "slots": {k: rows[:, d * (1 + i):d * (2 + i)] for i, k in enumerate(names)},
                "filtered_keys": tf.cast(filtered[:, 0], kd), "filtered_freqs": filtered[:, 1]}

    def __repr__(self):
        return (f"<evstore.CollectiveEmbeddingVariable '{self.name}' dim={self.dim} rank={self.rank} "
                f"workers={self.num_workers} key_dtype={self.key_dtype.name}>")


def owner_of(ev):
    """The CollectiveEmbeddingVariable whose local shard `ev` is, or None."""
    ref = getattr(ev, "_collective_parent", None)
    return ref() if ref is not None else None


def _exclusive_cumsum(x, axis):
    return tf.cumsum(x, axis=axis, exclusive=True)


def _positions(starts, lengths):
    """Concatenated ranges [starts[i], starts[i] + lengths[i]) (int32 vectors)."""
    return tf.ragged.range(starts, starts + lengths).flat_values


def _gather_rows(flat, pos, dim):
    return tf.reshape(tf.gather(flat, pos), [-1, dim])


class _Plan:
    """One table of an exchange: this worker's distinct ids, ordered by owner."""

    def __init__(self, cev, ids, training, num_workers, proxy=None):
        self.cev, self.dim = cev, cev.dim
        self.proxy = cev.local._proxy if proxy is None else proxy
        self.ids = cev._key_tensor(ids, "ids")
        flat = tf.reshape(self.ids, [-1])
        uniq, self.idx, cnt = tf.unique_with_counts(flat, out_idx=tf.int32)
        dest = gen.ev_shard_index(uniq, num_shards=num_workers)
        order = tf.argsort(dest, stable=True)
        self.inverse = tf.math.invert_permutation(order)
        self.keys = tf.cast(tf.gather(uniq, order), tf.int64)
        self.counts = tf.cast(tf.gather(cnt, order), tf.int64) if training else tf.zeros_like(self.keys)
        self.dest = tf.gather(dest, order)
        self.per_owner = tf.math.bincount(dest, minlength=num_workers, maxlength=num_workers, dtype=tf.int32)


def exchange_stats(counts, dims):
    """(key slots, row floats) per pair of one step's padded exchange, from the
    all-gathered counts [W src, W dst, T]: what one worker sends each other
    worker. Helps the benchmark's byte accounting."""
    keys = tf.reduce_max(tf.reduce_sum(counts, 2))
    floats = tf.reduce_max(tf.reduce_sum(counts * tf.constant(dims, tf.int32), 2))
    return tf.maximum(keys, 1), tf.maximum(floats, 1)


def _collective(op, x, ik, num_workers):
    return op(input=x, group_size=tf.constant(num_workers), group_key=tf.constant(GROUP_KEY),
              instance_key=ik, ordering_token=[], communication_hint="auto")


def embedding_lookup_group(cevs, ids, training=True, proxies=None, name=None):
    """`[embedding_lookup(cev, i, training) for cev, i in zip(cevs, ids)]` in one
    exchange (the module docstring): every worker must call it with the same
    tables in the same order, at the same step (ids may differ in size, be
    empty, or hold no key of some worker).

    Args:
      cevs: distinct CollectiveEmbeddingVariables of one strategy.
      ids: one ids tensor per table (any shape, the table's key dtype).
      training: counted find-or-insert, differentiable (True), or read-only.
      proxies: advanced: per table the zero-size variable its gradient flows
        to (default: the local shard's own; `evstore.keras.Embedding` gives
        its Keras weight, registered to the local shard).
    Returns:
      float32 tensors, `ids[i].shape + [cevs[i].dim]`.
    Raises:
      TypeError / ValueError: not CollectiveEmbeddingVariables, tables of
        different worker counts, repeated tables, a length mismatch, ids of
        the wrong dtype.
    """
    cevs, ids = list(cevs), list(ids)
    if len(cevs) != len(ids):
        raise ValueError(f"embedding_lookup_group needs one ids tensor per table, got {len(cevs)} tables and "
                         f"{len(ids)} ids")
    if not cevs:
        return []
    for c in cevs:
        if not isinstance(c, CollectiveEmbeddingVariable):
            raise TypeError(f"expected CollectiveEmbeddingVariables, got {type(c).__name__}")
    proxies = [None] * len(cevs) if proxies is None else list(proxies)
    if len(proxies) != len(cevs):
        raise ValueError(f"embedding_lookup_group: {len(proxies)} proxies for {len(cevs)} tables")
    if len({id(c) for c in cevs}) != len(cevs):
        raise ValueError("embedding_lookup_group: each table may appear once (concatenate its ids instead)")
    num_workers = cevs[0].num_workers
    if any(c.num_workers != num_workers for c in cevs):
        raise ValueError("embedding_lookup_group: tables of different strategies (worker counts)")
    subs = [substitute_for(c) for c in cevs]
    if all(sub is not None for sub in subs):   # a serving export's stock tables
        return [sub(c._key_tensor(x, "ids")) for sub, c, x in zip(subs, cevs, ids)]
    with tf.name_scope(name or "collective_embedding_lookup"):
        if num_workers == 1:
            return _local_group([c.local for c in cevs], ids, training=training,
                               proxies=None if all(p is None for p in proxies) else proxies)
        plans = [_Plan(c, x, training, num_workers, p) for c, x, p in zip(cevs, ids, proxies)]
        return _exchange(plans, training, num_workers, cevs[0].rank)


def _proxy_value(proxy):
    """A tf.Variable, or a keras.Variable's tf.Variable."""
    return proxy if isinstance(proxy, tf.Variable) else getattr(proxy, "value", proxy)


def _exchange(plans, training, W, rank):
    T = len(plans)
    dims = [p.dim for p in plans]
    dims_t = tf.constant(dims, tf.int32)
    ik = _counter().assign_add(1) * _KEYS_PER_EXCHANGE + _INSTANCE_BASE

    # 2. every (source, owner, table) count.
    mine = tf.stack([p.per_owner for p in plans], axis=1)                      # [W dst, T]
    counts = _collective(tf.raw_ops.CollectiveGatherV2, tf.reshape(mine, [1, W * T]), ik, W)
    counts = tf.reshape(counts, [W, W, T])                                     # [src, dst, T]
    m_keys, m_floats = exchange_stats(counts, dims)

    # 3. keys and counts out: worker d's segment holds table 0's keys for d, then table 1's, ...
    out_off = _exclusive_cumsum(mine, 1)                                       # [W dst, T]
    pos, vals = [], []
    for t, p in enumerate(plans):
        start = _exclusive_cumsum(p.per_owner, 0)
        within = tf.range(tf.size(p.keys, out_type=tf.int32)) - tf.gather(start, p.dest)
        pos.append(p.dest * m_keys + tf.gather(out_off[:, t], p.dest) + within)
        vals.append(tf.stack([p.keys, p.counts], 1))
    send = tf.scatter_nd(tf.expand_dims(tf.concat(pos, 0), 1), tf.concat(vals, 0), [W * m_keys, 2])
    recv = _collective(tf.raw_ops.CollectiveAllToAllV2, tf.reshape(send, [W, m_keys * 2]), ik + 1, W)
    recv = tf.reshape(recv, [W * m_keys, 2])

    incoming = counts[:, rank, :]                                             # [W src, T]
    in_off = _exclusive_cumsum(incoming, 1)
    in_foff = _exclusive_cumsum(incoming * dims_t, 1)
    src = tf.range(W)
    owner = []   # per table: (distinct keys received, index of each received key, float positions in the reply)
    for t, p in enumerate(plans):
        kpos = _positions(src * m_keys + in_off[:, t], incoming[:, t])
        keys = tf.cast(tf.gather(recv[:, 0], kpos), p.cev.key_dtype)
        cnts = tf.gather(recv[:, 1], kpos)
        uniq, idx = tf.unique(keys, out_idx=tf.int32)
        summed = tf.math.unsorted_segment_sum(cnts, idx, tf.size(uniq))
        fpos = _positions(src * m_floats + in_foff[:, t], incoming[:, t] * p.dim)
        owner.append((uniq, idx, summed, fpos))
    fpos_all = tf.expand_dims(tf.concat([o[3] for o in owner], 0), 1)

    def lookups(pvs):
        rows = []
        for p, (uniq, idx, summed, _), pv in zip(plans, owner, pvs):
            ev = p.cev.local
            if training:
                r = gen.ev_find_or_insert_counted(ev.resource_handle, uniq, summed, pv, dim=p.dim)
            else:
                r = gen.ev_find(ev.resource_handle, uniq, dim=p.dim)
            rows.append(tf.reshape(tf.gather(r, idx), [-1]))
        reply = tf.scatter_nd(fpos_all, tf.concat(rows, 0), [W * m_floats])
        back = _collective(tf.raw_ops.CollectiveAllToAllV2, tf.reshape(reply, [W, m_floats]), ik + 2, W)
        return tf.reshape(back, [-1])

    if training:
        @tf.custom_gradient
        def differentiable(*pvs):
            def grad(dback):
                dback = tf.reshape(tf.convert_to_tensor(dback), [W, m_floats])
                dreply = tf.reshape(_collective(tf.raw_ops.CollectiveAllToAllV2, dback, ik + 3, W), [-1])
                out = []
                for p, (uniq, idx, _, fpos) in zip(plans, owner):
                    g = _gather_rows(dreply, fpos, p.dim)
                    out.append(tf.IndexedSlices(tf.math.unsorted_segment_sum(g, idx, tf.size(uniq)), uniq))
                return out
            return lookups(pvs), grad

        back = differentiable(*[tf.convert_to_tensor(_proxy_value(p.proxy)) for p in plans])
    else:
        back = lookups([None] * len(plans))

    # 4. my rows, from each owner's segment: table-major like what I sent.
    back_off = _exclusive_cumsum(mine * dims_t, 1)                             # [W dst, T]
    results = []
    for t, p in enumerate(plans):
        bpos = _positions(src * m_floats + back_off[:, t], mine[:, t] * p.dim)
        rows = tf.gather(_gather_rows(back, bpos, p.dim), p.inverse)          # distinct ids, in unique order
        r = tf.reshape(tf.gather(rows, p.idx), tf.concat([tf.shape(p.ids), [p.dim]], 0))
        r.set_shape(p.ids.shape.concatenate([p.dim]))
        results.append(r)
    return results


def _gather_padded(x, counts, ik, num_workers):
    """Every worker's rows `x` [counts[rank], w], joined in rank order: one
    all-gather of the rows padded to the largest count (at least one row)."""
    width = int(x.shape[1])
    top = max(int(max(counts)), 1)
    padded = tf.pad(x, [[0, top - tf.shape(x)[0]], [0, 0]])
    out = _collective(tf.raw_ops.CollectiveGatherV2, tf.reshape(padded, [1, top * width]), ik, num_workers)
    out = tf.reshape(out, [num_workers, top, width])
    return tf.concat([out[r, :int(c)] for r, c in enumerate(counts)], 0)


def all_gather_ints(values, num_workers):
    """Every worker's int64 vector `values` (same length everywhere), as a
    [num_workers, len] numpy array, by one all-gather in evstore's collective
    group. Every worker must call it at the same point of its program (it is
    how checkpoint saves agree on a sequence number and a commit)."""
    values = tf.reshape(tf.convert_to_tensor(values, tf.int64), [1, -1])
    if num_workers == 1:
        return values.numpy()
    if values.shape[1] == 0:
        raise ValueError("all_gather_ints: no values (a zero-element collective is never issued)")
    ik = _counter().assign_add(1) * _KEYS_PER_EXCHANGE + _INSTANCE_BASE
    out = _collective(tf.raw_ops.CollectiveGatherV2, values, ik, num_workers)
    return out.numpy()
