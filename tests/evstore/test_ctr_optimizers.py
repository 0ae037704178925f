"""Ftrl, AdamW, GroupAdam and GroupAdagrad: TensorFlow / Keras parity, the group
lasso dropping useless rows, slots, learning-rate forms and hyper-parameter checks.

References are independent of evstore wherever one exists: Keras 3's Ftrl, Adam,
Adagrad and AdamW on a dense `[rows, dim]` tf.Variable and TensorFlow's raw
`ResourceApplyFtrlV2`. The EV holds the same rows under non-contiguous keys, and
every row is touched in every step (Keras' dense optimizers update every row of a
variable each step; the fused EV apply updates the keys in the batch).
"""
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 4
KEYS = np.array([3, 17, 1000003, 2**40 + 7, 5, 99991, 123456789012, 42], np.int64)
N = len(KEYS)
STEPS = 20
TOL = 1e-5


def initial_rows(seed=0):
    return np.random.default_rng(seed).normal(0.0, 0.5, size=(N, DIM)).astype(np.float32)


def loaded_ev(rows, name="ctr"):
    ev = evstore.EmbeddingVariable(name, DIM)
    ev.load(KEYS, rows)
    return ev


def targets(seed=1, steps=STEPS):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(N, DIM)).astype(np.float32) for _ in range(steps)]


def loss_fn(emb, target):
    return tf.reduce_mean(tf.square(emb - target)) + 0.1 * tf.reduce_mean(tf.tanh(emb) * target)


def ev_rows(ev):
    return evstore.embedding_lookup(ev, KEYS, training=False).numpy()


