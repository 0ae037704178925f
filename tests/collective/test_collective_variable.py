"""A CollectiveEmbeddingVariable is a kind of EmbeddingVariable (one table
type, evstore/variable.py): type checks, the substitution hook and
checkpoint collection treat it like the others. One process (one worker,
no strategy): its one shard is the whole table."""
import numpy as np
import tensorflow as tf

import evstore
from checkpoint.collect import collect
from evstore.substitution import substitute_lookups


def test_a_collective_ev_is_an_embedding_variable_of_the_sharded_kind():
    cev = evstore.CollectiveEmbeddingVariable("cev_kind", 3)
    assert isinstance(cev, evstore.EmbeddingVariable)
    assert cev.sharded and cev.shards == (cev.local,)
    assert cev.trainable_variables == [cev.local]
    assert isinstance(cev.local, evstore.UnshardedEmbeddingVariable) and cev.local.name == "cev_kind/part_0"


def test_per_table_methods_act_on_this_workers_shard():
    cev = evstore.CollectiveEmbeddingVariable("cev_methods", 2, evict=evstore.GlobalStepEvict(1))
    evstore.embedding_lookup(cev, tf.constant([5, 6, 5], tf.int64))
    assert int(cev.size()) == 2 and int(cev.stats()["size"]) == 2
    np.testing.assert_array_equal(cev.frequency(tf.constant([5, 6], tf.int64)).numpy(), [2, 1])
    cev.remove(tf.constant([6], tf.int64))
    assert int(cev.local.size()) == 1


def test_the_substitution_hook_replaces_its_lookups():
    cev = evstore.CollectiveEmbeddingVariable("cev_subst", 2)
    with substitute_lookups({cev: lambda ids: tf.fill(tf.concat([tf.shape(ids), [2]], 0), 7.0)}):
        rows = evstore.embedding_lookup(cev, tf.constant([1, 2], tf.int64), training=False)
        group = evstore.embedding_lookup_group([cev], [tf.constant([3], tf.int64)], training=False)[0]
    np.testing.assert_array_equal(rows.numpy(), np.full((2, 2), 7.0))
    np.testing.assert_array_equal(group.numpy(), np.full((1, 2), 7.0))
    assert int(cev.size()) == 0


def test_checkpoint_collection_saves_it_as_this_workers_part_wherever_it_is_found():
    cev = evstore.CollectiveEmbeddingVariable("cev_ckpt", 2)
    module = tf.Module()
    module.table = cev
    for found in ([cev], module, cev.local):
        c = collect(found)
        assert list(c.evs) == ["cev_ckpt/part_0"] and c.evs["cev_ckpt/part_0"] is cev.local
        assert c.shard_info["cev_ckpt/part_0"]["count"] == 1


def test_the_table_itself_takes_gradients_and_updates_as_its_local_shard_does():
    ids, y = tf.constant([1, 2, 1, 3], tf.int64), tf.constant([1.0, 0.0, 1.0, 0.0])

    def trained(name, as_variable):
        cev = evstore.CollectiveEmbeddingVariable(name, 2, initializer=tf.constant_initializer(0.1))
        w = tf.Variable([[0.5], [-0.5]], name=f"{name}_w")
        opt = evstore.optimizers.Adam(0.1)
        for _ in range(3):
            with tf.GradientTape() as tape:
                pred = tf.squeeze(tf.matmul(evstore.embedding_lookup(cev, ids, training=True), w), 1)
                loss = tf.reduce_mean(tf.square(pred - y))
            variables = [cev if as_variable else cev.local, w]
            grads = tape.gradient(loss, variables)
            assert isinstance(grads[0], tf.IndexedSlices)
            opt.apply_gradients(zip(grads, variables))
        e = cev.local.export()
        order = np.argsort(e["keys"].numpy())
        return e["keys"].numpy()[order], e["values"].numpy()[order], e["slots"], w.numpy()

    k1, v1, s1, w1 = trained("cev_idiom", True)
    k2, v2, s2, w2 = trained("cev_local", False)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)
    assert sorted(s1) == sorted(s2) and len(s1) == 2     # Adam's slots, in the table
    np.testing.assert_array_equal(w1, w2)
