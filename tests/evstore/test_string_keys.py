"""String keys (key_dtype=tf.string): an EV keyed by byte strings trains,
filters, evicts and reports exactly like an int64 EV whose keys map one-to-one
to the strings; any byte string is a key; bad input fails clearly and changes
nothing; the string route is FarmHash Fingerprint64 (= tf.fingerprint), pinned
by golden values.

Both EVs of a parity pair start every row from one constant initializer, so the
only difference between them is the key type (the initializer bank row a key
draws depends on its hash, which differs between 7 and b"k7").
"""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 4
INT_KEYS = np.array([3, 17, 1000003, 2**40 + 7, 5, 99991, 42, 0], np.int64)
# One string per int key: short, empty, non-UTF-8, long, a NUL inside.
STR_KEYS = np.array([b"k3", b"", b"\xff\xfe\x80", b"x" * 300, b"a\x00b", "caf\u00e9".encode(), b"Comedy",
                     b"0"], object)
STEPS = 12


def _pair(name, **kw):
    init = tf.constant_initializer(0.25)
    a = evstore.EmbeddingVariable(f"{name}_int", DIM, initializer=init, **kw)
    b = evstore.EmbeddingVariable(f"{name}_str", DIM, key_dtype=tf.string, initializer=init, **kw)
    return a, b


def _batches(seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, len(INT_KEYS), size=10), rng.normal(size=(10, DIM)).astype(np.float32))
            for _ in range(STEPS)]


def _train(ev, keys, opt, batches, lookup=evstore.embedding_lookup):
    tv = ev.trainable_variables if ev.sharded else [ev]
    for step, (idx, target) in enumerate(batches):
        with tf.GradientTape() as tape:
            y = lookup(ev, tf.constant(keys[idx]) if keys.dtype != object else tf.constant(keys[idx].tolist()))
            loss = tf.reduce_sum((y - target) ** 2)
        kw = {"global_step": step} if isinstance(opt, evstore.optimizers._EVMixin) else {}
        opt.apply_gradients(zip(tape.gradient(loss, tv), tv), **kw)


def _rows_by_index(ev, keys):
    """{dense index: (row, slots...)} of the admitted keys, via the export."""
    ex = ev.export()
    pos = {(k.item() if isinstance(k, np.generic) else k): i for i, k in enumerate(keys.tolist())}
    out = {}
    for j, k in enumerate(ex["keys"].numpy().tolist()):
        out[pos[k]] = (ex["values"].numpy()[j], ex["versions"].numpy()[j], ex["freqs"].numpy()[j],
                       {n: s.numpy()[j] for n, s in ex["slots"].items()})
    return out


def _assert_same_tables(a, b):
    ra, rb = _rows_by_index(a, INT_KEYS), _rows_by_index(b, STR_KEYS)
    assert ra.keys() == rb.keys()
    for i in ra:
        np.testing.assert_array_equal(ra[i][0], rb[i][0])
        assert ra[i][1:3] == rb[i][1:3]
        assert ra[i][3].keys() == rb[i][3].keys()
        for n in ra[i][3]:
            np.testing.assert_array_equal(ra[i][3][n], rb[i][3][n])