def train_ev(ev, opt, steps=None, target_list=None):
    for target in target_list or targets(steps=steps or STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(evstore.embedding_lookup(ev, KEYS), target)
        opt.apply_gradients(zip(tape.gradient(loss, [ev]), [ev]))


def train_dense(var, opt, steps=None, target_list=None):
    for target in target_list or targets(steps=steps or STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(var, target)
        opt.apply_gradients(zip(tape.gradient(loss, [var]), [var]))


def assert_ev_matches_dense(make_ev_opt, make_ref_opt, rows=None):
    rows = initial_rows() if rows is None else rows
    ev, dense = loaded_ev(rows), tf.Variable(rows)
    train_ev(ev, make_ev_opt())
    train_dense(dense, make_ref_opt())
    assert np.abs(dense.numpy() - rows).max() > 1e-2, "training did not move the rows"
    np.testing.assert_allclose(ev_rows(ev), dense.numpy(), atol=TOL, rtol=0)
    return ev, dense


# ---- Ftrl: TensorFlow's semantics ------------------------------------------------------------

FTRL_CONFIGS = {
    "default": {},
    "l1_l2": dict(l1_regularization_strength=0.01, l2_regularization_strength=0.02),
    "shrinkage_power": dict(learning_rate_power=-0.7, l2_shrinkage_regularization_strength=0.05,
                            initial_accumulator_value=0.5),
    "beta": dict(beta=0.3, l1_regularization_strength=0.001),
}


@pytest.mark.parametrize("config", sorted(FTRL_CONFIGS))
def test_ftrl_ev_matches_keras_ftrl_on_a_dense_variable(config):
    kw = FTRL_CONFIGS[config]
    assert_ev_matches_dense(lambda: evstore.optimizers.Ftrl(0.2, **kw), lambda: tf.keras.optimizers.Ftrl(0.2, **kw))


def test_ftrl_ev_matches_tensorflow_raw_resource_apply_ftrl_v2():
    rows = initial_rows()
    lr, l1, l2, shrink, power, init = 0.2, 0.01, 0.02, 0.05, -0.5, 0.1
    ev = loaded_ev(rows)
    opt = evstore.optimizers.Ftrl(lr, learning_rate_power=power, initial_accumulator_value=init,
                                  l1_regularization_strength=l1, l2_regularization_strength=l2,
                                  l2_shrinkage_regularization_strength=shrink)
    train_ev(ev, opt)
    var, accum, linear = tf.Variable(rows), tf.Variable(np.full_like(rows, init)), tf.Variable(np.zeros_like(rows))
    for target in targets():
        with tf.GradientTape() as tape:
            loss = loss_fn(var, target)
        tf.raw_ops.ResourceApplyFtrlV2(var=var.handle, accum=accum.handle, linear=linear.handle,
                                       grad=tape.gradient(loss, var), lr=lr, l1=l1, l2=l2,
                                       l2_shrinkage=shrink, lr_power=power)
    np.testing.assert_allclose(ev_rows(ev), var.numpy(), atol=TOL, rtol=0)
    exported = ev.export()
    pos = {k: i for i, k in enumerate(exported["keys"].numpy())}
    idx = [pos[k] for k in KEYS]  # exported row of each dense row
    np.testing.assert_allclose(exported["slots"]["accumulator"].numpy()[idx], accum.numpy(), atol=TOL, rtol=1e-6)
    np.testing.assert_allclose(exported["slots"]["linear"].numpy()[idx], linear.numpy(), atol=TOL, rtol=1e-6)


def test_ftrl_trains_a_dense_variable_exactly_like_keras_ftrl():
    kw = dict(l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.05)
    rows = initial_rows()
    ours, ref = tf.Variable(rows), tf.Variable(rows)
    train_dense(ours, evstore.optimizers.Ftrl(0.2, **kw))
    train_dense(ref, tf.keras.optimizers.Ftrl(0.2, **kw))
    np.testing.assert_array_equal(ours.numpy(), ref.numpy())


# ---- GroupAdam / GroupAdagrad reduce to Adam / Adagrad -----------------------------------------

def test_group_adam_without_regularization_equals_adam():
    assert_ev_matches_dense(lambda: evstore.optimizers.GroupAdam(0.05),
                            lambda: tf.keras.optimizers.Adam(0.05))


def test_group_adagrad_without_regularization_equals_adagrad():
    assert_ev_matches_dense(lambda: evstore.optimizers.GroupAdagrad(0.2),
                            lambda: tf.keras.optimizers.Adagrad(0.2))


@pytest.mark.parametrize("ours,keras_cls", [
    (lambda: evstore.optimizers.GroupAdam(0.05), lambda: tf.keras.optimizers.Adam(0.05)),
    (lambda: evstore.optimizers.GroupAdagrad(0.2), lambda: tf.keras.optimizers.Adagrad(0.2)),
], ids=["group_adam", "group_adagrad"])
def test_group_optimizers_on_dense_variables_without_regularization_equal_keras(ours, keras_cls):
    rows = initial_rows()
    a, b = tf.Variable(rows), tf.Variable(rows)
    train_dense(a, ours())
    train_dense(b, keras_cls())
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("make_opt", [
    lambda: evstore.optimizers.GroupAdam(0.05, l1_regularization_strength=0.002,
                                         l2_regularization_strength=0.01, l21_regularization_strength=0.004),
    lambda: evstore.optimizers.GroupAdagrad(0.2, l1_regularization_strength=0.01,
                                            l2_regularization_strength=0.01, l21_regularization_strength=0.02),
], ids=["group_adam", "group_adagrad"])
def test_dense_group_update_is_the_fused_row_update_with_regularization(make_opt):
    """A [rows, dim] tf.Variable (group = row) and an EV holding the same rows
    train identically: one math, two paths."""
    rows = initial_rows()
    ev, dense = loaded_ev(rows), tf.Variable(rows)
    opt = make_opt()
    for target in targets():
        with tf.GradientTape() as tape:
            loss = loss_fn(evstore.embedding_lookup(ev, KEYS), target) + loss_fn(dense, target)
        grads = tape.gradient(loss, [ev, dense])
        opt.apply_gradients(zip(grads, [ev, dense]))
    assert np.abs(dense.numpy() - rows).max() > 1e-2
    np.testing.assert_allclose(ev_rows(ev), dense.numpy(), atol=TOL, rtol=0)


def test_group_optimizers_treat_a_1d_variable_as_one_group_per_element():
    """A bias [n] is n groups of one element: a strong l21 zeroes the elements
    whose gradients are small, independently of the others."""
    bias = tf.Variable([0.0, 0.0, 0.0])
    opt = evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.05)
    for _ in range(5):
        opt.apply_gradients([(tf.constant([1.0, 0.001, -1.0]), bias)])
    b = bias.numpy()
    assert b[1] == 0.0 and b[0] != 0.0 and b[2] != 0.0


# ---- AdamW -------------------------------------------------------------------------------------

def test_adamw_ev_matches_keras_adamw_when_every_row_is_touched():
    assert_ev_matches_dense(lambda: evstore.optimizers.AdamW(0.05, weight_decay=0.1),
                            lambda: tf.keras.optimizers.AdamW(0.05, weight_decay=0.1))


def test_adamw_decays_only_the_ev_rows_in_the_batch():
    rows = initial_rows()
    ev = loaded_ev(rows)
    opt = evstore.optimizers.AdamW(0.05, weight_decay=0.5)
    touched = KEYS[:3]
    for _ in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(evstore.embedding_lookup(ev, touched))
        opt.apply_gradients(zip(tape.gradient(loss, [ev]), [ev]))
    after = ev_rows(ev)
    np.testing.assert_array_equal(after[3:], rows[3:])  # untouched rows: no decay
    assert np.abs(after[:3] - rows[:3]).max() > 1e-2


def test_adamw_weight_decay_is_the_only_difference_from_adam_on_touched_rows():
    rows = initial_rows()
    a, b = loaded_ev(rows, "adamw_a"), loaded_ev(rows, "adamw_b")
    train_ev(a, evstore.optimizers.AdamW(0.05, weight_decay=0.0))
    train_ev(b, evstore.optimizers.Adam(0.05))
    np.testing.assert_allclose(ev_rows(a), ev_rows(b), atol=1e-6, rtol=0)


def test_adamw_exclude_from_weight_decay_applies_to_evs_by_name():
    rows = initial_rows()
    ev_a, ev_b = loaded_ev(rows, "excluded_tbl"), loaded_ev(rows, "plain_adam")
    opt = evstore.optimizers.AdamW(0.05, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["excluded_tbl"])
    train_ev(ev_a, opt)
    train_ev(ev_b, evstore.optimizers.Adam(0.05))
    np.testing.assert_allclose(ev_rows(ev_a), ev_rows(ev_b), atol=1e-6, rtol=0)


# ---- the group lasso drops rows ------------------------------------------------------------------

def test_large_l21_zeroes_rows_with_tiny_gradients_and_keeps_them_zero():
    keys = np.arange(100, 120, dtype=np.int64)
    weak, strong = keys[:10], keys[10:]
    ev = evstore.EmbeddingVariable("lasso", DIM, initializer=tf.random_normal_initializer(0, 0.1, seed=3))
    opt = evstore.optimizers.GroupAdam(0.01, l21_regularization_strength=0.02)
    rng = np.random.default_rng(0)
    for step in range(30):
        g = np.concatenate([rng.normal(0, 1e-4, (10, DIM)), rng.normal(0, 1.0, (10, DIM))]).astype(np.float32)
        evstore.embedding_lookup(ev, keys)  # admit (first step) and count
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.constant(keys)), ev)])
        rows = evstore.embedding_lookup(ev, keys, training=False).numpy()
        if step >= 1:  # once dropped, weak rows stay exactly zero while their gradients stay tiny
            assert np.all(rows[:10] == 0.0), f"step {step}"
        assert np.all(np.abs(rows[10:]).sum(axis=1) > 0), f"step {step}: a strong row was dropped"
    assert ev.stats()["zero_rows"] == 10
    np.testing.assert_array_equal(np.sort(ev.zero_row_keys().numpy()), weak)


