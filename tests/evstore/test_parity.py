"""An EmbeddingVariable trains and looks up exactly like a dense tf.Variable holding the same rows.

The dense side is the reference: Keras's own optimizers and tf.nn's lookups on a
`[rows, dim]` tf.Variable. The EV holds the same rows under non-contiguous keys.

Duplicate ids: the gradient of a lookup is the sum over a row's occurrences, and
the EV's fused apply sums duplicates before updating (docs/ARCHITECTURE.md, "Ops and Python API"). Keras 3's
optimizers do not: given `tf.IndexedSlices` with repeated indices, Adagrad squares
and Adam averages each slice separately (e.g. Adagrad's accumulator gains
g1^2 + g2^2 instead of (g1 + g2)^2), which is not the gradient step of the loss.
The reference therefore hands Keras the row-summed gradient (`summed`), exactly
what TF's v1 optimizers did with `_deduplicate_indexed_slices`.
"""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 4
# Non-contiguous keys; KEYS[i] is the EV key of dense row i.
KEYS = np.array([3, 17, 1000003, 2**40 + 7, 5, 99991, 123456789012, 42], np.int64)
N = len(KEYS)
STEPS = 20
TOL = 1e-5

OPTIMIZERS = {
    "sgd": (lambda: evstore.optimizers.SGD(learning_rate=0.1),
            lambda: tf.keras.optimizers.SGD(learning_rate=0.1)),
    "momentum": (lambda: evstore.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                 lambda: tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)),
    "nesterov": (lambda: evstore.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
                 lambda: tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True)),
    "adagrad": (lambda: evstore.optimizers.Adagrad(learning_rate=0.1),
                lambda: tf.keras.optimizers.Adagrad(learning_rate=0.1)),
    "adam": (lambda: evstore.optimizers.Adam(learning_rate=0.01),
             lambda: tf.keras.optimizers.Adam(learning_rate=0.01)),
}


def initial_rows(seed=0):
    return np.random.default_rng(seed).normal(0.0, 0.5, size=(N, DIM)).astype(np.float32)


def loaded_ev(rows, name="parity"):
    ev = evstore.EmbeddingVariable(name, DIM)
    ev.load(KEYS, rows)
    return ev


def batches(seed=1):
    """STEPS batches of dense row indices: every row at least once, plus duplicates."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        idx = np.concatenate([rng.permutation(N), rng.integers(0, N, size=5)])
        rng.shuffle(idx)
        target = rng.normal(size=(len(idx), DIM)).astype(np.float32)
        out.append((idx, target))
    return out


def loss_fn(emb, target):
    return tf.reduce_mean(tf.square(emb - target)) + 0.1 * tf.reduce_mean(tf.tanh(emb) * target)


def summed(grad):
    """An IndexedSlices gradient with duplicate indices summed (dense gradients pass through)."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, pos = tf.unique(grad.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, pos, tf.size(unique)), unique,
                            grad.dense_shape)