OPTIMIZERS = {
    "sgd": lambda: evstore.optimizers.SGD(0.1),
    "momentum": lambda: evstore.optimizers.SGD(0.05, momentum=0.9),
    "adagrad": lambda: evstore.optimizers.Adagrad(0.1),
    "adam": lambda: evstore.optimizers.Adam(0.01),
    "adamw": lambda: evstore.optimizers.AdamW(0.01),
    "ftrl": lambda: evstore.optimizers.Ftrl(0.2),
    "group_adam": lambda: evstore.optimizers.GroupAdam(0.05),
    "group_adagrad": lambda: evstore.optimizers.GroupAdagrad(0.1),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_string_keys_train_to_the_rows_of_int64_keys(opt):
    a, b = _pair(f"par_{opt}")
    batches = _batches()
    _train(a, INT_KEYS, OPTIMIZERS[opt](), batches)
    _train(b, STR_KEYS, OPTIMIZERS[opt](), batches)
    _assert_same_tables(a, b)


@pytest.mark.parametrize("opt", ["rmsprop", "lion"])
def test_string_keys_train_like_int64_keys_under_any_keras_optimizer(opt):
    make = {"rmsprop": lambda: tf.keras.optimizers.RMSprop(0.01), "lion": lambda: tf.keras.optimizers.Lion(0.001)}
    a, b = _pair(f"generic_{opt}")
    batches = _batches(seed=5)
    _train(a, INT_KEYS, make[opt](), batches)
    _train(b, STR_KEYS, make[opt](), batches)
    _assert_same_tables(a, b)


@pytest.mark.parametrize("flt", ["counter", "bloom"])
def test_string_keys_are_admitted_like_int64_keys(flt):
    f = (lambda: evstore.CounterFilter(3)) if flt == "counter" else (lambda: evstore.BloomFilter(3, 1000, 0.01))
    a = evstore.EmbeddingVariable(f"flt_{flt}_int", DIM, initializer=tf.constant_initializer(0.5), filter=f())
    b = evstore.EmbeddingVariable(f"flt_{flt}_str", DIM, key_dtype=tf.string,
                                  initializer=tf.constant_initializer(0.5), filter=f())
    batches = _batches(seed=2)
    _train(a, INT_KEYS, evstore.optimizers.SGD(0.1), batches)
    _train(b, STR_KEYS, evstore.optimizers.SGD(0.1), batches)
    _assert_same_tables(a, b)
    np.testing.assert_array_equal(a.admitted(INT_KEYS).numpy(), b.admitted(list(STR_KEYS)).numpy())
    np.testing.assert_array_equal(a.frequency(INT_KEYS).numpy(), b.frequency(list(STR_KEYS)).numpy())
    np.testing.assert_array_equal(a.version(INT_KEYS).numpy(), b.version(list(STR_KEYS)).numpy())


@pytest.mark.parametrize("policy", ["global_step", "l2"])
def test_string_keys_are_evicted_like_int64_keys(policy):
    mk = (lambda: evstore.GlobalStepEvict(4)) if policy == "global_step" else (lambda: evstore.L2WeightEvict(0.6))
    a, b = _pair(f"ev_{policy}", evict=mk())
    batches = _batches(seed=3)
    _train(a, INT_KEYS, evstore.optimizers.SGD(0.05), batches)
    _train(b, STR_KEYS, evstore.optimizers.SGD(0.05), batches)
    na, nb = int(a.evict(STEPS + 2)), int(b.evict(STEPS + 2))
    assert na == nb
    _assert_same_tables(a, b)


def test_sparse_and_safe_lookups_with_string_ids_match_int64_ids():
    a, b = _pair("sparse")
    idx = np.array([0, 1, 2, 2, 5, 7])
    rows = [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    w = tf.constant([1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
    for fn in (evstore.embedding_lookup_sparse, evstore.safe_embedding_lookup_sparse):
        for combiner in ("sum", "mean", "sqrtn"):
            sa = tf.SparseTensor(rows, tf.constant(INT_KEYS[idx]), [4, 3])
            sb = tf.SparseTensor(rows, tf.constant(STR_KEYS[idx].tolist()), [4, 3])
            sw = tf.SparseTensor(rows, w, [4, 3])
            with tf.GradientTape() as ta:
                ya = fn(a, sa, sw, combiner=combiner)
                la = tf.reduce_sum(ya * ya)
            with tf.GradientTape() as tb:
                yb = fn(b, sb, sw, combiner=combiner)
                lb = tf.reduce_sum(yb * yb)
            np.testing.assert_array_equal(ya.numpy(), yb.numpy())
            evstore.optimizers.SGD(0.1).apply_gradients([(ta.gradient(la, a), a)])
            evstore.optimizers.SGD(0.1).apply_gradients([(tb.gradient(lb, b), b)])
    _assert_same_tables(a, b)


def test_read_only_lookup_of_string_keys_never_inserts():
    ev = evstore.EmbeddingVariable("ro", DIM, key_dtype=tf.string, default_value=-1.0)
    ev.load([b"seen"], np.ones((1, DIM), np.float32))
    out = evstore.embedding_lookup(ev, tf.constant([[b"seen", b"unseen"]]), training=False).numpy()
    np.testing.assert_array_equal(out[0, 0], np.ones(DIM))
    np.testing.assert_array_equal(out[0, 1], -np.ones(DIM))
    assert ev.stats()["size"] == 1


def test_any_byte_string_is_a_key_and_round_trips_through_export_and_load():
    ev = evstore.EmbeddingVariable("bytes", DIM, key_dtype=tf.string)
    vals = np.arange(len(STR_KEYS) * DIM, dtype=np.float32).reshape(-1, DIM)
    ev.load(list(STR_KEYS), vals)
    ex = ev.export()
    got = dict(zip(ex["keys"].numpy().tolist(), ex["values"].numpy()))
    assert set(got) == set(STR_KEYS.tolist())
    for k, v in zip(STR_KEYS.tolist(), vals):
        np.testing.assert_array_equal(got[k], v)
    # str input is its UTF-8 bytes
    np.testing.assert_array_equal(evstore.embedding_lookup(ev, ["caf\u00e9"], training=False).numpy()[0], vals[5])
    assert int(ev.remove([b"", b"\xff\xfe\x80", b"absent"])) == 2
    assert ev.stats()["size"] == len(STR_KEYS) - 2


def test_a_key_of_the_maximum_length_is_accepted():
    ev = evstore.EmbeddingVariable("maxlen", DIM, key_dtype=tf.string)
    k = b"m" * evstore.MAX_STRING_KEY_BYTES
    evstore.embedding_lookup(ev, tf.constant([k]))
    assert ev.export()["keys"].numpy().tolist() == [k]


def test_an_over_long_key_fails_the_whole_batch_and_changes_nothing():
    ev = evstore.EmbeddingVariable("toolong", DIM, key_dtype=tf.string)
    evstore.embedding_lookup(ev, tf.constant([b"a"]))
    before = ev.stats()
    long_key = b"y" * (evstore.MAX_STRING_KEY_BYTES + 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 65535 bytes"):
        evstore.embedding_lookup(ev, tf.constant([b"new", long_key, b"a"]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 65535 bytes"):
        ev.load([b"ok", long_key], np.zeros((2, DIM), np.float32))
    assert ev.stats() == before
    assert ev.frequency([b"a", b"new"]).numpy().tolist() == [1, 0]


@pytest.mark.parametrize("ids", [tf.constant([1, 2], tf.int64), np.array([1, 2]), [1.5]])
def test_numeric_ids_for_a_string_ev_raise_type_error_and_change_nothing(ids):
    ev = evstore.EmbeddingVariable("wrongdtype", DIM, key_dtype=tf.string)
    with pytest.raises(TypeError, match="string keys"):
        evstore.embedding_lookup(ev, ids)
    assert ev.stats()["size"] == 0


def test_string_ids_for_an_int64_ev_raise_type_error():
    ev = evstore.EmbeddingVariable("wrongdtype64", DIM)
    with pytest.raises(TypeError):
        evstore.embedding_lookup(ev, tf.constant(["a"]))
    assert ev.stats()["size"] == 0


def test_a_non_finite_gradient_names_the_string_key_and_changes_nothing():
    ev = evstore.EmbeddingVariable("nan", DIM, key_dtype=tf.string)
    evstore.embedding_lookup(ev, tf.constant([b"ok", b"bad\xff"]))
    before = ev.export()["values"].numpy()
    grad = tf.IndexedSlices(tf.constant([[0.0] * DIM, [np.nan] * DIM]), tf.constant([b"ok", b"bad\xff"]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key 'bad\\377'"):
        evstore.optimizers.SGD(0.1).apply_gradients([(grad, ev)])
    np.testing.assert_array_equal(ev.export()["values"].numpy(), before)


def test_keras_embedding_takes_string_inputs():
    layer = evstore.keras.Embedding(DIM, key_dtype="string", embeddings_initializer=tf.constant_initializer(0.1))
    inp = tf.keras.Input(shape=(2,), dtype="string")
    model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inp))))
    model.compile(optimizer=evstore.optimizers.Adagrad(0.1), loss="mse")
    x = np.array([[b"user:ann", b"genre:Comedy"], [b"user:bob", b"genre:Drama"]], object)
    model.fit(tf.constant(x.tolist()), np.array([[1.0], [-1.0]], np.float32), epochs=3, verbose=0)
    assert layer.ev.stats()["size"] == 4
    assert layer.ev.version([b"user:ann"]).numpy()[0] >= 0
    with pytest.raises(TypeError, match="string keys"):
        layer(tf.constant([[1, 2]], tf.int64))


# FarmHash Fingerprint64 of the bytes, and the shard route of each key (4 shards):
# pinned, so a change of hash or route (which would strand checkpoints saved with
# shards) fails here.
GOLDEN = [(b"", 11160318154034397263), (b"a", 12917804110809363939), (b"Comedy", 3948439503163846339),
          (b"hello world, this is 32 bytes!!", 17478617387400148267)]


def test_the_string_hash_is_tf_fingerprint():
    fp = tf.fingerprint(tf.constant([k for k, _ in GOLDEN]))
    got = [int.from_bytes(bytes(row), "little") for row in fp.numpy()]
    assert got == [h for _, h in GOLDEN]


def test_string_keys_route_as_the_int64_of_their_fingerprint():
    keys = [k for k, _ in GOLDEN] + [b"\xff" * 40]
    as_int = tf.bitcast(tf.fingerprint(tf.constant(keys)), tf.int64)
    for n in (1, 2, 4, 7):
        np.testing.assert_array_equal(evstore.shard_index(tf.constant(keys), n).numpy(),
                                      evstore.shard_index(as_int, n).numpy())
    assert evstore.shard_index(tf.constant([k for k, _ in GOLDEN]), 4).numpy().tolist() == [0, 3, 3, 1]


def test_sharded_string_ev_trains_like_an_unsharded_one():
    init = tf.constant_initializer(0.25)
    one = evstore.EmbeddingVariable("sh1", DIM, key_dtype=tf.string, initializer=init)
    three = evstore.EmbeddingVariable("sh3", DIM, key_dtype=tf.string, initializer=init, shards=3)
    batches = _batches(seed=4)
    _train(one, STR_KEYS, evstore.optimizers.Adagrad(0.1), batches)
    _train(three, STR_KEYS, evstore.optimizers.Adagrad(0.1), batches)
    _assert_rows_equal(one, three)
    routes = evstore.shard_index(tf.constant(list(STR_KEYS)), 3).numpy()
    for s, shard in enumerate(three.shards):
        held = set(shard.export()["keys"].numpy().tolist())
        assert held == {k for k, r in zip(STR_KEYS.tolist(), routes) if r == s}


def _assert_rows_equal(x, y):
    ex, ey = x.export(), y.export()
    dx = dict(zip(ex["keys"].numpy().tolist(), ex["values"].numpy()))
    dy = dict(zip(ey["keys"].numpy().tolist(), ey["values"].numpy()))
    assert dx.keys() == dy.keys()
    for k in dx:
        np.testing.assert_array_equal(dx[k], dy[k])


def test_embedding_lookup_group_takes_string_and_int_evs_together():
    init = tf.constant_initializer(0.25)
    s = evstore.EmbeddingVariable("grp_s", DIM, key_dtype=tf.string, initializer=init)
    i = evstore.EmbeddingVariable("grp_i", DIM, initializer=init)
    s_ref = evstore.EmbeddingVariable("grp_s_ref", DIM, key_dtype=tf.string, initializer=init)
    ids_s, ids_i = tf.constant([[b"a", b"b"], [b"a", b""]]), tf.constant([[1, 2]], tf.int64)
    with tf.GradientTape() as tape:
        ys, yi = evstore.embedding_lookup_group([s, i], [ids_s, ids_i])
        loss = tf.reduce_sum(ys * ys) + tf.reduce_sum(yi)
    evstore.optimizers.SGD(0.1).apply_gradients(zip(tape.gradient(loss, [s, i]), [s, i]))
    with tf.GradientTape() as tape:
        y = evstore.embedding_lookup(s_ref, ids_s)
        loss = tf.reduce_sum(y * y)
    evstore.optimizers.SGD(0.1).apply_gradients([(tape.gradient(loss, s_ref), s_ref)])
    _assert_rows_equal(s, s_ref)


def test_tf_train_checkpoint_round_trips_string_keys_as_dt_string(tmp_path):
    ev = evstore.EmbeddingVariable("ckpt", DIM, key_dtype=tf.string, filter=evstore.CounterFilter(2))
    evstore.embedding_lookup(ev, tf.constant([b"a", b"a", b"", b"\xff\xfe", b"once"]))
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
    assert dtypes["ev/.ATTRIBUTES/-keys"] == tf.string
    assert dtypes["ev/.ATTRIBUTES/-keys_filtered"] == tf.string
    back = evstore.EmbeddingVariable("ckpt", DIM, key_dtype=tf.string, filter=evstore.CounterFilter(2))
    tf.train.Checkpoint(ev=back).restore(path)
    _assert_rows_equal(ev, back)
    keys = [b"a", b"", b"\xff\xfe", b"once"]
    np.testing.assert_array_equal(back.frequency(keys).numpy(), ev.frequency(keys).numpy())


def test_an_over_long_key_read_or_written_as_rows_declares_no_slots():
    # EvReadRows / EvWriteRows declare the named slots; a refused key refuses them too.
    from evstore._ops import gen
    ev = evstore.EmbeddingVariable("toolong_rows", DIM, key_dtype=tf.string)
    evstore.embedding_lookup(ev, tf.constant([b"a"]))
    keys = tf.constant([b"a", b"z" * (evstore.MAX_STRING_KEY_BYTES + 1)])
    names, inits = tf.constant(["m"]), tf.constant([0.5])
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 65535 bytes"):
        gen.ev_read_rows(ev.resource_handle, keys, names, inits, dim=DIM)
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 65535 bytes"):
        gen.ev_write_rows(ev.resource_handle, keys, tf.zeros([2, DIM]), tf.zeros([1, 2, DIM]), names, inits,
                          tf.constant(1, tf.int64))
    assert ev.export()["slots"] == {}