def test_a_dropped_row_comes_back_when_its_gradients_become_strong():
    ev = evstore.EmbeddingVariable("revive", DIM, initializer=tf.zeros_initializer())
    opt = evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.01)
    keys = tf.constant([7], tf.int64)
    evstore.embedding_lookup(ev, keys)
    assert ev.stats()["zero_rows"] == 1  # a zero initializer row is a zero row
    opt.apply_gradients([(tf.IndexedSlices(tf.fill([1, DIM], 1e-4), keys), ev)])
    assert ev.stats()["zero_rows"] == 1
    for _ in range(3):
        opt.apply_gradients([(tf.IndexedSlices(tf.fill([1, DIM], 1.0), keys), ev)])
    assert ev.stats()["zero_rows"] == 0
    assert np.all(ev_rows_of(ev, [7]) != 0)


def ev_rows_of(ev, keys):
    return evstore.embedding_lookup(ev, tf.constant(keys, ev.key_dtype), training=False).numpy()


def test_zero_rows_can_be_removed_and_the_count_follows():
    ev = evstore.EmbeddingVariable("remove_zero", DIM, initializer=tf.zeros_initializer())
    evstore.embedding_lookup(ev, tf.constant([1, 2, 3], tf.int64))
    opt = evstore.optimizers.SGD(1.0)
    opt.apply_gradients([(tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([2], tf.int64)), ev)])
    assert ev.stats()["zero_rows"] == 2
    assert int(ev.remove(ev.zero_row_keys())) == 2
    assert ev.stats()["zero_rows"] == 0 and int(ev.size()) == 1


