"""Bad input gets a clear error and changes nothing (docs/ARCHITECTURE.md, "Ops and Python API").

NaN/Inf policy (evstore/finite.py): a batch holding any non-finite EV gradient
is refused with InvalidArgumentError naming the key, and nothing is applied.
"""
import numpy as np
import pytest
import tensorflow as tf

import evstore
from evstore import ops

DIM = 4
KEYS = [11, 22, 33]


def trained_ev(name="bad", optimizer=None):
    """An EV holding KEYS, trained one step (so slots exist when an optimizer is given)."""
    ev = evstore.EmbeddingVariable(name, DIM)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant(KEYS, tf.int64)))
    if optimizer is not None:
        optimizer.apply_gradients([(tape.gradient(loss, ev), ev)])
    return ev


def snapshot(ev):
    """Everything an EV holds, sorted by key, as numpy."""
    exp = ev.export()
    order = np.argsort(exp["keys"].numpy())
    out = {f: exp[f].numpy()[order] for f in ("keys", "values", "versions", "freqs")}
    out.update({"slot:" + n: s.numpy()[order] for n, s in exp["slots"].items()})
    out["filtered_keys"] = np.sort(exp["filtered_keys"].numpy())
    out["size"] = int(ev.size())
    return out


def assert_unchanged(ev, before):
    after = snapshot(ev)
    assert sorted(after) == sorted(before)
    for field in before:
        np.testing.assert_array_equal(after[field], before[field], err_msg=field)


def raw_sgd(ev, keys, grads, step=5, lr=0.1):
    return ops.ev_apply_sgd(ev.resource_handle, keys, grads, tf.constant(step, tf.int64), tf.constant(lr))


# ---- ids of the wrong type -------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["training", "read_only"])
def test_int64_ids_to_an_int32_ev_raise_type_error_and_change_nothing(training):
    # (int32 ids into an int64 EV are cast, losslessly, as tf.nn accepts them: test_tf_nn_parity.py)
    ev = evstore.EmbeddingVariable("bad32", DIM, key_dtype=tf.int32)
    evstore.embedding_lookup(ev, tf.constant(KEYS, tf.int32))
    before = snapshot(ev)
    with pytest.raises(TypeError, match="int32 keys but ids are int64"):
        evstore.embedding_lookup(ev, tf.constant([11, 44], tf.int64), training=training)
    assert_unchanged(ev, before)


def test_string_ids_raise_type_error():
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(TypeError):
        evstore.embedding_lookup(ev, tf.constant(["11", "44"]))
    assert_unchanged(ev, before)


@pytest.mark.parametrize("ids", [tf.constant([1.0, 2.0]), [1.5, 2.0], np.array([3.0])],
                         ids=["float_tensor", "float_list", "float_numpy"])
def test_float_ids_raise_type_error_mentioning_integers(ids):
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(TypeError, match="integer"):
        evstore.embedding_lookup(ev, ids)
    assert_unchanged(ev, before)


def test_sparse_ids_of_the_wrong_dtype_raise_type_error():
    ev = trained_ev()
    sp = tf.SparseTensor([[0, 0]], tf.constant([11.0], tf.float32), [1, 1])
    with pytest.raises(TypeError):
        evstore.embedding_lookup_sparse(ev, sp)
    with pytest.raises(TypeError):
        evstore.safe_embedding_lookup_sparse(ev, sp)


def test_raw_apply_with_keys_of_the_wrong_dtype_does_not_claim_the_table_is_uninitialized():
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(tf.errors.OpError) as err:
        raw_sgd(ev, tf.constant([11], tf.int32), tf.ones([1, DIM]))
    assert "not initialized" not in err.value.message, err.value.message
    assert_unchanged(ev, before)


# ---- constructor arguments ------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, -3])
def test_non_positive_dim_raises_value_error(dim):
    with pytest.raises(ValueError, match="dim"):
        evstore.EmbeddingVariable("bad_dim", dim)


@pytest.mark.parametrize("dim", [2.5, "4", True, None], ids=["float", "str", "bool", "none"])
def test_non_int_dim_raises_type_error(dim):
    with pytest.raises(TypeError, match="dim"):
        evstore.EmbeddingVariable("bad_dim", dim)


