"""Eviction and admission filters through the checkpoint manager: every save
evicts first, a delta deletes the evicted keys, and a restore brings back
admission steps (raw versions) and counted-not-admitted keys bit for bit."""
import os

import numpy as np
import tensorflow as tf

import checkpoint
import evstore
from checkpoint.manifest import BUNDLE_PREFIX


def make_ev():
    return evstore.EmbeddingVariable("u", 4, initializer=tf.constant_initializer(0.5),
                                     filter=evstore.CounterFilter(2), evict=evstore.GlobalStepEvict(2))


def train(ev, opt, ids, step):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant(ids, tf.int64)))
    opt.apply_gradients([(tape.gradient(loss, ev), ev)], global_step=step)


def state(ev):
    e = ev.export()
    k, f = np.argsort(e["keys"].numpy()), np.argsort(e["filtered_keys"].numpy())
    out = {n: e[n].numpy()[k] for n in ("keys", "values", "versions", "freqs")}
    out.update({n: e[n].numpy()[f] for n in ("filtered_keys", "filtered_freqs")})
    return out


def test_each_save_evicts_first_and_the_delta_deletes_the_evicted_keys(tmp_path):
    ev, opt, gs = make_ev(), evstore.optimizers.SGD(0.1), tf.Variable(0, dtype=tf.int64)
    mgr = checkpoint.CheckpointManager(str(tmp_path), [ev], global_step=gs)
    train(ev, opt, [1, 1, 2, 2, 3], step=0)       # 1, 2 admitted; 3 counted
    mgr.save_full()                                # evict(0): nothing is old yet
    for step in range(1, 5):
        train(ev, opt, [2, 2], step=step)
    evstore.embedding_lookup(ev, tf.constant([9, 9], tf.int64))   # admitted at clock 4, never updated
    gs.assign(4)
    seq = mgr.save_delta()                         # evict(4): 1 (version 0) and 3 (seen at 0)
    assert sorted(state(ev)["keys"].tolist()) == [2, 9] and state(ev)["filtered_keys"].size == 0
    bundle = os.path.join(str(tmp_path), mgr.last_committed.dir, BUNDLE_PREFIX)
    deleted = tf.train.load_checkpoint(bundle).get_tensor("u-deleted_keys")
    assert sorted(deleted.tolist()) == [1, 3] and mgr.last_committed.seq == seq

    ev2 = make_ev()
    checkpoint.CheckpointManager(str(tmp_path), [ev2], global_step=tf.Variable(0, dtype=tf.int64)).restore()
    want, got = state(ev), state(ev2)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert dict(zip(got["keys"].tolist(), got["versions"].tolist())) == {2: 4, 9: -2 - 4}
    # The restored admission step still ages key 9: kept at 6, evicted at 7.
    assert int(ev2.evict(6)) == 0 and int(ev2.evict(7)) == 2


def test_counted_keys_survive_a_restore_and_keep_counting(tmp_path):
    ev, gs = make_ev(), tf.Variable(3, dtype=tf.int64)
    mgr = checkpoint.CheckpointManager(str(tmp_path), [ev], global_step=gs)
    evstore.embedding_lookup(ev, tf.constant([5, 6, 6], tf.int64))   # 5 counted once; 6 admitted
    mgr.save_full()
    ev2 = make_ev()
    checkpoint.CheckpointManager(str(tmp_path), [ev2], global_step=tf.Variable(0, dtype=tf.int64)).restore()
    assert ev2.admitted(tf.constant([5, 6], tf.int64)).numpy().tolist() == [False, True]
    evstore.embedding_lookup(ev2, tf.constant([5], tf.int64))        # second sighting: admitted
    assert bool(ev2.admitted(tf.constant([5], tf.int64))[0])
