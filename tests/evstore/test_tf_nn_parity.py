"""The tf.nn embedding API points where evstore's lookups follow tf.nn:
max_norm, combiner=None, int32 ids into an int64 EV, float64 weights in the
safe variant, RaggedTensor ids. Each result is compared with tf.nn on a
dense tensor holding the same rows."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

N, D = 6, 4
ROWS = (np.arange(N * D, dtype=np.float32).reshape(N, D) - 7.0) / 3.0


@pytest.fixture
def ev():
    e = evstore.EmbeddingVariable("nn", D)
    e.load(np.arange(N), ROWS)
    return e


def _sp(dense_ids, dtype=tf.int64):
    ids = tf.constant(dense_ids, dtype)
    return tf.sparse.from_dense(ids) if not isinstance(dense_ids, tf.SparseTensor) else dense_ids


SP_INDICES = [[0, 0], [0, 1], [1, 0], [3, 0], [3, 1], [3, 2]]
SP_VALUES = [1, 2, 3, 0, 5, 5]


def _sparse(dtype=tf.int64):
    return tf.SparseTensor(SP_INDICES, tf.constant(SP_VALUES, dtype), [4, 3])


def _weights(dtype=tf.float32):
    return tf.SparseTensor(SP_INDICES, tf.constant([1.0, 0.5, 2.0, 1.5, 0.25, 1.0], dtype), [4, 3])


@pytest.mark.parametrize("training", [True, False])
def test_max_norm_clips_looked_up_rows_like_tf_nn(ev, training):
    ids = tf.constant([[1, 5], [0, 2]], tf.int64)
    got = evstore.embedding_lookup(ev, ids, training=training, max_norm=1.5)
    np.testing.assert_allclose(got, tf.nn.embedding_lookup(ROWS, ids, max_norm=1.5), rtol=1e-6)


def test_max_norm_leaves_stored_rows_unchanged(ev):
    evstore.embedding_lookup(ev, tf.constant([1, 5], tf.int64), max_norm=0.5)
    x = ev.export()
    np.testing.assert_array_equal(x["values"].numpy()[np.argsort(x["keys"].numpy())], ROWS)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_max_norm_in_sparse_lookups_like_tf_nn(ev, combiner):
    got = evstore.embedding_lookup_sparse(ev, _sparse(), _weights(), combiner=combiner, max_norm=2.0)
    want = tf.nn.embedding_lookup_sparse(ROWS, _sparse(), _weights(), combiner=combiner, max_norm=2.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = evstore.safe_embedding_lookup_sparse(ev, _sparse(), _weights(), combiner=combiner, max_norm=2.0)
    want = tf.nn.safe_embedding_lookup_sparse(ROWS, _sparse(), _weights(), combiner=combiner, max_norm=2.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_max_norm_gradient_reaches_the_ev_like_a_dense_variable(ev):
    dense = tf.Variable(ROWS)
    ids = tf.constant([1, 5, 5], tf.int64)
    with tf.GradientTape(persistent=True) as tape:
        a = tf.reduce_sum(evstore.embedding_lookup(ev, ids, max_norm=1.5) ** 2)
        b = tf.reduce_sum(tf.nn.embedding_lookup(dense, ids, max_norm=1.5) ** 2)
    g_ev, g_dense = tape.gradient(a, ev), tf.convert_to_tensor(tape.gradient(b, dense))
    summed = tf.math.unsorted_segment_sum(g_ev.values, g_ev.indices, N)
    np.testing.assert_allclose(summed, g_dense, rtol=1e-6)


def test_combiner_none_means_mean_like_tf_nn(ev):
    got = evstore.embedding_lookup_sparse(ev, _sparse(), None, combiner=None)
    np.testing.assert_allclose(got, tf.nn.embedding_lookup_sparse(ROWS, _sparse(), None, combiner=None), rtol=1e-6)
    got = evstore.safe_embedding_lookup_sparse(ev, _sparse(), _weights(), combiner=None)
    want = tf.nn.safe_embedding_lookup_sparse(ROWS, _sparse(), _weights(), combiner=None)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_int32_ids_into_int64_ev_are_cast_like_tf_nn(ev):
    ids = tf.constant([[3, 1], [0, 0]], tf.int32)
    np.testing.assert_array_equal(evstore.embedding_lookup(ev, ids), tf.nn.embedding_lookup(ROWS, ids))
    got = evstore.embedding_lookup_sparse(ev, _sparse(tf.int32), None, combiner="sum")
    np.testing.assert_array_equal(got, tf.nn.embedding_lookup_sparse(ROWS, _sparse(tf.int32), None, combiner="sum"))
    got = evstore.safe_embedding_lookup_sparse(ev, _sparse(tf.int32), None, combiner="sum", default_id=2)
    want = tf.nn.safe_embedding_lookup_sparse(ROWS, _sparse(tf.int32), None, combiner="sum", default_id=2)
    np.testing.assert_array_equal(got, want)


def test_int64_ids_into_int32_ev_still_raise_type_error():
    e32 = evstore.EmbeddingVariable("nn32", D, key_dtype=tf.int32)
    with pytest.raises(TypeError, match="int32 keys but ids are int64"):
        evstore.embedding_lookup(e32, tf.constant([1], tf.int64))


def test_float64_weights_in_safe_lookup_raise_like_tf_nn(ev):
    with pytest.raises(ValueError):
        tf.nn.safe_embedding_lookup_sparse(tf.constant(ROWS), _sparse(), _weights(tf.float64))
    with pytest.raises(ValueError, match="float64 but EmbeddingVariable 'nn' holds float32"):
        evstore.safe_embedding_lookup_sparse(ev, _sparse(), _weights(tf.float64))
    assert int(ev.frequency([1])[0]) == 0   # refused before any lookup counted


def test_float64_weights_in_non_safe_lookup_are_cast_like_tf_nn(ev):
    got = evstore.embedding_lookup_sparse(ev, _sparse(), _weights(tf.float64), combiner="sum")
    want = tf.nn.embedding_lookup_sparse(ROWS, _sparse(), _weights(tf.float64), combiner="sum")
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("training", [True, False])
def test_ragged_ids_give_ragged_rows_like_tf_nn(ev, training):
    ids = tf.ragged.constant([[0, 1, 5], [], [2]], dtype=tf.int64)
    got = evstore.embedding_lookup(ev, ids, training=training)
    want = tf.nn.embedding_lookup(ROWS, ids)
    assert isinstance(got, tf.RaggedTensor)
    assert got.shape.as_list() == want.shape.as_list() == [3, None, D]
    np.testing.assert_array_equal(got.row_splits, want.row_splits)
    np.testing.assert_array_equal(got.flat_values, want.flat_values)


def test_ragged_ids_train_the_ev(ev):
    ids = tf.ragged.constant([[0, 1], [1]], dtype=tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, ids).flat_values)
    g = tape.gradient(loss, ev)
    np.testing.assert_array_equal(g.indices, [0, 1, 1])


def test_ragged_ids_in_sparse_lookups_like_tf_nn(ev):
    ids = tf.ragged.constant([[0, 1], [5], []], dtype=tf.int64)
    for combiner in ("sum", "mean"):
        got = evstore.embedding_lookup_sparse(ev, ids, None, combiner=combiner)
        np.testing.assert_allclose(got, tf.nn.embedding_lookup_sparse(ROWS, ids, None, combiner=combiner), rtol=1e-6)
        got = evstore.safe_embedding_lookup_sparse(ev, ids, None, combiner=combiner)
        want = tf.nn.safe_embedding_lookup_sparse(ROWS, ids, None, combiner=combiner)
        np.testing.assert_allclose(got, want, rtol=1e-6)