@pytest.mark.parametrize("key_dtype", [tf.float32, tf.int16, tf.uint64, tf.bool])
def test_unsupported_key_dtype_raises_type_error(key_dtype):
    with pytest.raises(TypeError, match="key_dtype"):
        evstore.EmbeddingVariable("bad_kd", DIM, key_dtype=key_dtype)


@pytest.mark.parametrize("min_freq", [0, -1, 2.5, True, "3"])
def test_counter_filter_rejects_a_min_freq_that_is_not_a_positive_int(min_freq):
    with pytest.raises(ValueError, match="min_freq"):
        evstore.CounterFilter(min_freq)


def test_default_value_of_the_wrong_size_raises_value_error():
    with pytest.raises(ValueError, match="default_value"):
        evstore.EmbeddingVariable("bad_default", DIM, default_value=[1.0, 2.0])


# ---- a raw op's dim attr against the table's dim ------------------------------------------

@pytest.mark.parametrize("op, op_name", [
    (lambda ev, keys, dim: ops.ev_find(ev.resource_handle, keys, dim=dim), "EvFind"),
    (lambda ev, keys, dim: ops.ev_find_or_insert(ev.resource_handle, keys, tf.constant(0.0), dim=dim),
     "EvFindOrInsert"),
    (lambda ev, keys, dim: ops.ev_find_or_insert_counted(
        ev.resource_handle, keys, tf.ones_like(keys), tf.constant(0.0), dim=dim), "EvFindOrInsertCounted"),
    (lambda ev, keys, dim: ops.ev_read_rows(
        ev.resource_handle, keys, tf.constant([], tf.string), tf.constant([], tf.float32), dim=dim), "EvReadRows"),
], ids=["find", "find_or_insert", "find_or_insert_counted", "read_rows"])
def test_a_raw_op_whose_dim_is_not_the_tables_names_both_dims_and_changes_nothing(op, op_name):
    ev = trained_ev()
    before = snapshot(ev)
    message = f"{op_name} expects dim {DIM + 1} but the table has dim {DIM}"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        op(ev, tf.constant([11, 44], tf.int64), DIM + 1)
    assert_unchanged(ev, before)


# ---- gradients -------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, grad_shape", [
    ([11, 22], [2, DIM + 1]),
    ([11, 22], [3, DIM]),
    ([11, 22], [2 * DIM]),
    ([[11, 22]], [2, DIM]),
], ids=["wide_rows", "extra_rows", "flat", "rank2_keys"])
def test_raw_apply_with_a_mismatched_gradient_shape_raises_and_changes_nothing(keys, grad_shape):
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(tf.errors.InvalidArgumentError):
        raw_sgd(ev, tf.constant(keys, tf.int64), tf.ones(grad_shape))
    assert_unchanged(ev, before)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_raw_apply_with_a_non_finite_gradient_names_the_key_and_changes_nothing(bad):
    ev = trained_ev()
    before = snapshot(ev)
    grads = np.ones((3, DIM), np.float32)
    grads[2, 1] = bad
    with pytest.raises(tf.errors.InvalidArgumentError, match="key 33"):
        raw_sgd(ev, tf.constant(KEYS, tf.int64), tf.constant(grads))
    assert_unchanged(ev, before)


@pytest.mark.parametrize("make_opt", [
    lambda: evstore.optimizers.SGD(0.1, momentum=0.9),
    lambda: evstore.optimizers.Adagrad(0.1),
    lambda: evstore.optimizers.Adam(0.1),
], ids=["momentum", "adagrad", "adam"])
def test_optimizer_refuses_a_non_finite_ev_gradient_and_changes_neither_rows_nor_slots(make_opt):
    opt = make_opt()
    ev = trained_ev(optimizer=opt)
    before = snapshot(ev)
    grads = np.full((3, DIM), 0.5, np.float32)
    grads[0, 0] = np.nan
    with pytest.raises(tf.errors.InvalidArgumentError, match="key 11"):
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(grads), tf.constant(KEYS, tf.int64)), ev)])
    assert_unchanged(ev, before)
    assert int(opt.iterations) == 1


