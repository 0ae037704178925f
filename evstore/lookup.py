"""Embedding lookups on EmbeddingVariables, with the tf.nn functions' semantics."""
import tensorflow as tf

from evstore.substitution import substitute_for
from evstore.variable import EmbeddingVariable

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "safe_embedding_lookup_sparse"]

_COMBINERS = ("mean", "sqrtn", "sum")


def _check_ev(ev):
    if not isinstance(ev, EmbeddingVariable):
        raise TypeError(f"expected an evstore.EmbeddingVariable, got {type(ev).__name__}")


def _widen(ev, ids):
    """int32 id tensors into an int64-keyed EV are cast (lossless), as tf.nn
    accepts them; every other dtype mismatch is left to `ev._key_tensor`."""
    if tf.is_tensor(ids) and ids.dtype == tf.int32 and ev.key_dtype == tf.int64:
        return tf.cast(ids, tf.int64)
    return ids


def _clip_rows(rows, max_norm):
    """tf.nn's max_norm: each looked-up row (last axis) clipped to L2 norm <=
    max_norm; the stored rows are unchanged."""
    if max_norm is None:
        return rows
    return tf.clip_by_norm(rows, max_norm, axes=[-1])


def _combiner(combiner):
    return "mean" if combiner is None else combiner   # tf.nn: None means "mean"


def _sparse_ids(x):
    """A RaggedTensor of ids / weights as the SparseTensor tf.nn makes of it."""
    if isinstance(x, tf.RaggedTensor):
        return x.to_sparse()
    return x


def embedding_lookup(ev, ids, training=True, proxy=None, name=None, max_norm=None):
    """Looks up `ids` in `ev`: returns a float32 tensor of shape `ids.shape + [dim]`.

    As `tf.nn.embedding_lookup`: a `tf.RaggedTensor` of ids gives a
    RaggedTensor of rows (`ids.shape + [dim]`, ragged where the ids are);
    int32 ids into an int64-keyed EV are cast (lossless); with `max_norm`
    each looked-up row whose L2 norm exceeds it is scaled down to it (the
    result only; stored rows are unchanged, gradients flow through the clip).

    With `training=True` (default) the lookup is a find-or-insert: every
    occurrence of a key adds 1 to its frequency, unseen keys enter the table,
    keys reaching the filter's `min_freq` are admitted with their initial row,
    and the result is differentiable: `tape.gradient(loss, ev)` gives
    `tf.IndexedSlices(values=row gradients, indices=keys)`. Keys below the
    filter threshold read the default value and receive no update.

    With `training=False` the lookup is read-only: stored rows or the default
    value; it never inserts and never counts (serving, evaluation).

    `proxy` (advanced) is the zero-size variable gradients flow to; by default
    the EV's own (a list, one per shard, for a ShardedEmbeddingVariable).

    `ev` may be a ShardedEmbeddingVariable: the ids are deduplicated here,
    each shard looks up its distinct keys (with their counts) on its own
    device, and the rows are stitched back; results equal an unsharded EV's. Raises TypeError for ids of the wrong dtype (e.g. float ids).
    """
    _check_ev(ev)
    if isinstance(ids, tf.RaggedTensor):
        return ids.with_flat_values(embedding_lookup(ev, ids.flat_values, training=training, proxy=proxy,
                                                     name=name, max_norm=max_norm))
    if max_norm is not None:
        return _clip_rows(embedding_lookup(ev, ids, training=training, proxy=proxy, name=name), max_norm)
    with tf.name_scope(name or "embedding_lookup"):
        ids = ev._key_tensor(_widen(ev, ids), "ids")
        substitute = substitute_for(ev)   # evstore/substitution.py (serving export)
        if substitute is not None:
            return substitute(ids)
        return ev._lookup(ids, training, proxy)


def _check_sparse(ev, sp_ids, sp_weights, combiner):
    """Validated (sp_ids, sp_weights, combiner): ragged inputs as sparse, int32
    ids into an int64 EV cast, combiner None as "mean"."""
    _check_ev(ev)
    combiner = _combiner(combiner)
    if combiner not in _COMBINERS:
        raise ValueError(f"combiner must be one of 'mean', 'sqrtn' or 'sum', got {combiner!r}")
    sp_ids, sp_weights = _sparse_ids(sp_ids), _sparse_ids(sp_weights)
    if not isinstance(sp_ids, tf.SparseTensor):
        raise TypeError(f"sp_ids must be a tf.SparseTensor or tf.RaggedTensor, got {type(sp_ids).__name__}")
    values = ev._key_tensor(_widen(ev, sp_ids.values), "sp_ids")
    if values is not sp_ids.values:
        sp_ids = tf.SparseTensor(sp_ids.indices, values, sp_ids.dense_shape)
    if sp_weights is not None:
        if not isinstance(sp_weights, tf.SparseTensor):
            raise TypeError(f"sp_weights must be None, a tf.SparseTensor or a tf.RaggedTensor, got "
                            f"{type(sp_weights).__name__}")
        sp_ids.values.shape.assert_is_compatible_with(sp_weights.values.shape)
        sp_ids.indices.shape.assert_is_compatible_with(sp_weights.indices.shape)
    return sp_ids, sp_weights, combiner