@pytest.mark.parametrize("make_opt", [
    lambda: evstore.optimizers.GroupAdam(0.05, l21_regularization_strength=0.1),
    lambda: evstore.optimizers.GroupAdagrad(0.5, l21_regularization_strength=0.15),
], ids=["group_adam", "group_adagrad"])
def test_logistic_regression_drops_most_useless_features_with_a_loss_close_to_adam(make_opt):
    """Logistic regression on one-hot ids, logit = sum of the looked-up rows:
    20 informative features (weights ~ N(0, 2)) and 200 useless ones (3 per
    example, independent of the label). With l21, at least 90% of the useless
    rows end exactly zero, every informative feature with |weight| >= 0.5 keeps
    its row, and the log loss of the last 30 steps is at most 0.02 above plain
    Adam's (lr 0.05) on the same data."""
    rng = np.random.default_rng(7)
    n_info, n_noise, dim, batch, steps = 20, 200, 4, 256, 150
    true_w = rng.normal(0, 2.0, n_info)

    def make_batch():
        info = rng.integers(0, n_info, batch)
        noise = rng.integers(n_info, n_info + n_noise, (batch, 3))
        y = (rng.random(batch) < 1 / (1 + np.exp(-true_w[info]))).astype(np.float32)
        return np.concatenate([info[:, None], noise], axis=1).astype(np.int64), y

    data = [make_batch() for _ in range(steps)]

    def train(opt, name):
        ev = evstore.EmbeddingVariable(name, dim, initializer=tf.random_normal_initializer(0, 0.01, seed=1))
        losses = []
        for ids, y in data:
            with tf.GradientTape() as tape:
                logits = tf.reduce_sum(evstore.embedding_lookup(ev, ids), axis=[1, 2])
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, logits))
            opt.apply_gradients(zip(tape.gradient(loss, [ev]), [ev]))
            losses.append(float(loss))
        return ev, np.mean(losses[-30:])

    ev_g, loss_g = train(make_opt(), "lr_group")
    _, loss_a = train(evstore.optimizers.Adam(0.05), "lr_adam")
    zero = np.all(ev_rows_of(ev_g, np.arange(n_info + n_noise)) == 0, axis=1)
    assert zero[n_info:].sum() >= 0.9 * n_noise, f"only {zero[n_info:].sum()}/{n_noise} useless rows dropped"
    assert not np.any(zero[:n_info][np.abs(true_w) >= 0.5]), (true_w, zero[:n_info])
    assert loss_g <= loss_a + 0.02, (loss_g, loss_a)
    assert ev_g.stats()["zero_rows"] == zero.sum()


