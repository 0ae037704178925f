"""Grouped lookups: many tables' lookups in one exchange per device.

A model with T tables sharded over P parameter servers makes T x P shard
lookups per step; looked up one by one, each moves its own tensors (distinct
keys, their counts, rows back, row gradients out): about 4 T P transfers, and
TensorFlow's runtime pays a remote call for each. `embedding_lookup_group`
concatenates, per device, every table's distinct keys (and counts) into one
tensor, splits it *on that device*, runs each table's lookup there, and sends
the rows back as one tensor; its gradient is one tensor per device, split on
the device into each table's `IndexedSlices(row gradients, keys)`, which the
fused optimizer applies right there. A step then costs about 4 P transfers
whatever T is (tables of different key dtypes form separate groups).

Semantics are exactly those of calling `embedding_lookup` on each table
(counts, admission, rows, gradients); tests/evstore/test_group.py holds that.
A table with a lookup substitute (evstore/substitution.py) returns the
substitute's rows and takes no part in the exchange.
"""
import tensorflow as tf

from evstore import finite
from evstore._ops import gen
from evstore.substitution import substitute_for
from evstore.variable import EmbeddingVariable

__all__ = ["embedding_lookup_group"]


def _proxy_value(p):
    if isinstance(p, tf.Variable):
        return tf.convert_to_tensor(p)
    return tf.convert_to_tensor(getattr(p, "value", p))


class _Group:
    """The tables of one device (and key dtype) in a grouped lookup."""

    def __init__(self, device):
        self.device = device
        self.tables, self.keys, self.counts, self.proxies = [], [], [], []

    def add(self, table, keys, counts, proxy):
        self.tables.append(table)
        self.keys.append(keys)
        self.counts.append(counts)
        self.proxies.append(proxy)
        return len(self.tables) - 1

    def prepare(self, training):
        """Worker side: one keys (and counts) tensor; device side: its split."""
        n = len(self.tables)
        self.dims = [t.dim for t in self.tables]
        self.sizes = tf.stack([tf.size(k) for k in self.keys])
        self.flat_sizes = self.sizes * tf.constant(self.dims, self.sizes.dtype)
        keys_cat = tf.concat(self.keys, 0)
        counts_cat = tf.concat(self.counts, 0) if training else None
        with tf.device(self.device):
            self.dev_keys = tf.split(keys_cat, self.sizes, num=n)
            self.dev_counts = tf.split(counts_cat, self.sizes, num=n) if training else None

    def lookups(self, pvs, training):
        """Device side: every table's rows, as one flat tensor (sent back once)."""
        with tf.device(self.device):
            rows = []
            for i, t in enumerate(self.tables):
                if training:
                    r = gen.ev_find_or_insert_counted(t.resource_handle, self.dev_keys[i], self.dev_counts[i],
                                                      pvs[i], dim=self.dims[i])
                else:
                    r = gen.ev_find(t.resource_handle, self.dev_keys[i], dim=self.dims[i])
                rows.append(tf.reshape(r, [-1]))
            return tf.concat(rows, 0)

    def checks(self, dflat):
        """Worker side: the NaN/Inf policy of the optimizers, before anything is sent."""
        parts = tf.split(dflat, self.flat_sizes, num=len(self.tables))
        return [finite.check(k, tf.reshape(p, [-1, d]), t.name)
                for t, k, p, d in zip(self.tables, self.keys, parts, self.dims)]

    def gradients(self, dflat):
        """Device side: the split of the (one) gradient tensor into each table's IndexedSlices."""
        with tf.device(self.device):
            parts = tf.split(dflat, self.flat_sizes, num=len(self.tables))
            return [tf.IndexedSlices(tf.reshape(p, [-1, d]), k) for p, d, k in zip(parts, self.dims, self.dev_keys)]

    def split_rows(self, flat):
        parts = tf.split(flat, self.flat_sizes, num=len(self.tables))
        return [tf.reshape(p, [-1, d]) for p, d in zip(parts, self.dims)]


def _exchange(groups, training):
    """Rows of every group: per device one keys (and counts) tensor out, one
    rows tensor back, and in the backward pass one gradient tensor out."""
    for g in groups:
        g.prepare(training)
    if not training:
        return [g.split_rows(g.lookups(None, training)) for g in groups]
    return [g.split_rows(_differentiable_lookups(g)) for g in groups]