def _combine(ev, segment_ids, ids, weights, combiner, num_segments, training, proxy, max_norm=None):
    """Per-segment combination of looked-up rows, the same ops as tf.nn's.

    Every occurrence is looked up (so training lookups count each one), in
    place of tf.nn's unique + gather: the sums run over the same rows in the
    same order, so results match tf.nn bit for bit.
    """
    emb = embedding_lookup(ev, ids, training=training, proxy=proxy, max_norm=max_norm)
    if weights is None:
        idx = tf.range(tf.shape(ids)[0])
        if segment_ids.dtype not in (tf.int32, tf.int64):
            segment_ids = tf.cast(segment_ids, tf.int32)
        fn = {"sum": tf.sparse.segment_sum, "mean": tf.sparse.segment_mean, "sqrtn": tf.sparse.segment_sqrt_n}[combiner]
        return fn(emb, idx, segment_ids, num_segments=num_segments)
    segment_ids = tf.cast(segment_ids, tf.int32)
    w = tf.reshape(tf.cast(weights, tf.float32), [-1, 1])
    emb = emb * w

    def seg_sum(x):
        if num_segments is None:
            return tf.math.segment_sum(x, segment_ids)
        return tf.math.unsorted_segment_sum(x, segment_ids, num_segments)

    if combiner == "sum":
        return seg_sum(emb)
    if combiner == "mean":
        return tf.math.divide_no_nan(seg_sum(emb), seg_sum(w))
    return tf.math.divide_no_nan(seg_sum(emb), tf.sqrt(seg_sum(tf.pow(w, 2))))


def embedding_lookup_sparse(ev, sp_ids, sp_weights=None, combiner="mean", training=True, proxy=None, name=None,
                            max_norm=None):
    """Combines the rows of each row of a rank-2 SparseTensor of ids.

    Same semantics as `tf.nn.embedding_lookup_sparse`: `sp_ids` is
    [batch, max_ids] with row-major ordered indices; `sp_weights` (optional) has
    the same indices; `combiner` is "mean" (default), "sqrtn" or "sum". The
    result is [max row index with ids + 1, dim]; use
    `safe_embedding_lookup_sparse` for a result padded to the batch size.
    Duplicate ids count (and train) once per occurrence. As tf.nn: combiner
    None means "mean"; `sp_ids` / `sp_weights` may be RaggedTensors (taken as
    their `to_sparse()`); int32 ids into an int64-keyed EV are cast;
    `max_norm` clips each looked-up row before combining (see
    `embedding_lookup`); weights of another float dtype are cast to float32.
    """
    sp_ids, sp_weights, combiner = _check_sparse(ev, sp_ids, sp_weights, combiner)
    with tf.name_scope(name or "embedding_lookup_sparse"):
        weights = None if sp_weights is None else sp_weights.values
        return _combine(ev, sp_ids.indices[:, 0], sp_ids.values, weights, combiner, None, training, proxy,
                        max_norm)


def safe_embedding_lookup_sparse(ev, sp_ids, sp_weights=None, combiner="mean", default_id=None, training=True,
                                 proxy=None, name=None, max_norm=None):
    """Like `tf.nn.safe_embedding_lookup_sparse` on an EmbeddingVariable.

    `sp_ids` of rank >= 2 ([d0, ..., dn-1, max_ids]); the result is
    [d0, ..., dn-1, dim]. Invalid ids (< 0) are pruned, and with a combiner other
    than "sum" so are ids with weight <= 0 (string ids are never invalid: only
    the weight rule prunes them). Rows left empty read zeros, or the row
    of `default_id` when given. As tf.nn: combiner None means "mean",
    RaggedTensor inputs are taken as their `to_sparse()`, int32 ids into an
    int64-keyed EV are cast, `max_norm` clips each looked-up row before
    combining.

    Raises:
      ValueError: `sp_weights` not float32 (the rows' dtype), as
        `tf.nn.safe_embedding_lookup_sparse` does (the non-safe variant casts).
    """
    sp_ids, sp_weights, combiner = _check_sparse(ev, sp_ids, sp_weights, combiner)
    if sp_weights is not None and sp_weights.dtype != tf.float32:
        raise ValueError(f"sp_weights are {sp_weights.dtype.name} but EmbeddingVariable '{ev.name}' holds float32 "
                         "rows (tf.nn.safe_embedding_lookup_sparse refuses this too); cast the weights to float32")
    with tf.name_scope(name or "safe_embedding_lookup_sparse"):
        original_shape = sp_ids.dense_shape
        sp2 = tf.sparse.reshape(sp_ids, tf.stack([tf.reduce_prod(original_shape[:-1]), original_shape[-1]]))
        weights = None
        if sp_weights is not None:
            weights = tf.SparseTensor(sp2.indices, sp_weights.values, sp2.dense_shape)
        if sp2.dtype == tf.string:   # every string is a valid key (none is "negative")
            keep = tf.ones_like(sp2.values, dtype=tf.bool)
        else:
            keep = tf.greater_equal(sp2.values, 0)
        if weights is not None and combiner != "sum":
            keep = tf.logical_and(keep, tf.greater(weights.values, 0))
        sp2 = tf.sparse.retain(sp2, keep)
        if weights is not None:
            weights = tf.sparse.retain(weights, keep)
        num_rows = sp2.dense_shape[0]
        if default_id is not None:
            fill = (tf.convert_to_tensor(default_id, tf.string) if sp2.dtype == tf.string
                    else tf.cast(default_id, sp2.dtype))
            sp2, _ = tf.sparse.fill_empty_rows(sp2, fill)
            if weights is not None:
                weights, _ = tf.sparse.fill_empty_rows(weights, tf.cast(1.0, weights.dtype))
        result = _combine(ev, sp2.indices[:, 0], sp2.values, None if weights is None else weights.values,
                          combiner, num_rows, training, proxy, max_norm)
        out_shape = tf.concat([tf.cast(original_shape[:-1], tf.int32), [ev.dim]], 0)
        final = tf.reshape(result, out_shape)
        static_rank = sp_ids.dense_shape.shape[0]
        if static_rank is not None:
            final.set_shape([None] * (static_rank - 1) + [ev.dim])
        return final