# ---- slots, steps, learning rates --------------------------------------------------------------

@pytest.mark.parametrize("make_opt,slots", [
    (lambda: evstore.optimizers.Ftrl(0.1), {"accumulator", "linear"}),
    (lambda: evstore.optimizers.AdamW(0.1), {"m", "v"}),
    (lambda: evstore.optimizers.GroupAdam(0.1), {"m", "v", "linear"}),
    (lambda: evstore.optimizers.GroupAdagrad(0.1), {"accumulator", "linear"}),
], ids=["ftrl", "adamw", "group_adam", "group_adagrad"])
def test_slots_live_in_the_row_and_are_exported_under_their_names(make_opt, slots):
    ev = loaded_ev(initial_rows())
    train_ev(ev, make_opt(), steps=2)
    exported = ev.export()
    assert set(exported["slots"]) == slots
    for s in slots:
        assert exported["slots"][s].shape == (N, DIM)
    np.testing.assert_array_equal(exported["versions"].numpy(), np.ones(N))  # steps 0, 1: last stamp 1


def test_initial_accumulator_value_seeds_the_accumulator_of_new_rows():
    ev = evstore.EmbeddingVariable("acc_init", DIM)
    opt = evstore.optimizers.GroupAdagrad(0.1, initial_accumulator_value=0.7)
    ids = tf.constant([5], tf.int64)
    evstore.embedding_lookup(ev, ids)
    opt.apply_gradients([(tf.IndexedSlices(tf.fill([1, DIM], 0.5), ids), ev)])
    np.testing.assert_allclose(ev.export()["slots"]["accumulator"].numpy(), [[0.95] * DIM], rtol=1e-6)


def test_global_step_argument_stamps_versions_for_the_new_optimizers():
    ev = loaded_ev(initial_rows())
    opt = evstore.optimizers.GroupAdagrad(0.1)
    g = tf.IndexedSlices(tf.ones([2, DIM]), tf.constant(KEYS[:2]))
    opt.apply_gradients([(g, ev)], global_step=1234)
    np.testing.assert_array_equal(ev.version(KEYS[:3]).numpy(), [1234, 1234, -1])


def test_learning_rate_schedule_is_evaluated_at_the_step():
    sched = lambda: tf.keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=2, decay_rate=0.5)  # noqa: E731
    assert_ev_matches_dense(lambda: evstore.optimizers.Ftrl(sched()), lambda: tf.keras.optimizers.Ftrl(sched()))


def test_learning_rate_tf_variable_is_read_at_every_step():
    rows = initial_rows()
    lr_ev, lr_ref = tf.Variable(0.2), tf.Variable(0.2)
    ev, dense = loaded_ev(rows), tf.Variable(rows)
    opt = evstore.optimizers.GroupAdagrad(lr_ev)
    ref = tf.keras.optimizers.Adagrad(lambda: lr_ref)
    for i, target in enumerate(targets()):
        if i == 10:
            lr_ev.assign(0.01)
            lr_ref.assign(0.01)
        train_ev(ev, opt, target_list=[target])
        train_dense(dense, ref, target_list=[target])
    np.testing.assert_allclose(ev_rows(ev), dense.numpy(), atol=TOL, rtol=0)
    # ...and the change mattered: a constant 0.2 ends elsewhere.
    other = loaded_ev(rows, "lr_const")
    train_ev(other, evstore.optimizers.GroupAdagrad(0.2))
    assert np.abs(ev_rows(other) - ev_rows(ev)).max() > 1e-3


