"""Two-phase export through the ops: seal, commit, abort (docs/ARCHITECTURE.md, "Table")."""
import numpy as np
import pytest
import tensorflow as tf

import evstore


def _train_keys(ev, keys, step=1):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant(keys, tf.int64)))
    evstore.optimizers.SGD(0.1).apply_gradients([(tape.gradient(loss, ev), ev)], global_step=step)


def test_begin_export_seals_dirty_keys_and_starts_a_new_set():
    ev = evstore.EmbeddingVariable("snap_a", dim=4)
    _train_keys(ev, [1, 2, 3])
    sid, dirty, deleted = ev.begin_export()
    assert sorted(dirty.numpy().tolist()) == [1, 2, 3]
    assert deleted.numpy().tolist() == []
    _train_keys(ev, [3, 4])
    ev.commit_export(sid)
    sid2, dirty2, _ = ev.begin_export()
    assert sorted(dirty2.numpy().tolist()) == [3, 4]
    ev.commit_export(sid2)


def test_abort_export_merges_the_snapshot_back():
    ev = evstore.EmbeddingVariable("snap_b", dim=4)
    _train_keys(ev, [1, 2])
    ev.remove([2])
    sid, dirty, deleted = ev.begin_export()
    assert dirty.numpy().tolist() == [1] and deleted.numpy().tolist() == [2]
    _train_keys(ev, [5])
    ev.abort_export(sid)
    sid2, dirty2, deleted2 = ev.begin_export()
    assert sorted(dirty2.numpy().tolist()) == [1, 5]
    assert deleted2.numpy().tolist() == [2]
    ev.commit_export(sid2)


def test_commit_leaves_nothing_dirty():
    ev = evstore.EmbeddingVariable("snap_c", dim=4)
    _train_keys(ev, [7, 8])
    sid, _, _ = ev.begin_export()
    ev.commit_export(sid)
    sid2, dirty, deleted = ev.begin_export()
    assert dirty.numpy().size == 0 and deleted.numpy().size == 0
    ev.commit_export(sid2)


def test_second_begin_export_while_one_is_open_is_refused():
    ev = evstore.EmbeddingVariable("snap_d", dim=4)
    sid, _, _ = ev.begin_export()
    with pytest.raises(tf.errors.FailedPreconditionError, match="already in flight"):
        ev.begin_export()
    ev.commit_export(sid)


def test_reinserted_key_stays_in_the_deleted_set_and_becomes_dirty():
    # A reader erases a delta's deleted keys before it applies its rows, so the
    # key ends re-inserted; a serving replica learns it lost its row from the
    # deleted keys alone.
    ev = evstore.EmbeddingVariable("snap_e", dim=4)
    _train_keys(ev, [9])
    sid, _, _ = ev.begin_export()
    ev.commit_export(sid)
    ev.remove([9])
    _train_keys(ev, [9])
    sid, dirty, deleted = ev.begin_export()
    assert dirty.numpy().tolist() == [9] and deleted.numpy().tolist() == [9]
    ev.commit_export(sid)
    np.testing.assert_array_equal(ev.admitted([9]).numpy(), [True])