def test_optimizer_refusing_a_non_finite_ev_gradient_leaves_dense_variables_unchanged_too():
    opt, ev, kernel = evstore.optimizers.Adam(0.1), trained_ev(), tf.Variable([1.0, 2.0])
    good = tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([11], tf.int64))
    opt.apply_gradients([(tf.constant([1.0, 1.0]), kernel), (good, ev)])
    before, kernel_before = snapshot(ev), kernel.numpy()
    bad = tf.IndexedSlices(tf.constant([[np.inf] * DIM]), tf.constant([22], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="key 22"):
        opt.apply_gradients([(tf.constant([1.0, 1.0]), kernel), (bad, ev)])
    assert_unchanged(ev, before)
    assert int(opt.iterations) == 1
    np.testing.assert_array_equal(kernel.numpy(), kernel_before)


# ---- extreme keys --------------------------------------------------------------------------

HUGE = [2**62, -2**63, 2**63 - 1, -1, 0]


def test_huge_and_negative_int64_ids_work_as_keys():
    ev = evstore.EmbeddingVariable("huge", DIM, initializer=tf.constant_initializer(0.5))
    opt = evstore.optimizers.SGD(learning_rate=1.0)
    ids = tf.constant(HUGE, tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, ids))
    opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    assert int(ev.size()) == len(HUGE)
    exp = ev.export()
    assert sorted(exp["keys"].numpy().tolist()) == sorted(HUGE)
    out = evstore.embedding_lookup(ev, ids, training=False).numpy()
    np.testing.assert_allclose(out, np.full((len(HUGE), DIM), -0.5), atol=1e-6)
    np.testing.assert_array_equal(ev.frequency(ids).numpy(), [1] * len(HUGE))


# ---- sparse lookups -----------------------------------------------------------------------

SP = tf.SparseTensor([[0, 0], [1, 0]], tf.constant([11, 22], tf.int64), [2, 2])


@pytest.mark.parametrize("fn", [evstore.embedding_lookup_sparse, evstore.safe_embedding_lookup_sparse],
                         ids=["embedding_lookup_sparse", "safe_embedding_lookup_sparse"])
@pytest.mark.parametrize("combiner", ["max", "MEAN", ""])   # None means "mean", as in tf.nn
def test_unknown_combiner_raises_value_error(fn, combiner):
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(ValueError, match="combiner"):
        fn(ev, SP, combiner=combiner)
    assert_unchanged(ev, before)


@pytest.mark.parametrize("fn", [evstore.embedding_lookup_sparse, evstore.safe_embedding_lookup_sparse],
                         ids=["embedding_lookup_sparse", "safe_embedding_lookup_sparse"])
@pytest.mark.parametrize("sp_ids", [tf.constant([[11, 22]], tf.int64), [[11, 22]]],
                         ids=["dense_tensor", "list"])   # ragged ids are taken as tf.nn does (to_sparse)
def test_sp_ids_that_are_not_a_sparse_tensor_raise_type_error(fn, sp_ids):
    ev = trained_ev()
    before = snapshot(ev)
    with pytest.raises(TypeError, match="SparseTensor"):
        fn(ev, sp_ids)
    assert_unchanged(ev, before)


def test_sp_weights_that_are_not_a_sparse_tensor_raise_type_error():
    ev = trained_ev()
    with pytest.raises(TypeError, match="sp_weights"):
        evstore.embedding_lookup_sparse(ev, SP, sp_weights=tf.constant([1.0, 2.0]))


# ---- optimizer hyper-parameters ---------------------------------------------------------

@pytest.mark.parametrize("cls", [evstore.optimizers.SGD, evstore.optimizers.Adagrad, evstore.optimizers.Adam])
@pytest.mark.parametrize("lr", [0, 0.0, -0.1])
def test_non_positive_learning_rate_raises_value_error(cls, lr):
    with pytest.raises(ValueError, match="learning_rate"):
        cls(learning_rate=lr)


@pytest.mark.parametrize("kwargs", [{"beta_1": 1.0}, {"beta_1": -0.1}, {"beta_2": 1.0}, {"beta_2": 1.5}],
                         ids=["beta_1=1", "beta_1<0", "beta_2=1", "beta_2>1"])
def test_adam_beta_outside_zero_one_raises_value_error(kwargs):
    with pytest.raises(ValueError, match="beta"):
        evstore.optimizers.Adam(learning_rate=0.1, **kwargs)


def test_negative_adagrad_initial_accumulator_raises_value_error():
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        evstore.optimizers.Adagrad(learning_rate=0.1, initial_accumulator_value=-1.0)