def test_group_adam_works_in_keras_model_fit():
    import keras
    inp = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(evstore.keras.Embedding(4, name="fit_group")(inp))
    model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile(optimizer=evstore.optimizers.GroupAdam(0.01, l21_regularization_strength=1e-4),
                  loss="binary_crossentropy")
    ids = np.random.default_rng(0).integers(0, 100, size=(256, 2))
    hist = model.fit(ids, (ids[:, 0] % 2).astype("float32"), epochs=3, verbose=0, batch_size=64)
    assert np.isfinite(hist.history["loss"]).all()


def test_v1_session_group_adagrad_matches_eager_optimizer():
    batches = [[1, 2, 2, 9], [9, 1, 4, 4], [2, 4, 1, 9]]
    bank = np.random.default_rng(3).normal(size=(8, DIM)).astype(np.float32)
    kw = dict(l1=0.01, l2=0.01, l21=0.01)

    def make(name):
        return evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(bank), initializer_bank_size=8)

    ev = make("fn_ga_eager")
    opt = evstore.optimizers.GroupAdagrad(0.3, l1_regularization_strength=0.01, l2_regularization_strength=0.01,
                                          l21_regularization_strength=0.01)
    for b in batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(ev, tf.constant(b, tf.int64)) - 1.0))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    eager = ev_rows_of(ev, [1, 2, 4, 9])
    with tf.Graph().as_default():
        gev = make("fn_ga_graph")
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        step = tf.compat.v1.placeholder(tf.int64, [])
        loss = tf.reduce_sum(tf.square(evstore.embedding_lookup(gev, ids) - 1.0))
        grad = tf.compat.v1.gradients(loss, [gev])[0]
        train = evstore.training.sparse_apply_group_adagrad(gev, grad, 0.3, step, **kw)
        read = evstore.embedding_lookup(gev, tf.constant([1, 2, 4, 9], tf.int64), training=False)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.tables_initializer())
            for i, b in enumerate(batches):
                sess.run(train, {ids: b, step: i})
            graph = sess.run(read)
    np.testing.assert_allclose(graph, eager, atol=1e-6, rtol=0)


# ---- hyper-parameter validation ----------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: evstore.optimizers.Ftrl(0.1, l1_regularization_strength=-0.1),
    lambda: evstore.optimizers.Ftrl(0.1, l2_regularization_strength=-1.0),
    lambda: evstore.optimizers.Ftrl(0.1, l2_shrinkage_regularization_strength=-1.0),
    lambda: evstore.optimizers.GroupAdam(0.1, l1_regularization_strength=-0.1),
    lambda: evstore.optimizers.GroupAdam(0.1, l2_regularization_strength=-0.1),
    lambda: evstore.optimizers.GroupAdam(0.1, l21_regularization_strength=-0.1),
    lambda: evstore.optimizers.GroupAdagrad(0.1, l1_regularization_strength=-0.1),
    lambda: evstore.optimizers.GroupAdagrad(0.1, l2_regularization_strength=-0.1),
    lambda: evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=-0.1),
    lambda: evstore.optimizers.AdamW(0.1, weight_decay=-0.1),
], ids=["ftrl_l1", "ftrl_l2", "ftrl_shrinkage", "gadam_l1", "gadam_l2", "gadam_l21", "gadagrad_l1",
        "gadagrad_l2", "gadagrad_l21", "adamw_wd"])
def test_negative_regularization_raises_value_error_naming_it(make):
    with pytest.raises(ValueError, match="must be >= 0"):
        make()


@pytest.mark.parametrize("cls", [evstore.optimizers.GroupAdam, evstore.optimizers.AdamW])
@pytest.mark.parametrize("kwargs", [dict(beta_1=1.0), dict(beta_1=-0.1), dict(beta_2=1.5)])
def test_beta_outside_zero_one_raises_value_error(cls, kwargs):
    with pytest.raises(ValueError, match=list(kwargs)[0] + r" must be in \[0.0, 1.0\)"):
        cls(0.1, **kwargs)


