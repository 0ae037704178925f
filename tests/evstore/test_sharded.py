"""ShardedEmbeddingVariable in one process: routing, and results equal to an
unsharded EV's for lookups, sparse lookups, optimizers, filters and eviction.
(The parameter-server runtime is tested in tests/cluster/.)"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 8


def _kwargs(**extra):
    kw = dict(initializer=tf.random_normal_initializer(0, 0.1, seed=3), initializer_bank_size=256)
    kw.update(extra)
    return kw


def _pair(shards=3, **extra):
    return (evstore.EmbeddingVariable("t", DIM, **_kwargs(**extra)),
            evstore.EmbeddingVariable("t", DIM, shards=shards, **_kwargs(**extra)))


def _ids(step, shape=(64, 3), vocab=120):
    return np.random.default_rng(step).zipf(1.4, size=shape).astype(np.int64) % vocab


def _train(ev, opt, steps, lookup=None):
    tv = ev.trainable_variables if isinstance(ev, evstore.ShardedEmbeddingVariable) else [ev]
    lookup = lookup or (lambda e, ids: evstore.embedding_lookup(e, ids))
    for s in range(steps):
        with tf.GradientTape() as tape:
            e = lookup(ev, _ids(s))
            loss = tf.reduce_sum(e * e) + tf.reduce_sum(e[..., 0])
        grads = tape.gradient(loss, tv)
        opt.apply_gradients(zip(grads, tv), global_step=s)


def _table(ev):
    x = ev.export()
    o = np.argsort(x["keys"].numpy())
    return {k: x[k].numpy()[o] for k in ("keys", "values", "versions", "freqs")}


def test_shards_argument_returns_a_sharded_ev_of_named_shards():
    sev = evstore.EmbeddingVariable("user", DIM, shards=4)
    assert isinstance(sev, evstore.ShardedEmbeddingVariable)
    assert sev.num_shards == 4 and sev.name == "user" and sev.dim == DIM
    assert [s.name for s in sev.shards] == [f"user/part_{i}" for i in range(4)]
    assert all(isinstance(s, evstore.EmbeddingVariable) for s in sev.shards)
    assert not isinstance(evstore.EmbeddingVariable("plain", DIM), evstore.ShardedEmbeddingVariable)


def test_a_sharded_ev_is_an_embedding_variable_with_the_same_surface():
    sev = evstore.EmbeddingVariable("user", DIM, shards=2, default_value=0.25)
    plain = evstore.EmbeddingVariable("plain", DIM, default_value=0.25)
    assert isinstance(sev, evstore.EmbeddingVariable) and isinstance(plain, evstore.EmbeddingVariable)
    assert isinstance(plain, evstore.UnshardedEmbeddingVariable)
    assert all(isinstance(s, evstore.UnshardedEmbeddingVariable) for s in sev.shards)
    assert (sev.sharded, plain.sharded) == (True, False)
    assert plain.shards == (plain,) and plain.num_shards == 1
    assert plain.trainable_variables == [plain] and sev.trainable_variables == list(sev.shards)
    np.testing.assert_array_equal(sev.default_value, plain.default_value)
    assert all(s.owner is sev for s in sev.shards) and plain.owner is None
    assert evstore.variable.ev_for_variable(plain.proxy) is plain
    assert evstore.summary.ev_stats(sev)["size"] == 0


def test_keys_are_routed_by_a_hash_so_patterned_ids_spread_evenly():
    keys = np.arange(0, 4000 * 1000, 1000, dtype=np.int64)   # multiples of 1000: k % 4 == 0 for all
    shard = evstore.shard_index(keys, 4).numpy()
    counts = np.bincount(shard, minlength=4)
    assert counts.min() > 0.2 * len(keys), counts
    assert not np.array_equal(shard, keys % 4)


def test_route_is_fixed_because_checkpoints_depend_on_it():
    np.testing.assert_array_equal(evstore.shard_index(np.arange(10, dtype=np.int64), 3).numpy(),
                                  [0, 1, 2, 0, 2, 0, 1, 2, 1, 0])
    np.testing.assert_array_equal(evstore.shard_index(np.arange(10, dtype=np.int32), 3).numpy(),
                                  [0, 1, 2, 0, 2, 0, 1, 2, 1, 0])


def test_counted_lookup_refuses_counts_below_one():
    ev = evstore.EmbeddingVariable("t", DIM)
    with pytest.raises(tf.errors.InvalidArgumentError, match="counts must be >= 1"):
        evstore.ops.ev_find_or_insert_counted(ev.resource_handle, tf.constant([1, 2], tf.int64),
                                                   tf.constant([1, 0], tf.int64), tf.zeros([0]), dim=DIM)
    assert int(ev.size()) == 0


def test_each_key_lives_in_exactly_the_shard_shard_index_names():
    sev = evstore.EmbeddingVariable("t", DIM, shards=3)
    keys = np.arange(200, dtype=np.int64)
    evstore.embedding_lookup(sev, keys)
    want = sev.shard_index(keys).numpy()
    for i, shard in enumerate(sev.shards):
        np.testing.assert_array_equal(np.sort(shard.export()["keys"].numpy()), np.sort(keys[want == i]))


def test_training_lookup_counts_every_occurrence_like_an_unsharded_ev():
    plain, sev = _pair()
    ids = np.array([[1, 1, 2], [7, 1, 9]], np.int64)
    evstore.embedding_lookup(plain, ids)
    evstore.embedding_lookup(sev, ids)
    np.testing.assert_array_equal(sev.frequency([1, 2, 7, 9, 5]).numpy(), [3, 1, 1, 1, 0])
    np.testing.assert_array_equal(sev.frequency([1, 2, 7, 9, 5]).numpy(), plain.frequency([1, 2, 7, 9, 5]).numpy())


@pytest.mark.parametrize("make_opt", [lambda: evstore.optimizers.SGD(0.1), lambda: evstore.optimizers.Adam(0.05),
                                      lambda: evstore.optimizers.Ftrl(0.1, l1_regularization_strength=0.01)],
                         ids=["sgd", "adam", "ftrl"])
def test_training_equals_an_unsharded_ev(make_opt):
    plain, sev = _pair(filter=evstore.CounterFilter(2))
    _train(plain, make_opt(), 6)
    _train(sev, make_opt(), 6)
    want, got = _table(plain), _table(sev)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert sev.stats()["filtered"] == plain.stats()["filtered"]
    assert sev.stats()["admitted"] == plain.stats()["admitted"]


def test_sparse_lookups_equal_an_unsharded_ev():
    plain, sev = _pair()
    sp = tf.sparse.from_dense(tf.constant([[3, 0, 5], [0, 0, 0], [5, 5, 11]], tf.int64))
    w = tf.SparseTensor(sp.indices, tf.constant([1.0, 2.0, 0.5, 1.0, 3.0]), sp.dense_shape)
    for fn in (lambda e: evstore.embedding_lookup_sparse(e, sp, w, combiner="sqrtn"),
               lambda e: evstore.safe_embedding_lookup_sparse(e, sp, w, combiner="mean", default_id=3)):
        np.testing.assert_array_equal(fn(sev).numpy(), fn(plain).numpy())


def test_read_only_lookup_changes_nothing():
    sev = evstore.EmbeddingVariable("t", DIM, shards=2, default_value=0.5)
    out = evstore.embedding_lookup(sev, [[4, 5]], training=False)
    np.testing.assert_array_equal(out.numpy(), np.full([1, 2, DIM], 0.5, np.float32))
    assert int(sev.size()) == 0 and sev.stats()["size"] == 0


def test_lookup_inside_tf_function_keeps_shape_and_trains():
    sev = evstore.EmbeddingVariable("t", DIM, shards=2)
    opt = evstore.optimizers.SGD(0.1)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            e = evstore.embedding_lookup(sev, ids)
            loss = tf.reduce_sum(e)
        grads = tape.gradient(loss, sev.trainable_variables)
        opt.apply_gradients(zip(grads, sev.trainable_variables))
        return e

    out = step(tf.constant([[1, 2], [3, 1]], tf.int64))
    assert out.shape == (2, 2, DIM)
    assert (sev.version([1, 2, 3]).numpy() == 0).all()


def test_eviction_runs_on_every_shard():
    plain, sev = _pair(evict=evstore.GlobalStepEvict(steps_to_live=2))
    _train(plain, evstore.optimizers.SGD(0.1), 6)
    _train(sev, evstore.optimizers.SGD(0.1), 6)
    assert int(sev.evict(10)) == int(plain.evict(10)) > 0
    assert int(sev.size()) == int(plain.size())
    np.testing.assert_array_equal(_table(sev)["keys"], _table(plain)["keys"])


def test_remove_and_load_route_keys_to_their_shards():
    sev = evstore.EmbeddingVariable("t", DIM, shards=3)
    keys = np.arange(30, dtype=np.int64)
    sev.load(keys, np.tile(keys[:, None].astype(np.float32), [1, DIM]), versions=keys, freqs=keys + 1)
    np.testing.assert_array_equal(sev.version(keys).numpy(), keys)
    got = evstore.embedding_lookup(sev, keys, training=False).numpy()[:, 0]
    np.testing.assert_array_equal(got, keys.astype(np.float32))
    assert int(sev.remove([1, 2, 3, 99])) == 3
    assert int(sev.size()) == 27


def test_stats_are_summed_over_shards():
    sev = evstore.EmbeddingVariable("t", DIM, shards=3)
    evstore.embedding_lookup(sev, np.arange(50, dtype=np.int64))
    stats = sev.stats()
    assert stats["size"] == 50 == sum(s.stats()["size"] for s in sev.shards)
    assert stats["bytes"] == sum(s.stats()["bytes"] for s in sev.shards)


def test_devices_place_shards_on_the_given_devices():
    sev = evstore.EmbeddingVariable("t", DIM, devices=["/device:CPU:0", "/device:CPU:0"])
    assert sev.num_shards == 2
    assert all(d.endswith("CPU:0") for d in sev.devices)


@pytest.mark.parametrize("kwargs, err", [(dict(shards=0), ValueError), (dict(shards=-1), ValueError),
                                         (dict(shards=2.5), ValueError), (dict(devices=[]), ValueError),
                                         (dict(devices="/cpu:0"), TypeError)])
def test_bad_shards_or_devices_raise(kwargs, err):
    with pytest.raises(err):
        evstore.EmbeddingVariable("t", DIM, **kwargs)


def test_wrong_key_dtype_is_refused_before_anything_runs():
    # (int32 ids into an int64 EV are cast, as tf.nn accepts them: test_tf_nn_parity.py)
    sev = evstore.EmbeddingVariable("t", DIM, shards=2, key_dtype=tf.int32)
    with pytest.raises(TypeError, match="int32 keys"):
        evstore.embedding_lookup(sev, tf.constant([1, 2], tf.int64))
    assert int(sev.size()) == 0


def test_keras_layer_with_shards_fits_like_an_unsharded_layer():
    def model(shards):
        ids = keras.Input(shape=(3,), dtype="int64")
        e = evstore.keras.Embedding(DIM, shards=shards, name="emb", initializer_bank_size=64,
                                    embeddings_initializer=tf.random_normal_initializer(0, 0.1, seed=5))(ids)
        out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(
            keras.layers.Flatten()(e))
        m = keras.Model(ids, out)
        m.compile(optimizer=evstore.optimizers.Adam(0.05), loss="mse")
        return m

    x = _ids(1, (256, 3))
    y = (x[:, :1] % 2).astype(np.float32)
    plain, sharded = model(None), model(2)
    plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    sharded.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(sharded.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert isinstance(sharded.get_layer("emb").ev, evstore.ShardedEmbeddingVariable)


def test_tf_train_checkpoint_saves_and_restores_every_shard(tmp_path):
    sev = evstore.EmbeddingVariable("t", DIM, shards=2)
    _train(sev, evstore.optimizers.Adam(0.05), 3)
    path = tf.train.Checkpoint(table=sev).save(str(tmp_path / "ck"))
    other = evstore.EmbeddingVariable("t", DIM, shards=2)
    tf.train.Checkpoint(table=other).restore(path).assert_existing_objects_matched()
    want, got = _table(sev), _table(other)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_v1_graph_mode_session_trains_a_sharded_ev():
    g = tf.Graph()
    with g.as_default():
        sev = evstore.EmbeddingVariable("v1", 4, shards=2, devices=["/cpu:0", "/cpu:0"], default_value=0.0,
                                        initializer=tf.zeros_initializer())
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        loss = tf.reduce_sum(evstore.embedding_lookup(sev, ids))
        grads = tf.compat.v1.gradients(loss, list(sev.shards))
        train = tf.group([evstore.training.sparse_apply_sgd(s, gr, 0.5, 7) for s, gr in zip(sev.shards, grads)])
        read = evstore.embedding_lookup(sev, [1, 2, 3], training=False)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.tables_initializer(), tf.compat.v1.global_variables_initializer()])
            sess.run(train, {ids: [1, 2, 2, 3]})
            np.testing.assert_allclose(sess.run(read)[:, 0], [-0.5, -1.0, -0.5])   # duplicates summed
            np.testing.assert_array_equal(sess.run(sev.version([1, 2, 3])), [7, 7, 7])
