"""evstore.keras.Embedding in plain Keras 3 models: fit, predict, tf.train.Checkpoint
(docs/ARCHITECTURE.md, "Ops and Python API")."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import evstore

DIM = 8
N_IDS = 40
ID_SPACE = np.arange(N_IDS, dtype=np.int64) * 1_000_003 + 7     # non-contiguous ids
UNSEEN = np.array([5, 2**40, 123], np.int64)


def synthetic_data(n=1024, seed=0):
    """Two ids per example; the label is 1 iff the first id has an even position in ID_SPACE."""
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, N_IDS, size=(n, 2))
    x = ID_SPACE[pos]
    y = (pos[:, :1] % 2 == 0).astype(np.float32)
    return x, y


def functional_model():
    ids = keras.Input(shape=(2,), dtype="int64")
    emb = evstore.keras.Embedding(dim=DIM, name="ids_embedding")(ids)
    hidden = keras.layers.Flatten()(emb)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(hidden)
    model = keras.Model(ids, out)
    model.compile(optimizer=evstore.optimizers.Adam(learning_rate=0.05), loss="binary_crossentropy")
    return model


class SubclassedModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.embedding = evstore.keras.Embedding(dim=DIM)
        self.flatten = keras.layers.Flatten()
        self.head = keras.layers.Dense(1, activation="sigmoid")

    def call(self, ids, training=None):
        return self.head(self.flatten(self.embedding(ids, training=training)))


def ev_of(model):
    (layer,) = [l for l in model.layers if isinstance(l, evstore.keras.Embedding)]
    return layer.ev


def dense_kernel(model):
    (layer,) = [l for l in model.layers if isinstance(l, keras.layers.Dense)]
    return layer.kernel.numpy().copy()


def table(ev):
    exp = ev.export()
    order = np.argsort(exp["keys"].numpy())
    out = {f: exp[f].numpy()[order] for f in ("keys", "values", "versions", "freqs")}
    out.update({"slot:" + n: s.numpy()[order] for n, s in exp["slots"].items()})
    return out


@pytest.fixture(scope="module")
def trained():
    """A functional model fit for 1 epoch, then 4 more; with snapshots between."""
    x, y = synthetic_data()
    model = functional_model()
    kernel0 = dense_kernel(model)
    loss0 = model.evaluate(x, y, batch_size=256, verbose=0)   # read-only lookups: all rows read zeros
    first = model.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    rows1 = table(ev_of(model))
    later = model.fit(x, y, batch_size=64, epochs=4, verbose=0).history["loss"]
    loss_end = model.evaluate(x, y, batch_size=256, verbose=0)
    return {"model": model, "x": x, "y": y, "losses": first + later, "loss0": loss0, "loss_end": loss_end,
            "kernel0": kernel0, "rows1": rows1}


def test_fit_makes_the_loss_fall_clearly(trained):
    np.testing.assert_allclose(trained["loss0"], np.log(2.0), rtol=1e-3)   # untrained: p = 0.5 everywhere
    assert trained["loss_end"] < 0.25 * trained["loss0"], (trained["loss0"], trained["loss_end"])
    losses = trained["losses"]
    assert losses[-1] < 0.25 * losses[0], losses


def test_fit_learns_the_id_dependent_label(trained):
    pred = trained["model"].predict(trained["x"], verbose=0)
    accuracy = np.mean((pred > 0.5) == (trained["y"] > 0.5))
    assert accuracy > 0.95


def test_fit_inserts_every_training_id_and_trains_its_row(trained):
    ev = ev_of(trained["model"])
    now = table(ev)
    np.testing.assert_array_equal(now["keys"], np.sort(ID_SPACE))
    np.testing.assert_array_equal(now["keys"], trained["rows1"]["keys"])
    moved = np.abs(now["values"] - trained["rows1"]["values"]).max(axis=1)
    assert np.all(moved > 1e-4), moved
    assert sorted(k for k in now if k.startswith("slot:")) == ["slot:m", "slot:v"]
    assert np.all(now["versions"] >= 0)


def test_fit_trains_the_dense_kernel(trained):
    assert np.abs(dense_kernel(trained["model"]) - trained["kernel0"]).max() > 1e-3


def test_fit_counts_every_id_occurrence(trained):
    ev = ev_of(trained["model"])
    x = trained["x"]
    expected = [5 * int(np.sum(x == k)) for k in ID_SPACE]   # 5 epochs over the same data
    np.testing.assert_array_equal(ev.frequency(tf.constant(ID_SPACE)).numpy(), expected)


def test_predict_does_not_insert_or_count_unseen_ids(trained):
    model = trained["model"]
    ev = ev_of(model)
    before = table(ev)
    x = np.stack([UNSEEN, ID_SPACE[:3]], axis=1)
    pred = model.predict(x, verbose=0)
    assert pred.shape == (3, 1)
    assert np.all(np.isfinite(pred))
    after = table(ev)
    for field in before:
        np.testing.assert_array_equal(after[field], before[field], err_msg=field)
    np.testing.assert_array_equal(ev.frequency(tf.constant(UNSEEN)).numpy(), [0, 0, 0])


def test_predict_reads_the_default_value_for_unseen_ids(trained):
    model = trained["model"]
    x_unseen = np.stack([UNSEEN, UNSEEN[::-1]], axis=1)
    emb = evstore.embedding_lookup(ev_of(model), tf.constant(x_unseen), training=False)
    np.testing.assert_array_equal(emb.numpy(), np.zeros((3, 2, DIM), np.float32))
    pred = model.predict(x_unseen, verbose=0)
    np.testing.assert_allclose(pred, np.full_like(pred, pred[0, 0]), atol=1e-6)   # all rows read zeros


def test_checkpoint_restore_into_a_fresh_model_gives_identical_predictions_and_table(trained, tmp_path):
    model = trained["model"]
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = functional_model()
    assert int(ev_of(fresh).size()) == 0
    tf.train.Checkpoint(model=fresh).restore(path).assert_existing_objects_matched()
    want, got = table(ev_of(model)), table(ev_of(fresh))
    assert sorted(got) == sorted(want)
    for field in want:
        np.testing.assert_array_equal(got[field], want[field], err_msg=field)
    x = np.concatenate([trained["x"][:64], np.stack([UNSEEN, UNSEEN], axis=1)])
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))


def test_checkpoint_restore_replaces_rows_a_fresh_model_already_had(trained, tmp_path):
    path = tf.train.Checkpoint(model=trained["model"]).save(str(tmp_path / "ckpt"))
    fresh = functional_model()
    stray = np.array([[UNSEEN[0], UNSEEN[1]]])
    fresh.fit(stray, np.ones((1, 1), np.float32), epochs=1, verbose=0)
    tf.train.Checkpoint(model=fresh).restore(path)
    np.testing.assert_array_equal(table(ev_of(fresh))["keys"], np.sort(ID_SPACE))


def test_subclassed_model_holding_the_layer_trains_and_predicts():
    x, y = synthetic_data(seed=1)
    model = SubclassedModel()
    model.compile(optimizer=evstore.optimizers.Adam(learning_rate=0.05), loss="binary_crossentropy")
    losses = model.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    ev = model.embedding.ev
    rows1 = table(ev)
    losses += model.fit(x, y, batch_size=64, epochs=4, verbose=0).history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(ev.size()) == N_IDS
    assert np.all(np.abs(table(ev)["values"] - rows1["values"]).max(axis=1) > 1e-4)
    pred = model.predict(np.stack([UNSEEN, UNSEEN], axis=1), verbose=0)
    assert pred.shape == (3, 1)
    assert int(ev.size()) == N_IDS
    assert np.mean((model.predict(x, verbose=0) > 0.5) == (y > 0.5)) > 0.95


def test_subclassed_model_checkpoint_round_trip(tmp_path):
    x, y = synthetic_data(n=256, seed=2)
    model = SubclassedModel()
    model.compile(optimizer=evstore.optimizers.Adam(learning_rate=0.05), loss="binary_crossentropy")
    model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = SubclassedModel()
    fresh(x[:1])   # build the dense head
    tf.train.Checkpoint(model=fresh).restore(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(table(fresh.embedding.ev)["values"], table(model.embedding.ev)["values"])
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))


def test_subclassed_model_embedding_layer_owns_exactly_one_proxy_weight():
    model = SubclassedModel()
    model(synthetic_data(n=2)[0])   # Keras builds sublayers symbolically first, then eagerly
    assert [w.shape for w in model.embedding.weights] == [(0,)], [w.path for w in model.embedding.weights]
    assert len(model.trainable_variables) == 3   # proxy, kernel, bias


def test_subclassed_model_fit_gives_every_trainable_variable_a_gradient():
    x, y = synthetic_data(n=128, seed=3)
    model = SubclassedModel()
    model.compile(optimizer=evstore.optimizers.SGD(learning_rate=0.1), loss="binary_crossentropy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    missing = [str(w.message) for w in caught if "Gradients do not exist" in str(w.message)]
    assert missing == []
