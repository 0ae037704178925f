"""Feature admission: CounterFilter and BloomFilter (docs/ARCHITECTURE.md, "Table" and
"Ops and Python API"; DeepRec's semantics).

A key below min_freq reads default_value, owns no row and gets no update; the
training lookup whose batch brings its count to min_freq admits it. Counts
include every occurrence in a batch."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 3
INIT = 0.5


def ids64(values):
    return tf.constant(values, tf.int64)


def make_ev(name, flt, **kw):
    return evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(INIT), filter=flt, **kw)


def sgd_step(ev, opt, ids, step=None):
    """One step with loss = sum of rows (gradient 1 per occurrence)."""
    with tf.GradientTape() as tape:
        emb = evstore.embedding_lookup(ev, ids64(ids))
        loss = tf.reduce_sum(emb)
    opt.apply_gradients([(tape.gradient(loss, ev), ev)], global_step=step)
    return emb.numpy()


def read(ev, keys):
    return evstore.embedding_lookup(ev, ids64(keys), training=False).numpy()


FILTERS = {
    "counter": lambda: evstore.CounterFilter(min_freq=3),
    "bloom": lambda: evstore.BloomFilter(min_freq=3, capacity=10_000, fp_rate=0.001),
}


@pytest.mark.parametrize("kind", sorted(FILTERS))
def test_ids_seen_once_or_twice_read_zeros_and_get_no_update(kind):
    ev, opt = make_ev(f"f_{kind}_a", FILTERS[kind]()), evstore.optimizers.SGD(1.0)
    for _ in range(2):
        emb = sgd_step(ev, opt, [11, 12])
        np.testing.assert_array_equal(emb, np.zeros((2, DIM), np.float32))
    assert not ev.admitted(ids64([11, 12])).numpy().any()
    np.testing.assert_array_equal(read(ev, [11, 12]), np.zeros((2, DIM), np.float32))
    assert int(ev.size()) == 0 and ev.export()["keys"].numpy().size == 0


@pytest.mark.parametrize("kind", sorted(FILTERS))
def test_ids_train_from_their_third_sighting(kind):
    ev, opt = make_ev(f"f_{kind}_b", FILTERS[kind]()), evstore.optimizers.SGD(1.0)
    sgd_step(ev, opt, [21])
    sgd_step(ev, opt, [21])
    emb = sgd_step(ev, opt, [21])
    np.testing.assert_allclose(emb, np.full((1, DIM), INIT))            # its fresh initial row
    np.testing.assert_allclose(read(ev, [21]), np.full((1, DIM), INIT - 1.0))   # and its first update
    assert int(ev.frequency(ids64([21]))[0]) == 3 and int(ev.version(ids64([21]))[0]) == 2
    sgd_step(ev, opt, [21])
    np.testing.assert_allclose(read(ev, [21]), np.full((1, DIM), INIT - 2.0))


@pytest.mark.parametrize("kind", sorted(FILTERS))
def test_frequencies_count_every_occurrence_in_a_batch(kind):
    ev, opt = make_ev(f"f_{kind}_c", FILTERS[kind]()), evstore.optimizers.SGD(0.5)
    emb = sgd_step(ev, opt, [31, 32, 31, 31, 32])   # 31 reaches 3 in this batch, 32 has 2
    np.testing.assert_allclose(emb[[0, 2, 3]], np.full((3, DIM), INIT))
    np.testing.assert_array_equal(emb[[1, 4]], np.zeros((2, DIM), np.float32))
    np.testing.assert_allclose(read(ev, [31]), np.full((1, DIM), INIT - 0.5 * 3))  # 3 summed gradients
    assert ev.admitted(ids64([31, 32])).numpy().tolist() == [True, False]
    assert int(ev.frequency(ids64([31]))[0]) == 3
    emb = sgd_step(ev, opt, [32])
    np.testing.assert_allclose(emb, np.full((1, DIM), INIT))


def test_counter_filter_keeps_only_index_metadata_for_keys_not_admitted():
    ev = make_ev("f_meta", evstore.CounterFilter(5))
    evstore.embedding_lookup(ev, ids64(np.arange(1000)))
    s = ev.stats()
    assert (s["size"], s["admitted"], s["filtered"]) == (1000, 0, 1000)
    assert s["row_bytes"] == 0 and s["meta_bytes"] == 0 and s["filter_bytes"] == 0
    np.testing.assert_array_equal(ev.frequency(ids64([0, 999])).numpy(), [1, 1])


def test_bloom_filter_keys_not_admitted_cost_nothing_per_key():
    ev = make_ev("f_bloom_cost", evstore.BloomFilter(3, capacity=100_000, fp_rate=0.01))
    before = ev.stats()
    evstore.embedding_lookup(ev, ids64(np.arange(50_000)))        # 50k distinct keys, seen once
    after = ev.stats()
    assert after["size"] == 0 and after["admitted"] == 0
    assert after["bytes"] == before["bytes"]                    # nothing grew
    assert after["filter_bytes"] == before["filter_bytes"] >= evstore.BloomFilter(3, 100_000).num_counters
    assert 45_000 <= after["filtered"] <= 55_000                # estimated distinct keys counted
    np.testing.assert_array_equal(ev.frequency(ids64([7])).numpy(), [0])   # no entry: no exact count


def test_bloom_filter_admits_early_sometimes_but_never_late():
    """With 8x more distinct keys than its capacity the filter's counters are
    shared: some keys are admitted on their first sighting (false positives),
    but every key is admitted by its min_freq-th sighting."""
    ev = make_ev("f_bloom_fp", evstore.BloomFilter(2, capacity=2_000, fp_rate=0.05))
    keys = np.arange(16_000, dtype=np.int64) * 7 + 3
    evstore.embedding_lookup(ev, ids64(keys))
    early = int(ev.size())
    assert 0 < early < len(keys)
    evstore.embedding_lookup(ev, ids64(keys))
    assert int(ev.size()) == len(keys)                          # never late
    # Within capacity, early admissions stay below the target rate.
    ev2 = make_ev("f_bloom_fp2", evstore.BloomFilter(2, capacity=20_000, fp_rate=0.05))
    evstore.embedding_lookup(ev2, ids64(keys))
    assert int(ev2.size()) <= 0.05 * len(keys)


def test_filtered_counts_survive_a_checkpoint_and_a_new_min_freq_keeps_admitted_keys(tmp_path):
    ev = make_ev("f_ck", evstore.CounterFilter(3))
    evstore.embedding_lookup(ev, ids64([1, 1, 1, 2, 2, 3]))     # 1 admitted; 2 and 3 counted
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    ev2 = make_ev("f_ck", evstore.CounterFilter(5))              # stricter filter after restore
    tf.train.Checkpoint(ev=ev2).restore(path).assert_consumed()
    assert ev2.admitted(ids64([1, 2, 3])).numpy().tolist() == [True, False, False]
    np.testing.assert_array_equal(ev2.frequency(ids64([1, 2, 3])).numpy(), [3, 2, 1])
    evstore.embedding_lookup(ev2, ids64([2, 2]))                 # 2 + 2 = 4 < 5
    assert not bool(ev2.admitted(ids64([2]))[0])
    evstore.embedding_lookup(ev2, ids64([2]))                    # 5: admitted
    assert bool(ev2.admitted(ids64([2]))[0])
    ev3 = make_ev("f_ck", evstore.CounterFilter(2))              # looser: 2 admitted at its next sighting
    tf.train.Checkpoint(ev=ev3).restore(path)
    evstore.embedding_lookup(ev3, ids64([2]))
    assert ev3.admitted(ids64([1, 2, 3])).numpy().tolist() == [True, True, False]


def test_export_and_load_round_trip_filtered_counts():
    ev = make_ev("f_exp", evstore.CounterFilter(3))
    evstore.embedding_lookup(ev, ids64([4, 4, 4, 5]))
    e = ev.export()
    ev2 = make_ev("f_exp2", evstore.CounterFilter(3))
    ev2.load(e["keys"], e["values"], versions=e["versions"], freqs=e["freqs"],
             filtered_keys=e["filtered_keys"], filtered_freqs=e["filtered_freqs"], clear=True)
    np.testing.assert_array_equal(ev2.frequency(ids64([4, 5])).numpy(), [3, 1])
    assert ev2.admitted(ids64([4, 5])).numpy().tolist() == [True, False]


def test_keras_embedding_passes_the_filter_through():
    layer = evstore.keras.Embedding(DIM, filter=evstore.BloomFilter(2, capacity=1000))
    layer(ids64([[1, 2]]), training=True)
    assert isinstance(layer.ev.filter, evstore.BloomFilter) and int(layer.ev.size()) == 0
    layer(ids64([[1]]), training=True)
    assert int(layer.ev.size()) == 1


# ---- bad parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: evstore.CounterFilter(0), "min_freq must be an int >= 1"),
    (lambda: evstore.CounterFilter(-3), "min_freq must be an int >= 1"),
    (lambda: evstore.CounterFilter(2.5), "min_freq must be an int >= 1"),
    (lambda: evstore.BloomFilter(0), "min_freq must be an int >= 1"),
    (lambda: evstore.BloomFilter(256), "min_freq must be <= 255"),
    (lambda: evstore.BloomFilter(3, fp_rate=0.0), r"fp_rate must be a float in \(0, 1\)"),
    (lambda: evstore.BloomFilter(3, fp_rate=1.0), r"fp_rate must be a float in \(0, 1\)"),
    (lambda: evstore.BloomFilter(3, fp_rate=-0.1), r"fp_rate must be a float in \(0, 1\)"),
    (lambda: evstore.BloomFilter(3, fp_rate=float("nan")), r"fp_rate must be a float in \(0, 1\)"),
    (lambda: evstore.BloomFilter(3, capacity=0), "capacity must be an int >= 1"),
], ids=["counter0", "counter-3", "counter2.5", "bloom0", "bloom256", "fp0", "fp1", "fp-neg", "fp-nan", "cap0"])
def test_bad_filter_parameters_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_filter_of_the_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="filter must be an evstore.CounterFilter, evstore.BloomFilter"):
        evstore.EmbeddingVariable("f_bad", DIM, filter=3)
