"""evstore.training's functional applies: a v1 graph-mode Session trains an EV with
Adam exactly as the eager optimizer does."""
import numpy as np
import tensorflow as tf

import evstore

DIM = 4
BANK = np.random.default_rng(3).normal(size=(8, DIM)).astype(np.float32)
BATCHES = [[1, 2, 2, 9], [9, 1, 4, 4], [2, 4, 1, 9]]


def _ev(name):
    return evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(BANK), initializer_bank_size=8)


def _sorted(export):
    order = np.argsort(export["keys"])
    return {k: np.asarray(export[k])[order] for k in ("keys", "values", "versions", "freqs")}


def test_v1_session_adam_matches_eager_optimizer():
    ev = _ev("fn_eager")
    opt = evstore.optimizers.Adam(0.05)
    for b in BATCHES:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, tf.constant(b, tf.int64)) - 1.0))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    eager = _sorted({k: v.numpy() for k, v in ev.export().items() if k != "slots"})

    with tf.Graph().as_default():
        gev = _ev("fn_graph")
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        step = tf.compat.v1.placeholder(tf.int64, [])
        loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(gev, ids) - 1.0))
        grad = tf.compat.v1.gradients(loss, [gev])[0]
        assert isinstance(grad, tf.IndexedSlices)
        train = evstore.training.sparse_apply_adam(gev, grad, 0.05, step)
        exp = gev.export()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.tables_initializer())
            for i, b in enumerate(BATCHES):
                sess.run(train, {ids: b, step: i})
            graph = _sorted(sess.run({k: exp[k] for k in ("keys", "values", "versions", "freqs")}))
    for k in eager:
        np.testing.assert_allclose(graph[k], eager[k], rtol=0, atol=1e-6, err_msg=k)


def test_sparse_apply_refuses_a_dense_gradient():
    ev = _ev("fn_dense")
    try:
        evstore.training.sparse_apply_sgd(ev, tf.zeros([2, DIM]), 0.1, 0)
    except TypeError as e:
        assert "IndexedSlices" in str(e)
    else:
        raise AssertionError("a dense gradient was accepted")