def ev_rows(ev):
    return evstore.embedding_lookup(ev, KEYS, training=False).numpy()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_ev_matches_dense_variable_with_keras_optimizer(opt_name):
    make_ev_opt, make_keras_opt = OPTIMIZERS[opt_name]
    rows = initial_rows()
    ev = loaded_ev(rows)
    dense = tf.Variable(rows)
    ev_opt, keras_opt = make_ev_opt(), make_keras_opt()
    for idx, target in batches():
        with tf.GradientTape() as tape:
            loss = loss_fn(evstore.embedding_lookup(ev, KEYS[idx]), target)
        grads = tape.gradient(loss, [ev])
        ev_opt.apply_gradients(zip(grads, [ev]))
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.nn.embedding_lookup(dense, idx), target)
        grads = tape.gradient(loss, [dense])
        keras_opt.apply_gradients(zip(map(summed, grads), [dense]))
    assert np.abs(dense.numpy() - rows).max() > 1e-2, "training did not move the rows"
    np.testing.assert_allclose(ev_rows(ev), dense.numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_one_optimizer_trains_ev_and_dense_variable_like_keras(opt_name):
    make_ev_opt, make_keras_opt = OPTIMIZERS[opt_name]
    rows = initial_rows()
    kernel0 = np.random.default_rng(2).normal(size=(DIM, 3)).astype(np.float32)
    ev, kernel = loaded_ev(rows), tf.Variable(kernel0)
    ref_table, ref_kernel = tf.Variable(rows), tf.Variable(kernel0)
    ev_opt, keras_opt = make_ev_opt(), make_keras_opt()
    for idx, target in batches():
        with tf.GradientTape() as tape:
            out = tf.matmul(evstore.embedding_lookup(ev, KEYS[idx]), kernel)
            loss = loss_fn(out, target[:, :3])
        grads = tape.gradient(loss, [ev, kernel])
        ev_opt.apply_gradients(zip(grads, [ev, kernel]))
        with tf.GradientTape() as tape:
            out = tf.matmul(tf.nn.embedding_lookup(ref_table, idx), ref_kernel)
            loss = loss_fn(out, target[:, :3])
        grads = tape.gradient(loss, [ref_table, ref_kernel])
        keras_opt.apply_gradients(zip(map(summed, grads), [ref_table, ref_kernel]))
    assert np.abs(ref_kernel.numpy() - kernel0).max() > 1e-2, "training did not move the kernel"
    np.testing.assert_allclose(kernel.numpy(), ref_kernel.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(ev_rows(ev), ref_table.numpy(), atol=TOL, rtol=0)


# ---- sparse lookups -----------------------------------------------------------------

def sparse_pair(indices, row_ids, dense_shape, weights=None):
    """(SparseTensor of EV keys, SparseTensor of dense row ids, SparseTensor of weights or None).

    Negative row ids stay negative on both sides (invalid ids for the safe lookups).
    """
    row_ids = np.asarray(row_ids, np.int64)
    keys = np.where(row_ids >= 0, KEYS[np.clip(row_ids, 0, None)], row_ids)
    indices = np.asarray(indices, np.int64)
    sp_keys = tf.SparseTensor(indices, keys, dense_shape)
    sp_rows = tf.SparseTensor(indices, row_ids, dense_shape)
    sp_w = None if weights is None else tf.SparseTensor(indices, np.asarray(weights, np.float32), dense_shape)
    return sp_keys, sp_rows, sp_w


# Rank 2 [5, 4]: row 0 = [0, 2], row 1 empty, row 2 = [3, 3, 1] (duplicate), row 3 = [5], row 4 empty.
RANK2_INDICES = [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2], [3, 0]]
RANK2_ROWS = [0, 2, 3, 3, 1, 5]
RANK2_WEIGHTS = [0.5, 2.0, 1.5, 0.25, 3.0, 0.7]

# Rank 3 [2, 3, 4]: duplicates, an invalid id (-1), a zero weight, empty rows [0, 1], [1, 2].
RANK3_INDICES = [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 2, 0], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
RANK3_ROWS = [4, 4, 7, -1, 6, 2, 0, 3]
RANK3_WEIGHTS = [1.0, 0.5, 2.0, 1.0, 0.0, 1.5, 0.3, 1.2]


def dense_grad_rows(grad, num_rows=N):
    """A dense or IndexedSlices gradient of a [N, DIM] table as a [N, DIM] array."""
    return tf.convert_to_tensor(grad).numpy() if not isinstance(grad, tf.IndexedSlices) else \
        tf.math.unsorted_segment_sum(grad.values, grad.indices, num_rows).numpy()


def ev_grad_rows(grad):
    """The EV's IndexedSlices(keys) gradient aggregated by key, in dense row order."""
    assert isinstance(grad, tf.IndexedSlices)
    key_to_row = {int(k): i for i, k in enumerate(KEYS)}
    rows = np.array([key_to_row[int(k)] for k in grad.indices.numpy()], np.int64)
    return tf.math.unsorted_segment_sum(grad.values, rows, N).numpy()


def both_sides(ev_fn, dense_fn, rows, seed=3):
    """Runs both lookups; returns (ev_out, dense_out, ev_grad_rows, dense_grad_rows)."""
    ev, dense = loaded_ev(rows, "sparse"), tf.Variable(rows)
    with tf.GradientTape() as tape:
        dense_out = dense_fn(dense)
        probe = tf.constant(np.random.default_rng(seed).normal(size=dense_out.shape).astype(np.float32))
        dense_loss = tf.reduce_sum(dense_out * probe)
    dense_grad = tape.gradient(dense_loss, dense)
    with tf.GradientTape() as tape:
        ev_out = ev_fn(ev)
        ev_loss = tf.reduce_sum(ev_out * probe)
    ev_grad = tape.gradient(ev_loss, ev)
    return ev_out.numpy(), dense_out.numpy(), ev_grad_rows(ev_grad), dense_grad_rows(dense_grad)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn", "sum"])
def test_embedding_lookup_sparse_matches_tf_nn(combiner, weighted):
    sp_keys, sp_rows, sp_w = sparse_pair(RANK2_INDICES, RANK2_ROWS, [5, 4], RANK2_WEIGHTS if weighted else None)
    ev_out, dense_out, ev_g, dense_g = both_sides(
        lambda ev: evstore.embedding_lookup_sparse(ev, sp_keys, sp_w, combiner=combiner),
        lambda d: tf.nn.embedding_lookup_sparse(d, sp_rows, sp_w, combiner=combiner),
        initial_rows())
    assert ev_out.shape == dense_out.shape
    np.testing.assert_allclose(ev_out, dense_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ev_g, dense_g, atol=1e-6, rtol=0)


@pytest.mark.parametrize("default_row", [None, 6], ids=["no_default", "default_id"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn", "sum"])
def test_safe_embedding_lookup_sparse_rank3_matches_tf_nn(combiner, weighted, default_row):
    sp_keys, sp_rows, sp_w = sparse_pair(RANK3_INDICES, RANK3_ROWS, [2, 3, 4],
                                         RANK3_WEIGHTS if weighted else None)
    ev_default = None if default_row is None else int(KEYS[default_row])
    ev_out, dense_out, ev_g, dense_g = both_sides(
        lambda ev: evstore.safe_embedding_lookup_sparse(ev, sp_keys, sp_w, combiner=combiner,
                                                        default_id=ev_default),
        lambda d: tf.nn.safe_embedding_lookup_sparse(d, sp_rows, sp_w, combiner=combiner,
                                                     default_id=default_row),
        initial_rows())
    assert ev_out.shape == dense_out.shape == (2, 3, DIM)
    np.testing.assert_allclose(ev_out, dense_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ev_g, dense_g, atol=1e-6, rtol=0)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn", "sum"])
def test_safe_embedding_lookup_sparse_rank2_pads_empty_rows_like_tf_nn(combiner):
    sp_keys, sp_rows, _ = sparse_pair(RANK2_INDICES, RANK2_ROWS, [5, 4])
    ev_out, dense_out, ev_g, dense_g = both_sides(
        lambda ev: evstore.safe_embedding_lookup_sparse(ev, sp_keys, combiner=combiner),
        lambda d: tf.nn.safe_embedding_lookup_sparse(d, sp_rows, combiner=combiner),
        initial_rows())
    assert ev_out.shape == dense_out.shape == (5, DIM)
    np.testing.assert_array_equal(ev_out[[1, 4]], np.zeros((2, DIM), np.float32))
    np.testing.assert_allclose(ev_out, dense_out, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ev_g, dense_g, atol=1e-6, rtol=0)