def _differentiable_lookups(g):
    """One group's lookups, differentiable w.r.t. its proxies. Built on the
    group's device: the custom gradient passes its inputs through an op of
    its own, which must sit with the proxies and rows, not on the worker."""
    @tf.custom_gradient
    def grouped(*pvs):
        flat = g.lookups(pvs, True)

        def grad(dflat):
            with tf.device(None):   # on the worker, where the gradient was computed
                checks = g.checks(dflat)
            out = g.gradients(dflat)
            finite.note_checked(checks, out)   # the optimizers apply nothing before every check passed
            return out
        return flat, grad

    with tf.device(g.device):
        pvs = [_proxy_value(p) for p in g.proxies]
        return grouped(*pvs)


def embedding_lookup_group(evs, ids, training=True, proxies=None, name=None):
    """`[embedding_lookup(ev, i, training) for ev, i in zip(evs, ids)]`, in one
    exchange per device (see the module docstring).

    Args:
      evs: EmbeddingVariables and / or ShardedEmbeddingVariables (distinct).
      ids: one ids tensor per EV (any shapes; each the EV's key dtype).
      training: find-or-insert and differentiable (True), or read-only.
      proxies: advanced: per EV the proxy (a list per sharded EV) that
        gradients flow to, as `embedding_lookup`'s `proxy` (Keras layers).
    Returns:
      A list of float32 tensors, `ids[i].shape + [evs[i].dim]`.
    Raises:
      TypeError / ValueError: not EVs, repeated EVs, a length mismatch, ids
        of the wrong dtype.
    """
    evs, ids = list(evs), list(ids)
    if len(evs) != len(ids):
        raise ValueError(f"embedding_lookup_group needs one ids tensor per EV, got {len(evs)} EVs and "
                         f"{len(ids)} ids")
    for ev in evs:
        if not isinstance(ev, EmbeddingVariable):
            raise TypeError(f"expected evstore.EmbeddingVariables, got {type(ev).__name__}")
    if len({id(ev) for ev in evs}) != len(evs):
        raise ValueError("embedding_lookup_group: each EV may appear once (concatenate its ids instead)")
    exchanges = {ev._group_lookup() for ev in evs}   # each kind of EV names the exchange it is looked up by
    if len(exchanges) > 1:
        raise ValueError("embedding_lookup_group: CollectiveEmbeddingVariables are looked up by an exchange of "
                         "their own; look them up in a group of their own")
    own = exchanges.pop() if exchanges else None
    if own is not None:
        return own(evs, ids, training=training, proxies=proxies, name=name)
    if proxies is None:
        proxies = [None] * len(evs)
    with tf.name_scope(name or "embedding_lookup_group"):
        # Per EV: distinct ids (and counts), routed to its tables.
        plans, groups = [], {}   # groups: (device, key dtype) -> _Group
        for e, (ev, x, px) in enumerate(zip(evs, ids, proxies)):
            x = ev._key_tensor(x, "ids")
            substitute = substitute_for(ev)   # evstore/substitution.py (serving export)
            if substitute is not None:
                plans.append(substitute(x))
                continue
            flat = tf.reshape(x, [-1])
            if training:
                uniq, idx, cnt = tf.unique_with_counts(flat, out_idx=tf.int32)
                cnt = tf.cast(cnt, tf.int64)
            else:
                uniq, idx = tf.unique(flat, out_idx=tf.int32)
                cnt = None
            tables = ev.shards
            if px is None:
                px = [t._proxy for t in tables]
            elif not isinstance(px, (list, tuple)):
                px = [px]
            if len(tables) > 1:
                part = gen.ev_shard_index(uniq, num_shards=len(tables))
                keys = tf.dynamic_partition(uniq, part, len(tables))
                pos = tf.dynamic_partition(tf.range(tf.size(uniq)), part, len(tables))
                cnts = tf.dynamic_partition(cnt, part, len(tables)) if training else [None] * len(tables)
            else:
                keys, pos, cnts = [uniq], None, [cnt]
            slots = []
            for t, k, c, p in zip(tables, keys, cnts, px):
                g = (t.device, t.key_dtype)
                if g not in groups:
                    groups[g] = _Group(t.device or None)
                slots.append((g, groups[g].add(t, k, c, p)))
            plans.append((x, idx, pos, slots, ev.dim))
        results = dict(zip(groups, _exchange(list(groups.values()), training)))
        out = []
        for plan in plans:
            if not isinstance(plan, tuple):   # a substitute's rows
                out.append(plan)
                continue
            x, idx, pos, slots, dim = plan
            rows = [results[g][j] for g, j in slots]
            uniq_rows = rows[0] if pos is None else tf.dynamic_stitch(pos, rows)
            r = tf.reshape(tf.gather(uniq_rows, idx), tf.concat([tf.shape(x), [dim]], 0))
            r.set_shape(x.shape.concatenate([dim]))
            out.append(r)
        return out
