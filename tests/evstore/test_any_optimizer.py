"""Any Keras 3 optimizer trains EmbeddingVariables (the generic row path,
evstore/generic.py): parity with Keras on a dense variable holding the same
rows, clipping, gradient accumulation, loss scaling and mixed precision,
refusals, v1 graph mode, and slots that checkpoint / evict with the row."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import evstore
from evstore.generic import sparse_apply_keras

from ckpt_model import assert_same_state, make_model, state, train

N, D, STEPS = 8, 4, 20
INIT = np.random.RandomState(0).normal(size=(N, D)).astype(np.float32)

OPTIMIZERS = {
    "sgd_momentum": lambda **kw: keras.optimizers.SGD(0.01, momentum=0.9, **kw),
    "sgd_nesterov": lambda **kw: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True, **kw),
    "rmsprop": lambda **kw: keras.optimizers.RMSprop(0.01, **kw),
    "rmsprop_centered_momentum": lambda **kw: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True, **kw),
    "adadelta": lambda **kw: keras.optimizers.Adadelta(1.0, **kw),
    "adamax": lambda **kw: keras.optimizers.Adamax(0.01, **kw),
    "nadam": lambda **kw: keras.optimizers.Nadam(0.01, **kw),
    "lion": lambda **kw: keras.optimizers.Lion(0.001, **kw),
    "ftrl": lambda **kw: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                               l2_regularization_strength=0.01, **kw),
    "adam": lambda **kw: keras.optimizers.Adam(0.01, **kw),
    "adamw": lambda **kw: keras.optimizers.AdamW(0.01, weight_decay=0.1, **kw),
    "adagrad": lambda **kw: keras.optimizers.Adagrad(0.1, **kw),
    "loss_scale_rmsprop": lambda **kw: keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.01, **kw)),
    "loss_scale_lion": lambda **kw: keras.optimizers.LossScaleOptimizer(keras.optimizers.Lion(0.001, **kw)),
    "loss_scale_fused_adam": lambda **kw: keras.optimizers.LossScaleOptimizer(evstore.optimizers.Adam(0.01, **kw)),
}


def _batches():
    """Every batch touches every row (a permutation) plus some duplicates."""
    rs = np.random.RandomState(1)
    return [np.concatenate([rs.permutation(N), rs.randint(0, N, 4)]).astype(np.int64) for _ in range(STEPS)]


def _rows(ev):
    x = ev.export()
    order = np.argsort(x["keys"].numpy())
    return x["values"].numpy()[order], {n: v.numpy()[order] for n, v in x["slots"].items()}


def _train_both(make, compiled=False):
    """An EV and a dense tf.Variable holding the same rows, each with a dense
    bias, trained on the same batches: the EV (and its bias) in one
    apply_gradients of `make()`, the reference by Keras's own optimizer."""
    ev = evstore.EmbeddingVariable("rows", D)
    ev.load(np.arange(N), INIT)
    ref = tf.Variable(INIT)
    bias, ref_bias = tf.Variable(np.ones(D, np.float32)), tf.Variable(np.ones(D, np.float32))
    opt, ref_opt = make(), make()

    def step(ids):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, ids) * bias - 0.5))
            ref_loss = tf.reduce_sum(tf.square(tf.gather(ref, ids) * ref_bias - 0.5))
            if isinstance(opt, keras.optimizers.LossScaleOptimizer):
                loss, ref_loss = opt.scale_loss(loss), ref_opt.scale_loss(ref_loss)
        g_ev, g_bias = tape.gradient(loss, [ev, bias])
        g_ref, g_ref_bias = tape.gradient(ref_loss, [ref, ref_bias])
        opt.apply_gradients([(g_ev, ev), (g_bias, bias)])
        ref_opt.apply_gradients([(tf.convert_to_tensor(g_ref), ref), (g_ref_bias, ref_bias)])

    if compiled:
        step = tf.function(step)
    for ids in _batches():
        step(tf.constant(ids))
    return ev, ref, bias, ref_bias


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_optimizer_trains_ev_like_a_dense_variable_eager(name):
    ev, ref, bias, ref_bias = _train_both(OPTIMIZERS[name])
    values, slots = _rows(ev)
    np.testing.assert_allclose(values, ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(bias.numpy(), ref_bias.numpy(), atol=1e-5)
    assert slots   # every listed optimizer keeps per-row state


@pytest.mark.parametrize("name", ["rmsprop_centered_momentum", "nadam", "ftrl", "loss_scale_lion"])
def test_keras_optimizer_trains_ev_like_a_dense_variable_in_tf_function(name):
    ev, ref, bias, ref_bias = _train_both(OPTIMIZERS[name], compiled=True)
    np.testing.assert_allclose(_rows(ev)[0], ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(bias.numpy(), ref_bias.numpy(), atol=1e-5)


def test_generic_slots_are_table_slots_named_by_optimizer():
    ev, *_ = _train_both(OPTIMIZERS["rmsprop_centered_momentum"])
    assert sorted(_rows(ev)[1]) == ["rmsprop_average_gradient", "rmsprop_momentum", "rmsprop_velocity"]
    ev, *_ = _train_both(OPTIMIZERS["ftrl"])
    assert sorted(_rows(ev)[1]) == ["ftrl_accumulator", "ftrl_linear"]


def test_generic_slot_starts_at_the_optimizers_initial_value():
    ev = evstore.EmbeddingVariable("acc", D)
    opt = keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.25)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([3], tf.int64)))
    opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    # one step: accumulator = 0.25 + g^2 with g = 1
    np.testing.assert_allclose(ev.export()["slots"]["adagrad_accumulator"].numpy(), [[1.25] * D])


