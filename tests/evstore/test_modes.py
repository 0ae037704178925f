"""The same lookup + apply works eagerly, inside tf.function and in tf.compat.v1 graph
mode with a Session, and every mode leaves the same table (docs/ARCHITECTURE.md, "Ops and Python API").

What works where (found by these tests):
  * eager and tf.function: tape gradients + evstore optimizers, or the raw apply ops.
  * tf.compat.v1 graph + Session: training lookups, `tf.compat.v1.gradients` w.r.t.
    the EV (IndexedSlices of keys) or w.r.t. the lookup output, and the raw fused
    apply ops (`evstore.ops.ev_apply_*`). The evstore optimizers are Keras 3
    optimizers: in a v1 graph `apply_gradients` returns Keras's `iterations`
    variable, not a runnable train op, so they are not a graph-mode training API.
"""
import numpy as np
import pytest
import tensorflow as tf

import evstore
from evstore import ops

DIM = 3
BANK = np.random.default_rng(0).normal(size=(16, DIM)).astype(np.float32)
LR = 0.1
# Batches with duplicates and keys that appear in later batches for the first time.
BATCHES = [[1, 1, 2, 30], [2, 30, 30, 7], [7, 1, 2**40, 2**40], [5, 1, 30, 7]]
TARGETS = [np.random.default_rng(i + 1).normal(size=(len(b), DIM)).astype(np.float32)
           for i, b in enumerate(BATCHES)]


def new_ev(name="modes"):
    # A constant bank: every EV (eager or graph) gives key k the same initial row.
    return evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(BANK),
                                     initializer_bank_size=len(BANK))


def loss_of(emb, target):
    return tf.reduce_sum(tf.square(emb - target))


def table(export):
    """{field: numpy array sorted by key} of an export (eager tensors or fetched numpy)."""
    as_np = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in export.items()
             if k in ("keys", "values", "versions", "freqs")}
    order = np.argsort(as_np["keys"])
    return {k: v[order] for k, v in as_np.items()}


def assert_same_table(got, want):
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["versions"], want["versions"])
    np.testing.assert_array_equal(got["freqs"], want["freqs"])
    np.testing.assert_allclose(got["values"], want["values"], atol=1e-6, rtol=0)


def eager_raw_apply_table():
    ev = new_ev("eager")
    for step, (ids, target) in enumerate(zip(BATCHES, TARGETS)):
        with tf.GradientTape() as tape:
            loss = loss_of(evstore.embedding_lookup(ev, tf.constant(ids, tf.int64)), target)
        grad = tape.gradient(loss, ev)
        ops.ev_apply_sgd(ev.resource_handle, grad.indices, grad.values, tf.constant(step, tf.int64),
                         tf.constant(LR))
    return table(ev.export())


def test_eager_training_moves_rows_and_stamps_versions():
    got = eager_raw_apply_table()
    assert got["keys"].tolist() == [1, 2, 5, 7, 30, 2**40]
    assert got["freqs"].tolist() == [4, 2, 1, 3, 4, 2]
    assert got["versions"].tolist() == [3, 1, 3, 3, 3, 2]
    initial = {k: evstore.embedding_lookup(new_ev("fresh"), tf.constant([k], tf.int64)).numpy()[0]
               for k in got["keys"].tolist()}
    for key, row in zip(got["keys"].tolist(), got["values"]):
        assert np.abs(row - initial[key]).max() > 1e-3, f"row of key {key} did not train"


def test_tf_function_training_matches_eager():
    ev = new_ev("fn")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, DIM], tf.float32),
                                  tf.TensorSpec([], tf.int64)])
    def train_step(ids, target, step):
        with tf.GradientTape() as tape:
            loss = loss_of(evstore.embedding_lookup(ev, ids), target)
        grad = tape.gradient(loss, ev)
        ops.ev_apply_sgd(ev.resource_handle, grad.indices, grad.values, step, tf.constant(LR))

    for step, (ids, target) in enumerate(zip(BATCHES, TARGETS)):
        train_step(tf.constant(ids, tf.int64), target, tf.constant(step, tf.int64))
    assert_same_table(table(ev.export()), eager_raw_apply_table())