@pytest.mark.parametrize("cls", [evstore.optimizers.Ftrl, evstore.optimizers.GroupAdam,
                                 evstore.optimizers.GroupAdagrad, evstore.optimizers.AdamW])
@pytest.mark.parametrize("lr", [0.0, -0.5])
def test_non_positive_learning_rate_raises_value_error(cls, lr):
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        cls(learning_rate=lr)


def test_positive_learning_rate_power_raises_value_error():
    with pytest.raises(ValueError, match="learning_rate_power must be <= 0"):
        evstore.optimizers.Ftrl(0.1, learning_rate_power=0.5)


@pytest.mark.parametrize("fn,kwargs,name", [
    (evstore.training.sparse_apply_group_adam, dict(l21=-1.0), "l21"),
    (evstore.training.sparse_apply_group_adagrad, dict(l1=-1.0), "l1"),
    (evstore.training.sparse_apply_ftrl, dict(l2_shrinkage=-1.0), "l2_shrinkage"),
    (evstore.training.sparse_apply_adamw, dict(beta_2=1.0), "beta_2"),
])
def test_functional_api_checks_python_number_hyper_parameters(fn, kwargs, name):
    ev = loaded_ev(initial_rows())
    g = tf.IndexedSlices(tf.ones([1, DIM]), tf.constant(KEYS[:1]))
    with pytest.raises(ValueError, match=name):
        fn(ev, g, 0.1, 0, **kwargs)


@pytest.mark.parametrize("fn,kwargs,name", [
    (evstore.training.sparse_apply_group_adam, dict(l21=-1.0), "l21"),
    (evstore.training.sparse_apply_group_adagrad, dict(l2=-1.0), "l2"),
    (evstore.training.sparse_apply_ftrl, dict(l1=-1.0), "l1"),
    (evstore.training.sparse_apply_adamw, dict(weight_decay=-1.0), "weight_decay"),
    (evstore.training.sparse_apply_ftrl, dict(learning_rate_power=0.5), "learning_rate_power"),
    (evstore.training.sparse_apply_group_adam, dict(beta_1=1.0), r"beta_1 must be in \[0, 1\)"),
], ids=["group_adam", "group_adagrad", "ftrl", "adamw", "ftrl_power", "group_adam_beta"])
def test_kernels_refuse_bad_tensor_hyper_parameters_and_change_nothing(fn, kwargs, name):
    rows = initial_rows()
    ev = loaded_ev(rows)
    g = tf.IndexedSlices(tf.ones([N, DIM]), tf.constant(KEYS))
    bad = {k: tf.constant(v) for k, v in kwargs.items()}
    with pytest.raises(tf.errors.InvalidArgumentError, match=name if "must" in name else name + " must be"):
        fn(ev, g, 0.1, 0, **bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be > 0|alpha"):
        fn(ev, g, tf.constant(-0.1), 0)
    np.testing.assert_array_equal(ev_rows(ev), rows)
    assert ev.export()["slots"] == {}
    np.testing.assert_array_equal(ev.version(KEYS).numpy(), -np.ones(N))


@pytest.mark.parametrize("make_opt", [
    lambda: evstore.optimizers.Ftrl(0.1), lambda: evstore.optimizers.AdamW(0.1),
    lambda: evstore.optimizers.GroupAdam(0.1, l21_regularization_strength=0.01),
    lambda: evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.01),
], ids=["ftrl", "adamw", "group_adam", "group_adagrad"])
def test_non_finite_ev_gradient_is_refused_and_changes_nothing(make_opt):
    ev = loaded_ev(initial_rows())
    opt = make_opt()
    train_ev(ev, opt, steps=1)
    before = ev.export()
    grads = np.full((N, DIM), 0.5, np.float32)
    grads[2, 1] = np.nan
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"key {KEYS[2]}"):
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(grads), tf.constant(KEYS)), ev)])
    after = ev.export()
    np.testing.assert_array_equal(after["values"].numpy(), before["values"].numpy())
    for s in before["slots"]:
        np.testing.assert_array_equal(after["slots"][s].numpy(), before["slots"][s].numpy())