@pytest.mark.parametrize("clip", [dict(clipnorm=0.5), dict(clipvalue=0.05), dict(global_clipnorm=0.3)])
@pytest.mark.parametrize("name", ["rmsprop", "fused_adam"])
def test_gradient_clipping_acts_on_ev_gradients_as_on_dense(name, clip):
    make = {"rmsprop": lambda: keras.optimizers.RMSprop(0.01, **clip),
            "fused_adam": lambda: evstore.optimizers.Adam(0.01, **clip)}[name]
    ev, ref, bias, ref_bias = _train_both(make)
    np.testing.assert_allclose(_rows(ev)[0], ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(bias.numpy(), ref_bias.numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["nadam", "fused_sgd"])
def test_gradient_accumulation_sums_ev_gradients_by_key(name):
    make = {"nadam": lambda: keras.optimizers.Nadam(0.01, gradient_accumulation_steps=3),
            "fused_sgd": lambda: evstore.optimizers.SGD(0.05, gradient_accumulation_steps=3)}[name]
    ev, ref, bias, ref_bias = _train_both(make, compiled=True)
    np.testing.assert_allclose(_rows(ev)[0], ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(bias.numpy(), ref_bias.numpy(), atol=1e-5)


def test_lazy_untouched_rows_neither_move_nor_decay():
    ev = evstore.EmbeddingVariable("lazy", D)
    ev.load(np.arange(N), INIT)
    opt = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([0, 1], tf.int64)))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    values, _ = _rows(ev)
    np.testing.assert_array_equal(values[2:], INIT[2:])
    assert not np.allclose(values[:2], INIT[:2])
    np.testing.assert_array_equal(ev.version(np.arange(N)).numpy(), [2, 2] + [-1] * (N - 2))


def test_model_fit_with_mixed_bfloat16_and_loss_scale_trains_an_ev():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        ids_in = keras.Input((3,), dtype="int64")
        emb = evstore.keras.Embedding(4, name="mp_emb")
        out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids_in)))
        model = keras.Model(ids_in, out)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Nadam(0.01, clipnorm=1.0)),
                      loss="mse")
        rs = np.random.RandomState(0)
        ids, y = rs.randint(0, 50, (64, 3)), rs.rand(64, 1).astype("float32")
        hist = model.fit(ids, y, epochs=3, batch_size=16, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert emb.compute_dtype == "bfloat16"
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert sorted(emb.ev.export()["slots"]) == ["nadam_momentum", "nadam_velocity"]
    assert int(tf.reduce_max(emb.ev.version(np.arange(50)))) == 11   # 12 steps, versions 0..11


def test_keras_optimizer_trains_a_sharded_ev_through_its_layer():
    ids_in = keras.Input((2,), dtype="int64")
    emb = evstore.keras.Embedding(4, name="generic_sharded", shards=2)
    model = keras.Model(ids_in, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids_in))))
    model.compile(optimizer=keras.optimizers.Lion(0.001, gradient_accumulation_steps=2), loss="mse")
    rs = np.random.RandomState(0)
    model.fit(rs.randint(0, 40, (32, 2)), rs.rand(32, 1), epochs=2, batch_size=8, verbose=0)
    for shard in emb.ev.shards:
        x = shard.export()
        assert sorted(x["slots"]) == ["lion_momentum"]
        assert np.abs(x["slots"]["lion_momentum"].numpy()).sum() > 0


@pytest.mark.parametrize("make,word", [(lambda: keras.optimizers.Adafactor(0.01), "Adafactor"),
                                       (lambda: keras.optimizers.Lamb(0.01), "Lamb"),
                                       (lambda: keras.optimizers.RMSprop(0.01, use_ema=True), "use_ema")])