@pytest.mark.parametrize("wrap", [False, True], ids=["eager", "tf_function"])
def test_evstore_optimizer_matches_the_raw_apply_op(wrap):
    ev, opt = new_ev("opt"), evstore.optimizers.SGD(learning_rate=LR)

    def train_step(ids, target):
        with tf.GradientTape() as tape:
            loss = loss_of(evstore.embedding_lookup(ev, ids), target)
        grads = tape.gradient(loss, [ev])
        opt.apply_gradients(zip(grads, [ev]))

    if wrap:
        train_step = tf.function(train_step, reduce_retracing=True)
    for ids, target in zip(BATCHES, TARGETS):
        train_step(tf.constant(ids, tf.int64), tf.constant(target))
    assert_same_table(table(ev.export()), eager_raw_apply_table())


def graph_session_table(grad_wrt):
    """Trains BATCHES in a tf.compat.v1 graph with a Session; grad_wrt is 'ev' or 'lookup'."""
    with tf.Graph().as_default():
        ev = new_ev("graph")
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        target = tf.compat.v1.placeholder(tf.float32, [None, DIM])
        step = tf.compat.v1.placeholder(tf.int64, [])
        emb = evstore.embedding_lookup(ev, ids)
        loss = loss_of(emb, target)
        if grad_wrt == "ev":
            (grad,) = tf.compat.v1.gradients(loss, [ev])
            assert isinstance(grad, tf.IndexedSlices)
            keys, rows = grad.indices, grad.values
        else:
            (rows,) = tf.compat.v1.gradients(loss, [emb])
            keys = ids
        apply = ops.ev_apply_sgd(ev.resource_handle, keys, rows, step, tf.constant(LR))
        export = ev.export()
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.tables_initializer(), tf.compat.v1.global_variables_initializer()])
            for i, (b, t) in enumerate(zip(BATCHES, TARGETS)):
                sess.run(apply, {ids: b, target: t, step: i})
            return table(sess.run({k: export[k] for k in ("keys", "values", "versions", "freqs")}))


def test_graph_session_with_gradients_wrt_ev_matches_eager():
    assert_same_table(graph_session_table("ev"), eager_raw_apply_table())


def test_graph_session_with_gradients_wrt_lookup_output_matches_eager():
    assert_same_table(graph_session_table("lookup"), eager_raw_apply_table())


def test_graph_session_read_only_lookup_reads_trained_rows():
    with tf.Graph().as_default():
        ev = new_ev("graph_ro")
        ids = tf.constant([1, 2, 99], tf.int64)
        train = evstore.embedding_lookup(ev, ids[:2])
        read = evstore.embedding_lookup(ev, ids, training=False)
        size = ev.size()
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.tables_initializer(), tf.compat.v1.global_variables_initializer()])
            trained = sess.run(train)
            got, n = sess.run([read, size])
    np.testing.assert_array_equal(got[:2], trained)
    np.testing.assert_array_equal(got[2], np.zeros(DIM, np.float32))
    assert n == 2


# ---- graph mode without initialization ---------------------------------------------------

def assert_names_tables_initializer(error):
    """The error text (without TF's stack traces) tells the user to run tables_initializer()."""
    text = error.message.split("Original stack trace")[0]
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("File "))
    assert "tf.compat.v1.tables_initializer()" in text, text

@pytest.mark.parametrize("training", [False, True], ids=["read_only", "training"])
def test_graph_lookup_without_initializer_raises_failed_precondition_naming_tables_initializer(training):
    with tf.Graph().as_default():
        ev = new_ev("uninit")
        emb = evstore.embedding_lookup(ev, tf.constant([1, 2], tf.int64), training=training)
        with tf.compat.v1.Session() as sess:
            with pytest.raises(tf.errors.FailedPreconditionError) as err:
                sess.run(emb)
    assert_names_tables_initializer(err.value)


def test_graph_training_lookup_with_only_global_variables_initialized_names_tables_initializer():
    with tf.Graph().as_default():
        ev = new_ev("uninit_table")
        emb = evstore.embedding_lookup(ev, tf.constant([1, 2], tf.int64))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.FailedPreconditionError) as err:
                sess.run(emb)
    assert_names_tables_initializer(err.value)
