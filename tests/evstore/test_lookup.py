"""Lookup semantics of an EmbeddingVariable: counting, shapes, read-only lookups,
admission by CounterFilter, version stamps and export/load round trips (docs/ARCHITECTURE.md, "Ops and Python API")."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 4


def ids64(values):
    return tf.constant(values, tf.int64)


def read(ev, keys):
    """Read-only lookup of keys (int64 EV) as numpy."""
    return evstore.embedding_lookup(ev, ids64(keys), training=False).numpy()


def sgd_step(ev, opt, ids, **apply_kwargs):
    """One training step with loss = sum of the looked-up rows (gradient 1 per entry)."""
    with tf.GradientTape() as tape:
        emb = evstore.embedding_lookup(ev, ids)
        loss = tf.reduce_sum(emb)
    grads = tape.gradient(loss, [ev])
    opt.apply_gradients(zip(grads, [ev]), **apply_kwargs)
    return emb.numpy()


def by_key(export):
    """An eager export as {field: numpy array sorted by key}, slots flattened to slot:<name>."""
    order = np.argsort(export["keys"].numpy())
    out = {f: export[f].numpy()[order] for f in ("keys", "values", "versions", "freqs")}
    for name, s in export["slots"].items():
        out["slot:" + name] = s.numpy()[order]
    forder = np.argsort(export["filtered_keys"].numpy())
    out["filtered_keys"] = export["filtered_keys"].numpy()[forder]
    out["filtered_freqs"] = export["filtered_freqs"].numpy()[forder]
    return out


# ---- counting -------------------------------------------------------------------------

def test_training_lookup_counts_every_occurrence_of_a_duplicate_id():
    ev = evstore.EmbeddingVariable("count", DIM)
    evstore.embedding_lookup(ev, ids64([1, 1, 2]))
    evstore.embedding_lookup(ev, ids64([[1, 3], [1, 1]]))
    np.testing.assert_array_equal(ev.frequency(ids64([1, 2, 3, 4])).numpy(), [5, 1, 1, 0])


def test_duplicate_ids_in_a_batch_read_the_same_row():
    ev = evstore.EmbeddingVariable("dup", DIM)
    emb = evstore.embedding_lookup(ev, ids64([9, 4, 9, 9])).numpy()
    np.testing.assert_array_equal(emb[0], emb[2])
    np.testing.assert_array_equal(emb[0], emb[3])
    assert int(ev.size()) == 2


# ---- shapes and key dtypes ----------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["training", "read_only"])
@pytest.mark.parametrize("shape", [[0], [2, 0]], ids=["0", "2x0"])
def test_empty_batch_returns_shape_plus_dim(shape, training):
    ev = evstore.EmbeddingVariable("empty", DIM)
    out = evstore.embedding_lookup(ev, tf.zeros(shape, tf.int64), training=training)
    assert out.shape == tuple(shape) + (DIM,)
    assert out.dtype == tf.float32
    assert int(ev.size()) == 0


@pytest.mark.parametrize("key_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_keys_of_both_integer_dtypes_train_and_export(key_dtype):
    ev = evstore.EmbeddingVariable("kd", DIM, key_dtype=key_dtype, initializer=tf.constant_initializer(0.5))
    keys = tf.constant([7, 2**31 - 1, -5], key_dtype)
    sgd_step(ev, evstore.optimizers.SGD(learning_rate=1.0), keys)
    exp = ev.export()
    assert exp["keys"].dtype == key_dtype
    assert sorted(exp["keys"].numpy().tolist()) == [-5, 7, 2**31 - 1]
    out = evstore.embedding_lookup(ev, keys, training=False).numpy()
    np.testing.assert_allclose(out, np.full((3, DIM), -0.5), atol=1e-6)


@pytest.mark.parametrize("shape", [[], [5], [2, 3], [2, 1, 3]], ids=["scalar", "rank1", "rank2", "rank3"])
def test_ids_of_any_rank_give_ids_shape_plus_dim(shape):
    ev = evstore.EmbeddingVariable("rank", DIM)
    ids = tf.reshape(tf.range(1, 1 + int(np.prod(shape)), dtype=tf.int64), shape)
    out = evstore.embedding_lookup(ev, ids)
    assert out.shape == tuple(shape) + (DIM,)
    flat = evstore.embedding_lookup(ev, tf.reshape(ids, [-1]), training=False)
    np.testing.assert_array_equal(tf.reshape(out, [-1, DIM]).numpy(), flat.numpy())


# ---- read-only lookups ----------------------------------------------------------------

def test_read_only_lookup_never_inserts_or_counts():
    ev = evstore.EmbeddingVariable("ro", DIM)
    evstore.embedding_lookup(ev, ids64([1, 2]))
    before = by_key(ev.export())
    for _ in range(3):
        evstore.embedding_lookup(ev, ids64([1, 2, 3, 3, 4]), training=False)
    assert int(ev.size()) == 2
    np.testing.assert_array_equal(ev.frequency(ids64([1, 2, 3, 4])).numpy(), [1, 1, 0, 0])
    after = by_key(ev.export())
    for field in before:
        np.testing.assert_array_equal(after[field], before[field])


def test_read_only_lookup_returns_stored_rows_and_zeros_for_unknown_keys():
    ev = evstore.EmbeddingVariable("ro_rows", DIM)
    trained = evstore.embedding_lookup(ev, ids64([10, 20])).numpy()
    out = read(ev, [20, 99, 10])
    np.testing.assert_array_equal(out[0], trained[1])
    np.testing.assert_array_equal(out[1], np.zeros(DIM, np.float32))
    np.testing.assert_array_equal(out[2], trained[0])


@pytest.mark.parametrize("default_value, expected", [
    (-1.5, [-1.5] * DIM),
    ([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),
], ids=["scalar", "vector"])
def test_read_only_lookup_returns_custom_default_value_for_unknown_keys(default_value, expected):
    ev = evstore.EmbeddingVariable("ro_default", DIM, default_value=default_value)
    out = read(ev, [[5, 6]])
    np.testing.assert_allclose(out, np.array([[expected, expected]], np.float32))
    assert int(ev.size()) == 0


# ---- CounterFilter ------------------------------------------------------------------------

def filtered_ev():
    return evstore.EmbeddingVariable("filtered", DIM, initializer=tf.constant_initializer(0.5),
                                     default_value=-1.0, filter=evstore.CounterFilter(min_freq=3))


def test_counter_filter_key_seen_once_or_twice_reads_default_and_gets_no_update():
    ev, opt = filtered_ev(), evstore.optimizers.SGD(learning_rate=1.0)
    for sighting in (1, 2):
        emb = sgd_step(ev, opt, ids64([7]))
        np.testing.assert_array_equal(emb, np.full((1, DIM), -1.0, np.float32))
        assert not bool(ev.admitted(ids64([7]))[0])
        assert int(ev.frequency(ids64([7]))[0]) == sighting
        assert int(ev.version(ids64([7]))[0]) == -1
        np.testing.assert_array_equal(read(ev, [7]), np.full((1, DIM), -1.0, np.float32))
    assert int(ev.size()) == 0
    exp = ev.export()
    assert exp["keys"].numpy().size == 0
    np.testing.assert_array_equal(exp["filtered_keys"].numpy(), [7])
    np.testing.assert_array_equal(exp["filtered_freqs"].numpy(), [2])


def test_counter_filter_key_trains_from_its_third_sighting():
    ev, opt = filtered_ev(), evstore.optimizers.SGD(learning_rate=1.0)
    sgd_step(ev, opt, ids64([7]))
    sgd_step(ev, opt, ids64([7]))
    emb = sgd_step(ev, opt, ids64([7]))
    np.testing.assert_allclose(emb, np.full((1, DIM), 0.5), atol=1e-6)   # its fresh initial row
    assert bool(ev.admitted(ids64([7]))[0])
    np.testing.assert_allclose(read(ev, [7]), np.full((1, DIM), -0.5), atol=1e-6)   # 0.5 - 1.0 * 1
    assert int(ev.version(ids64([7]))[0]) == 2
    sgd_step(ev, opt, ids64([7]))
    np.testing.assert_allclose(read(ev, [7]), np.full((1, DIM), -1.5), atol=1e-6)


def test_counter_filter_admits_on_the_batch_that_reaches_min_freq_for_every_occurrence():
    ev, opt = filtered_ev(), evstore.optimizers.SGD(learning_rate=0.25)
    emb = sgd_step(ev, opt, ids64([3, 8, 3, 3]))
    np.testing.assert_allclose(emb[[0, 2, 3]], np.full((3, DIM), 0.5), atol=1e-6)
    np.testing.assert_array_equal(emb[1], np.full(DIM, -1.0, np.float32))
    # Three occurrences of key 3, each with gradient 1: summed before the apply.
    np.testing.assert_allclose(read(ev, [3]), np.full((1, DIM), 0.5 - 0.25 * 3), atol=1e-6)
    assert int(ev.size()) == 1


# ---- versions ----------------------------------------------------------------------------

def test_versions_are_stamped_with_optimizer_iterations():
    ev, opt = evstore.EmbeddingVariable("ver", DIM), evstore.optimizers.SGD(learning_rate=0.1)
    sgd_step(ev, opt, ids64([1, 2]))
    sgd_step(ev, opt, ids64([2, 3]))
    sgd_step(ev, opt, ids64([3]))
    assert int(opt.iterations) == 3
    np.testing.assert_array_equal(ev.version(ids64([1, 2, 3, 4])).numpy(), [0, 1, 2, -1])


def test_a_looked_up_key_without_an_update_has_version_minus_one():
    ev = evstore.EmbeddingVariable("ver_none", DIM)
    evstore.embedding_lookup(ev, ids64([5]))
    assert int(ev.version(ids64([5]))[0]) == -1


@pytest.mark.parametrize("step", [100, tf.constant(2**40, tf.int64)], ids=["int", "tensor"])
def test_versions_are_stamped_with_apply_gradients_global_step(step):
    ev, opt = evstore.EmbeddingVariable("ver_gs", DIM), evstore.optimizers.Adam(learning_rate=0.1)
    sgd_step(ev, opt, ids64([1, 2]), global_step=step)
    np.testing.assert_array_equal(ev.version(ids64([1, 2])).numpy(), [int(step)] * 2)
    sgd_step(ev, opt, ids64([2]))   # without global_step: opt.iterations (1) again
    np.testing.assert_array_equal(ev.version(ids64([1, 2])).numpy(), [int(step), 1])


# ---- export / load --------------------------------------------------------------------

def trained_ev_with_filtered_keys():
    ev = evstore.EmbeddingVariable("src", DIM, filter=evstore.CounterFilter(min_freq=2))
    opt = evstore.optimizers.Adam(learning_rate=0.05)
    for ids in ([1, 1, 2, 2, 3], [2, 3, 4, 10**12], [3, 5, 2, 4]):
        sgd_step(ev, opt, ids64(ids))
    return ev


def load_export(ev, exp):
    return ev.load(exp["keys"], exp["values"], versions=exp["versions"], freqs=exp["freqs"],
                   slots=exp["slots"], filtered_keys=exp["filtered_keys"],
                   filtered_freqs=exp["filtered_freqs"])


def test_export_then_load_into_a_fresh_ev_round_trips_every_field():
    src = trained_ev_with_filtered_keys()
    exp = src.export()
    want = by_key(exp)
    assert sorted(want) == sorted(["keys", "values", "versions", "freqs", "slot:m", "slot:v",
                                   "filtered_keys", "filtered_freqs"])
    assert want["filtered_keys"].tolist() == [5, 10**12]
    dst = evstore.EmbeddingVariable("dst", DIM, filter=evstore.CounterFilter(min_freq=2))
    load_export(dst, exp)
    got = by_key(dst.export())
    assert sorted(got) == sorted(want)
    for field in want:
        np.testing.assert_array_equal(got[field], want[field], err_msg=field)
    assert int(dst.size()) == int(src.size()) == 4
    np.testing.assert_array_equal(read(dst, [1, 2, 3, 4, 5]), read(src, [1, 2, 3, 4, 5]))


def test_loaded_filtered_key_keeps_its_count_and_is_admitted_at_min_freq():
    src = trained_ev_with_filtered_keys()
    dst = evstore.EmbeddingVariable("dst2", DIM, filter=evstore.CounterFilter(min_freq=2))
    load_export(dst, src.export())
    assert not bool(dst.admitted(ids64([5]))[0])
    evstore.embedding_lookup(dst, ids64([5]))
    assert bool(dst.admitted(ids64([5]))[0])
    assert int(dst.frequency(ids64([5]))[0]) == 2


def test_loaded_rows_continue_training_like_the_source():
    src = trained_ev_with_filtered_keys()
    dst = evstore.EmbeddingVariable("dst3", DIM, filter=evstore.CounterFilter(min_freq=2))
    load_export(dst, src.export())
    # Same slots, same step: one more Adam step gives the same rows on both.
    for ev in (src, dst):
        opt = evstore.optimizers.Adam(learning_rate=0.05)
        sgd_step(ev, opt, ids64([1, 2, 3]), global_step=7)
    np.testing.assert_array_equal(read(dst, [1, 2, 3]), read(src, [1, 2, 3]))
