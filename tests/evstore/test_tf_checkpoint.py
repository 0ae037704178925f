"""tf.train.Checkpoint saves and restores a bare EV (rows, Adam slots, versions,
frequencies, counted-not-admitted keys); a restored table has nothing dirty."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.trackable import base as _trackable_base

import evstore

BANK = np.random.default_rng(5).normal(size=(16, 4)).astype(np.float32)


def _ev():
    return evstore.EmbeddingVariable("ck", dim=4, filter=evstore.CounterFilter(2),
                                     initializer=tf.constant_initializer(BANK), initializer_bank_size=16)


def _train(ev, opt, steps):
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, tf.constant([1, 2, 2, 3], tf.int64))))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])


def _state(ev):
    e = ev.export()
    k, f = np.argsort(e["keys"].numpy()), np.argsort(e["filtered_keys"].numpy())
    out = {n: e[n].numpy()[k] for n in ("keys", "values", "versions", "freqs")}
    out.update({n: e[n].numpy()[f] for n in ("filtered_keys", "filtered_freqs")})
    out.update({f"slot/{s}": v.numpy()[k] for s, v in e["slots"].items()})
    return out


def test_checkpoint_round_trip_restores_the_whole_table(tmp_path):
    ev, opt = _ev(), evstore.optimizers.Adam(0.1)
    _train(ev, opt, 3)
    evstore.embedding_lookup(ev, tf.constant([99], tf.int64))   # counted once: filtered
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    ev2 = _ev()
    tf.train.Checkpoint(ev=ev2).restore(path).assert_consumed()
    want, got = _state(ev), _state(ev2)
    assert set(got) == set(want) and "slot/m" in got and got["filtered_keys"].tolist() == [99]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_restored_table_has_no_dirty_keys(tmp_path):
    ev = _ev()
    _train(ev, evstore.optimizers.SGD(0.1), 2)
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    ev2 = _ev()
    tf.train.Checkpoint(ev=ev2).restore(path)
    sid, dirty, deleted = ev2.begin_export()
    ev2.commit_export(sid)
    assert dirty.numpy().size == 0 and deleted.numpy().size == 0


def test_training_resumed_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path):
    ev, opt = _ev(), evstore.optimizers.Adam(0.1)
    _train(ev, opt, 2)
    path = tf.train.Checkpoint(ev=ev, opt=opt).save(str(tmp_path / "c"))
    _train(ev, opt, 3)
    ev2, opt2 = _ev(), evstore.optimizers.Adam(0.1)
    ckpt = tf.train.Checkpoint(ev=ev2, opt=opt2)
    ckpt.restore(path)
    _train(ev2, opt2, 3)
    want, got = _state(ev), _state(ev2)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=0, err_msg=name)


# Optimizers whose slots start at a non-zero value (initial_accumulator_value).
NONZERO_SLOT_OPTIMIZERS = {
    "adagrad": lambda: evstore.optimizers.Adagrad(0.1, initial_accumulator_value=0.3),
    "ftrl": lambda: evstore.optimizers.Ftrl(0.1, initial_accumulator_value=0.3),
    "group_adagrad": lambda: evstore.optimizers.GroupAdagrad(0.1, initial_accumulator_value=0.3)}


def _train_admitting(ev, opt, start, stop):
    """Steps start..stop-1; step i's lookup admits key 100 + i (seen twice:
    CounterFilter(2)) before the optimizer's update of that step."""
    for i in range(start, stop):
        keys = tf.constant([1, 2, 2, 3, 100 + i, 100 + i], tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, keys)))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])


@pytest.mark.parametrize("name", sorted(NONZERO_SLOT_OPTIMIZERS))
def test_training_resumed_from_a_checkpoint_starts_new_keys_slots_at_their_initial_value(tmp_path, name):
    # The first lookup after the restore admits a key before the optimizer's
    # first update: the table must know the slots' initial values from the
    # checkpoint itself (tf.train.Checkpoint knows no optimizer setting).
    make = NONZERO_SLOT_OPTIMIZERS[name]
    ev, opt = _ev(), make()
    _train_admitting(ev, opt, 0, 2)
    path = tf.train.Checkpoint(ev=ev, opt=opt).save(str(tmp_path / "c"))
    _train_admitting(ev, opt, 2, 4)
    ev2, opt2 = _ev(), make()
    tf.train.Checkpoint(ev=ev2, opt=opt2).restore(path)
    _train_admitting(ev2, opt2, 2, 4)
    want, got = _state(ev), _state(ev2)
    assert sorted(got) == sorted(want) and 103 in got["keys"]
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


class _WrittenBeforeSlotInitialValues(_trackable_base.Trackable):
    """An EV as a tf.train.Checkpoint held it before the table's child object
    `slot_initial_values` existed: its own tensors alone."""

    def __init__(self, ev):
        self._ev = ev

    def _serialize_to_tensors(self):
        return self._ev._export_tensors()


def test_a_checkpoint_written_before_slot_initial_values_were_saved_still_restores(tmp_path):
    ev, opt = _ev(), evstore.optimizers.Adagrad(0.1, initial_accumulator_value=0.3)
    _train_admitting(ev, opt, 0, 2)
    path = tf.train.Checkpoint(ev=_WrittenBeforeSlotInitialValues(ev)).save(str(tmp_path / "c"))
    ev2 = _ev()
    tf.train.Checkpoint(ev=ev2).restore(path)
    want, got = _state(ev), _state(ev2)
    assert sorted(got) == sorted(want) and "slot/accumulator" in got
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
