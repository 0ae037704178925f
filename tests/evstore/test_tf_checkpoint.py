"""tf.train.Checkpoint saves and restores a bare EV (rows, Adam slots, versions,
frequencies, counted-not-admitted keys); a restored table has nothing dirty."""
import numpy as np
import tensorflow as tf

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