@pytest.mark.parametrize("make_opt", [
    lambda: evstore.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    lambda: evstore.optimizers.AdamW(0.05, weight_decay=0.1),
    lambda: evstore.optimizers.GroupAdam(0.05, l21_regularization_strength=0.01),
    lambda: evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.01),
], ids=["ftrl", "adamw", "group_adam", "group_adagrad"])
def test_training_inside_tf_function_matches_eager(make_opt):
    rows = initial_rows()
    eager_ev, fn_ev = loaded_ev(rows, "eager_side"), loaded_ev(rows, "function_side")
    kernel0 = np.random.default_rng(4).normal(size=(DIM, 2)).astype(np.float32)
    eager_k, fn_k = tf.Variable(kernel0), tf.Variable(kernel0)
    eager_opt, fn_opt = make_opt(), make_opt()

    def step(ev, kernel, opt, target):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.matmul(evstore.embedding_lookup(ev, KEYS), kernel), target[:, :2])
        opt.apply_gradients(zip(tape.gradient(loss, [ev, kernel]), [ev, kernel]))

    fn_step = tf.function(lambda target: step(fn_ev, fn_k, fn_opt, target))
    for target in targets(steps=8):
        step(eager_ev, eager_k, eager_opt, target)
        fn_step(tf.constant(target))
    np.testing.assert_allclose(ev_rows(fn_ev), ev_rows(eager_ev), atol=1e-6, rtol=0)
    np.testing.assert_allclose(fn_k.numpy(), eager_k.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(fn_ev.version(KEYS).numpy(), np.full(N, 7))


def test_checkpoint_round_trip_keeps_group_lasso_slots_and_zero_rows(tmp_path):
    """tf.train.Checkpoint restores rows, "m"/"v"/"linear" and the zero-row
    count; training resumed from the restore matches uninterrupted training."""
    keys = np.arange(1, 13, dtype=np.int64)
    g = np.concatenate([np.full((6, DIM), 1e-5), np.linspace(-1, 1, 6 * DIM).reshape(6, DIM)]).astype(np.float32)

    def make(name):
        return evstore.EmbeddingVariable(name, DIM, initializer=tf.zeros_initializer())

    def step(ev, opt, s):
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.constant(keys)), ev)], global_step=s)

    ev = make("ck_group")
    evstore.embedding_lookup(ev, keys)
    opt = evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.01)
    for s in range(3):
        step(ev, opt, s)
    assert ev.stats()["zero_rows"] == 6
    path = tf.train.Checkpoint(ev=ev).save(str(tmp_path / "c"))
    ev2 = make("ck_group_restored")
    tf.train.Checkpoint(ev=ev2).restore(path).assert_consumed()
    assert ev2.stats()["zero_rows"] == 6
    np.testing.assert_array_equal(np.sort(ev2.zero_row_keys().numpy()), keys[:6])
    opt2 = evstore.optimizers.GroupAdagrad(0.1, l21_regularization_strength=0.01)
    for s in range(3, 6):
        step(ev, opt, s)
        step(ev2, opt2, s)
    a, b = ev.export(), ev2.export()
    oa, ob = np.argsort(a["keys"].numpy()), np.argsort(b["keys"].numpy())
    np.testing.assert_array_equal(a["values"].numpy()[oa], b["values"].numpy()[ob])
    assert set(b["slots"]) == {"accumulator", "linear"}
    for s in a["slots"]:
        np.testing.assert_array_equal(a["slots"][s].numpy()[oa], b["slots"][s].numpy()[ob])
