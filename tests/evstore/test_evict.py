"""Feature eviction: GlobalStepEvict, L2WeightEvict (docs/ARCHITECTURE.md, "Table"; DeepRec's semantics).

Evicted keys leave the table like `remove`: rows to the free list, keys to the
deleted set (observed through `ev.begin_export()`)."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 2
INIT = 0.25


def ids64(values):
    return tf.constant(values, tf.int64)


def make_ev(name, evict, **kw):
    return evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(INIT), evict=evict, **kw)


def sgd_step(ev, opt, ids, step):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, ids64(ids)))
    opt.apply_gradients([(tape.gradient(loss, ev), ev)], global_step=step)


def sealed(ev):
    """(dirty, deleted) key sets sealed and committed now."""
    sid, dirty, deleted = ev.begin_export()
    ev.commit_export(sid)
    return set(dirty.numpy().tolist()), set(deleted.numpy().tolist())


def keys_of(ev):
    return sorted(ev.export()["keys"].numpy().tolist())


def test_steps_to_live_2_evicts_the_key_not_updated_for_three_steps():
    ev, opt = make_ev("ev_ttl", evstore.GlobalStepEvict(steps_to_live=2)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1, 2, 3], step=0)
    for step in (1, 2, 3):
        sgd_step(ev, opt, [2, 3], step=step)
    sealed(ev)
    assert int(ev.evict(3)) == 1
    assert keys_of(ev) == [2, 3]
    dirty, deleted = sealed(ev)
    assert deleted == {1} and dirty == set()
    assert ev.stats()["evicted"] == 1 and ev.stats()["free_rows"] == 1


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.string])
def test_evict_with_return_rows_hands_out_the_evicted_keys_and_their_embeddings_before_they_go(key_dtype):
    ev = evstore.EmbeddingVariable(f"ev_rows_{key_dtype.name}", DIM, key_dtype=key_dtype,
                                   evict=evstore.GlobalStepEvict(steps_to_live=2))
    keys = [1, 2, 3] if key_dtype == tf.int64 else [b"a", b"b", b"c"]
    ev.load(keys, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], versions=[0, 5, 0])
    n, evicted, values = ev.evict(5, return_rows=True)
    assert int(n) == 2
    got = dict(zip(evicted.numpy().tolist(), values.numpy().tolist()))
    assert got == {keys[0]: [1.0, 2.0], keys[2]: [5.0, 6.0]}
    assert int(ev.size()) == 1


def test_a_key_is_kept_while_within_steps_to_live():
    ev, opt = make_ev("ev_keep", evstore.GlobalStepEvict(steps_to_live=2)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1], step=5)
    assert int(ev.evict(7)) == 0 and keys_of(ev) == [1]        # 7 - 5 = 2: not more than 2
    assert int(ev.evict(8)) == 1 and keys_of(ev) == []


def test_an_evicted_key_seen_again_is_a_new_key_and_the_delta_carries_it_erased_and_upserted():
    ev, opt = make_ev("ev_back", evstore.GlobalStepEvict(steps_to_live=0)), evstore.optimizers.SGD(1.0)
    for step in range(3):
        sgd_step(ev, opt, [7, 7], step=step)                    # row moves away from INIT
    assert int(ev.frequency(ids64([7]))[0]) == 6
    sealed(ev)
    assert int(ev.evict(5)) == 1
    emb = evstore.embedding_lookup(ev, ids64([7])).numpy()
    np.testing.assert_allclose(emb, np.full((1, DIM), INIT))    # fresh initial row
    assert int(ev.frequency(ids64([7]))[0]) == 1                # fresh frequency
    dirty, deleted = sealed(ev)
    # Both: a reader erases a delta's deleted keys before it applies its rows, so it ends with the new
    # row; and a replica that reads no filtered keys still learns the old row went.
    assert deleted == {7} and dirty == {7}


def test_a_never_updated_key_counts_from_its_admission_step():
    ev, opt = make_ev("ev_adm", evstore.GlobalStepEvict(steps_to_live=3)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1], step=10)                              # the EV's clock is now 10
    evstore.embedding_lookup(ev, ids64([2]))                     # admitted at 10, never updated
    assert int(ev.version(ids64([2]))[0]) == -1
    assert int(ev.evict(13)) == 0
    assert int(ev.evict(14)) == 2 and keys_of(ev) == []          # both: 14 - 10 > 3


def test_the_admission_step_round_trips_through_export_load_and_tf_checkpoint(tmp_path):
    ev, opt = make_ev("ev_rt", evstore.GlobalStepEvict(steps_to_live=3)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1], step=10)
    evstore.embedding_lookup(ev, ids64([2]))
    e = ev.export()
    raw = dict(zip(e["keys"].numpy().tolist(), e["versions"].numpy().tolist()))
    assert raw == {1: 10, 2: -2 - 10}                            # stored: -2 - admission step
    loaded = make_ev("ev_rt_load", evstore.GlobalStepEvict(steps_to_live=3))
    loaded.load(e["keys"], e["values"], versions=e["versions"], freqs=e["freqs"], clear=True)
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    restored = make_ev("ev_rt", evstore.GlobalStepEvict(steps_to_live=3))
    tf.train.Checkpoint(ev=restored).restore(path).assert_consumed()
    for other in (loaded, restored):
        assert other.version(ids64([1, 2])).numpy().tolist() == [10, -1]
        assert int(other.evict(13)) == 0 and int(other.evict(14)) == 2


def test_keys_counted_but_not_admitted_are_evicted_by_their_last_sighting():
    ev = make_ev("ev_filt", evstore.GlobalStepEvict(steps_to_live=2), filter=evstore.CounterFilter(3))
    opt = evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [100], step=4)                             # clock 4
    evstore.embedding_lookup(ev, ids64([9]))                     # filtered, seen at 4
    sgd_step(ev, opt, [100], step=6)
    assert int(ev.evict(6)) == 0
    # 9 (7 - 4 > 2) and 100: never admitted, last seen by the step-6 lookup, which ran at clock 4
    assert int(ev.evict(7)) == 2
    assert ev.stats()["size"] == 0
    _, deleted = sealed(ev)
    assert deleted == {9, 100}


def test_l2_weight_evict_removes_rows_with_a_small_norm():
    ev = make_ev("ev_l2", evstore.L2WeightEvict(threshold=0.1))
    ev.load(ids64([1, 2, 3, 4]), [[0.0, 0.05], [3.0, 4.0], [0.03, 0.04], [0.08, 0.08]], versions=[0] * 4)
    assert int(ev.evict(0)) == 2                                 # norms 0.05, 5, 0.05, 0.113
    assert keys_of(ev) == [2, 4]


def test_policies_in_a_list_combine_any_selects():
    ev = make_ev("ev_both", [evstore.GlobalStepEvict(5), evstore.L2WeightEvict(1.0)])
    assert [type(p) for p in ev.evict_policies] == [evstore.GlobalStepEvict, evstore.L2WeightEvict]
    ev.load(ids64([1, 2, 3]), [[0.1, 0.1], [3.0, 4.0], [3.0, 4.0]], versions=[10, 10, 2])
    assert int(ev.evict(10)) == 2                                # 1 by L2, 3 by age
    assert keys_of(ev) == [2]


def test_two_policies_of_one_kind_merge_by_their_own_rule():
    # Two step limits: the stricter (2) applies; two thresholds: the higher (1.0).
    ev = make_ev("ev_merge", [evstore.GlobalStepEvict(9), evstore.L2WeightEvict(0.5),
                              evstore.GlobalStepEvict(2), evstore.L2WeightEvict(1.0)])
    ev.load(ids64([1, 2, 3]), [[0.6, 0.0], [3.0, 4.0], [3.0, 4.0]], versions=[10, 10, 7])
    assert int(ev.evict(10)) == 2                                # 1 by L2 (0.6 < 1.0), 3 by age (10 - 7 > 2)
    assert keys_of(ev) == [2]


def test_evict_without_a_policy_evicts_nothing():
    ev = make_ev("ev_none", None)
    assert ev.evict_policies == ()
    evstore.embedding_lookup(ev, ids64([1, 2]))
    assert int(ev.evict(10**9)) == 0 and int(ev.size()) == 2


def test_evict_without_a_step_uses_the_highest_step_the_ev_has_seen():
    ev, opt = make_ev("ev_clock", evstore.GlobalStepEvict(1)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1], step=0)
    sgd_step(ev, opt, [2], step=1)
    sgd_step(ev, opt, [2], step=2)
    assert int(ev.evict()) == 1 and keys_of(ev) == [2]           # at step 2: key 1 is 2 steps old


def test_a_tf_checkpoint_save_evicts_first(tmp_path):
    ev, opt = make_ev("ev_save", evstore.GlobalStepEvict(1)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1], step=0)
    sgd_step(ev, opt, [2], step=5)
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    assert keys_of(ev) == [2]
    assert tf.train.load_checkpoint(path).get_tensor("ev/.ATTRIBUTES/-keys").tolist() == [2]


def test_evict_works_inside_tf_function():
    ev, opt = make_ev("ev_fn", evstore.GlobalStepEvict(0)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, [1, 2], step=0)

    @tf.function
    def evict(step):
        return ev.evict(step)

    assert int(evict(tf.constant(1, tf.int64))) == 2


def test_memory_is_reused_after_eviction():
    ev, opt = make_ev("ev_reuse", evstore.GlobalStepEvict(0)), evstore.optimizers.SGD(0.1)
    sgd_step(ev, opt, list(range(1000)), step=0)
    ev.evict(1)
    before = ev.stats()
    assert before["free_rows"] == 1000
    sgd_step(ev, opt, list(range(5000, 6000)), step=1)          # new keys take the freed rows
    after = ev.stats()
    assert after["free_rows"] == 0 and after["row_bytes"] == before["row_bytes"]


def test_keras_embedding_passes_eviction_through():
    layer = evstore.keras.Embedding(DIM, evict=evstore.GlobalStepEvict(4))
    assert layer.ev.evict_policies[0].steps_to_live == 4


@pytest.mark.parametrize("make, match", [
    (lambda: evstore.GlobalStepEvict(-1), "steps_to_live must be an int >= 0"),
    (lambda: evstore.GlobalStepEvict(1.5), "steps_to_live must be an int >= 0"),
    (lambda: evstore.L2WeightEvict(0), "threshold must be a finite number > 0"),
    (lambda: evstore.L2WeightEvict(-1.0), "threshold must be a finite number > 0"),
    (lambda: evstore.L2WeightEvict(float("inf")), "threshold must be a finite number > 0"),
], ids=["ttl-1", "ttl1.5", "l2zero", "l2neg", "l2inf"])
def test_bad_policy_parameters_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_evict_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="evict must be an evstore.GlobalStepEvict"):
        make_ev("ev_bad", "ttl")
    ev = make_ev("ev_bad2", evstore.GlobalStepEvict(1))
    with pytest.raises(ValueError, match="global_step must be >= 0"):
        ev.evict(-5)


def test_filters_and_eviction_work_in_tf_compat_v1_graph_mode():
    with tf.Graph().as_default():
        ev = evstore.EmbeddingVariable("ev_v1", DIM, filter=evstore.BloomFilter(2, capacity=1000),
                                       evict=evstore.GlobalStepEvict(1))
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        step = tf.compat.v1.placeholder(tf.int64, [])
        emb = evstore.embedding_lookup(ev, ids)
        grad = tf.compat.v1.gradients(tf.reduce_sum(emb), [ev])[0]
        train = evstore.training.sparse_apply_sgd(ev, grad, 0.1, step)
        evict = ev.evict(step)
        stats = ev.stats()
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.tables_initializer(), tf.compat.v1.global_variables_initializer()])
            sess.run(train, {ids: [1, 1, 2], step: 0})          # 1 admitted, 2 counted in the filter
            sess.run(train, {ids: [2, 3, 3], step: 3})          # 2 and 3 admitted
            assert sess.run(evict, {step: 3}) == 1               # key 1: 3 - 0 > 1
            s = sess.run(stats)
            assert (s["admitted"], s["evicted"]) == (2, 1)