def test_optimizer_without_a_row_local_rule_is_refused_by_name(make, word):
    ev = evstore.EmbeddingVariable("refused", D)
    ev.load(np.arange(N), INIT)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([1, 2], tf.int64)))
    with pytest.raises(ValueError, match=word):
        make().apply_gradients([(tape.gradient(loss, ev), ev)])
    np.testing.assert_array_equal(_rows(ev)[0], INIT)


def test_loss_scale_optimizer_skips_a_non_finite_step_and_lowers_its_scale():
    ev = evstore.EmbeddingVariable("lso_skip", D)
    ev.load(np.arange(N), INIT)
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.01))

    @tf.function
    def step(factor):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([1, 2], tf.int64)) * factor))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])

    step(tf.constant(np.inf, tf.float32))
    assert float(opt.dynamic_scale) == opt.initial_scale / 2
    np.testing.assert_array_equal(_rows(ev)[0], INIT)
    step(tf.constant(1.0))
    assert not np.array_equal(_rows(ev)[0][1:3], INIT[1:3])


def test_generic_path_refuses_non_finite_gradients_and_changes_nothing():
    ev = evstore.EmbeddingVariable("nan", D)
    ev.load(np.arange(N), INIT)
    bias = tf.Variable(np.ones(D, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([1, 2], tf.int64)) * bias * np.inf)
    g = tape.gradient(loss, [ev, bias])
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        keras.optimizers.RMSprop(0.01).apply_gradients(zip(g, [ev, bias]))
    np.testing.assert_array_equal(_rows(ev)[0], INIT)
    np.testing.assert_array_equal(bias.numpy(), np.ones(D))


def test_v1_graph_functional_api_trains_like_keras_on_a_dense_variable():
    batches = _batches()
    graph = tf.Graph()
    with graph.as_default():
        ev = evstore.EmbeddingVariable("v1", D)
        opt = keras.optimizers.Nadam(0.01)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        step = tf.compat.v1.placeholder(tf.int64, [])
        loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, ids) - 0.5))
        train_op = sparse_apply_keras(opt, [(tf.compat.v1.gradients(loss, [ev])[0], ev)], step)
        load, export = ev.load(np.arange(N), INIT), ev.export()
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.tables_initializer(), tf.compat.v1.global_variables_initializer()])
            sess.run(load)
            for i, x in enumerate(batches):
                sess.run(train_op, {ids: x, step: i})
            out = sess.run(export)
    ref, ref_opt = tf.Variable(INIT), keras.optimizers.Nadam(0.01)
    for x in batches:
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_sum(tf.square(tf.gather(ref, x) - 0.5))
        ref_opt.apply_gradients([(tf.convert_to_tensor(tape.gradient(ref_loss, ref)), ref)])
    np.testing.assert_allclose(out["values"][np.argsort(out["keys"])], ref.numpy(), atol=1e-5)


def test_evicted_row_loses_its_generic_slots():
    ev = evstore.EmbeddingVariable("evict", D)
    opt = keras.optimizers.RMSprop(0.1)
    for ids in ([1, 2], [1]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant(ids, tf.int64)))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    ev.remove([1])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, tf.constant([1], tf.int64)))
    opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    x = ev.export()
    velocity = dict(zip(x["keys"].numpy(), x["slots"]["rmsprop_velocity"].numpy()))
    # key 1 came back with a fresh slot: one step's (1 - rho) * g^2, not three
    np.testing.assert_allclose(velocity[1], [0.1] * D, rtol=1e-6)
    np.testing.assert_allclose(velocity[2], [0.1] * D, rtol=1e-6)


def _generic_model():
    model = make_model()
    model.compile(optimizer=keras.optimizers.RMSprop(0.05, momentum=0.5, centered=True), loss="binary_crossentropy")
    return model


def test_checkpoint_round_trip_mid_training_resumes_bit_for_bit(tmp_path):
    model = _generic_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 4)
    mgr.save_full()
    train(model, 4, 7)
    mgr.save_delta()            # the delta carries the changed rows with their RMSprop slots
    train(model, 7, 12)
    fresh = _generic_model()
    checkpoint.CheckpointManager(str(tmp_path), fresh).restore()
    train(fresh, 7, 12)
    got, want = state(fresh), state(model)
    assert {k.split(":slot:")[1] for k in want if ":slot:" in k} == {
        "rmsprop_velocity", "rmsprop_momentum", "rmsprop_average_gradient"}
    assert_same_state(got, want)
