"""Keras 3 conventions for evstore.keras.Embedding and evstore's optimizers,
filters and eviction policies: `.keras` files, configs, clone_model, export
(docs/guides/keras.md)."""
import json
import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import evstore

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import keras_file_model as km  # noqa: E402


def _fresh_process(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "keras_file_model.py"), *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _assert_same(got, want, what):
    assert sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def test_keras_file_loads_in_a_fresh_process_equal_to_the_trained_model_and_trains_on_identically(tmp_path):
    model = km.make_model()
    km.train(model, 0, 6)
    path = tmp_path / "m.keras"
    model.save(path)
    saved = km.dump(model)
    assert len(saved["user/filtered_keys"]) > 0 and saved["user/stats"][1] > 0   # filtered and admitted keys
    _fresh_process(path, tmp_path / "out.npz", 6, 10)
    km.train(model, 6, 10)
    trained = km.dump(model)
    out = np.load(tmp_path / "out.npz")
    _assert_same({k[len("loaded:"):]: out[k] for k in out.files if k.startswith("loaded:")}, saved, "loaded")
    _assert_same({k[len("trained:"):]: out[k] for k in out.files if k.startswith("trained:")}, trained,
                 "trained on after the load")
    assert not np.array_equal(trained["user/keys"], saved["user/keys"])   # training went on: new keys, evictions


def test_training_on_after_a_keras_load_starts_new_keys_slots_at_their_initial_value(tmp_path):
    # Adagrad's accumulator starts at 0.3: keys the first batch after the load
    # admits (before the optimizer's first update) start there as they would have.
    model = km.make_model(evstore.optimizers.Adagrad(0.05, initial_accumulator_value=0.3))
    km.train(model, 0, 3)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    km.train(model, 3, 5)
    km.train(loaded, 3, 5)
    _assert_same(km.dump(loaded), km.dump(model), "trained on after the load")


def test_saving_a_keras_file_changes_nothing_the_next_delta_checkpoint_needs(tmp_path):
    model = km.make_model()
    km.train(model, 0, 3)
    evs = [model.get_layer(n).ev for n in km.TABLES]
    before = [ev.stats() for ev in evs]
    model.save(tmp_path / "m.keras")
    after = [ev.stats() for ev in evs]
    for b, a in zip(before, after):
        assert (a["dirty"], a["deleted"], a["admitted"], a["filtered"]) == \
            (b["dirty"], b["deleted"], b["admitted"], b["filtered"]) and b["dirty"] > 0


def test_loading_a_corrupt_table_raises_and_keeps_the_live_table(tmp_path):
    model = km.make_model()
    km.train(model, 0, 3)
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    import h5py
    with h5py.File(path, "r+") as f:
        names = []
        f.visititems(lambda n, obj: names.append(n) if n.endswith("table0_file1") else None)
        data = f[names[0]][...]
        data[len(data) // 2] ^= 0xFF
        f[names[0]][...] = data
    live = km.dump(model)
    with pytest.raises(ValueError, match="corrupt"):
        model.load_weights(path)
    _assert_same(km.dump(model), live, "after the refused load")


def test_clone_model_keeps_filter_eviction_policies_and_initializer():
    model = km.make_model()
    clone = keras.models.clone_model(model)
    for name in km.TABLES:
        a, b = model.get_layer(name), clone.get_layer(name)
        assert b.ev is not a.ev
        assert b.ev.filter == a.ev.filter and b.ev.filter is not None
        assert b.ev.evict_policies == a.ev.evict_policies
        assert b.get_config() == a.get_config()
    assert clone.get_layer("user").ev.evict_policies == (evstore.GlobalStepEvict(3),)
    assert clone.get_layer("tag").ev.filter == evstore.BloomFilter(2, capacity=1000)
    np.testing.assert_array_equal(clone.get_layer("tag").ev.default_value, [0.5] * 4)
    assert type(clone.optimizer) is evstore.optimizers.Adam     # Keras clones the compile config too


@pytest.mark.parametrize("policy", [evstore.CounterFilter(3), evstore.BloomFilter(4, capacity=500, fp_rate=0.02),
                                    evstore.GlobalStepEvict(7), evstore.L2WeightEvict(0.25)], ids=repr)
def test_every_filter_and_eviction_policy_round_trips_through_keras_serialization(policy):
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(policy)))
    back = keras.saving.deserialize_keras_object(config)     # no custom_objects
    assert type(back) is type(policy) and back.get_config() == policy.get_config()


OPTIMIZERS = [
    evstore.optimizers.SGD(0.2, momentum=0.5, nesterov=True, clipnorm=1.5),
    evstore.optimizers.Adagrad(0.3, initial_accumulator_value=0.2, epsilon=1e-6),
    evstore.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-5),
    evstore.optimizers.AdamW(0.01, weight_decay=0.01, beta_1=0.85),
    evstore.optimizers.Ftrl(0.1, learning_rate_power=-0.4, initial_accumulator_value=0.2,
                            l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                            l2_shrinkage_regularization_strength=0.03, beta=0.1),
    evstore.optimizers.GroupAdam(0.02, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                 l21_regularization_strength=0.03),
    evstore.optimizers.GroupAdagrad(0.02, initial_accumulator_value=0.3, l21_regularization_strength=0.04),
    evstore.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.9)),
    evstore.optimizers.SGD(tf.Variable(0.3)),     # read at every step; its config holds the value
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_every_optimizer_round_trips_through_keras_serialization(optimizer):
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(optimizer)))
    assert config["registered_name"] == f"evstore>{type(optimizer).__name__}"
    back = keras.saving.deserialize_keras_object(config)     # no custom_objects
    assert type(back) is type(optimizer)
    assert back.get_config() == optimizer.get_config()


def test_layer_config_holds_every_argument_and_rebuilds_the_same_layer():
    layer = evstore.keras.Embedding(
        6, key_dtype="int32", embeddings_initializer=tf.constant_initializer(0.25), filter=evstore.CounterFilter(4),
        default_value=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], initializer_bank_size=32,
        evict=[evstore.GlobalStepEvict(10), evstore.L2WeightEvict(0.5)], shards=2, name="every_arg")
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(layer)))
    back = keras.saving.deserialize_keras_object(config)     # no custom_objects
    assert back.get_config() == layer.get_config()
    assert back.ev.filter == evstore.CounterFilter(4) and back.ev.num_shards == 2
    assert back.ev.evict_policies == (evstore.GlobalStepEvict(10), evstore.L2WeightEvict(0.5))
    np.testing.assert_array_equal(back.ev.shards[0].initializer_bank(), np.full([32, 6], 0.25, np.float32))
    np.testing.assert_array_equal(back.ev.shards[0].default_value, np.arange(6, dtype=np.float32))


def test_model_export_refuses_pointing_at_export_serving_model(tmp_path):
    model = km.make_model()
    with pytest.raises(ValueError, match=r"serving_loader\.export_serving_model\(model, export_dir\)") as e:
        model.export(tmp_path / "exported")
    assert "['user', 'tag']" in str(e.value)
    assert not (tmp_path / "exported").exists()


def test_model_export_of_a_model_without_evstore_layers_is_keras_own(tmp_path):
    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.export(tmp_path / "plain", verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "plain"))
    x = np.ones([1, 3], np.float32)
    np.testing.assert_allclose(loaded.serve(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_keras_file_of_a_sharded_layer_restores_every_shard(tmp_path):
    ids = keras.Input(shape=(2,), dtype="int64")
    emb = evstore.keras.Embedding(4, shards=3, filter=evstore.CounterFilter(2), name="sharded")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    model.compile(optimizer=evstore.optimizers.Adagrad(0.1), loss="mse")
    x = np.random.default_rng(3).integers(0, 100, size=(128, 2)).astype(np.int64)
    model.fit(x, np.ones([128, 1], np.float32), batch_size=32, verbose=0)
    model.save(tmp_path / "s.keras")
    loaded = keras.models.load_model(tmp_path / "s.keras")
    for a, b in zip(emb.ev.shards, loaded.get_layer("sharded").ev.shards):
        ea, eb = a.export(), b.export()
        assert len(ea["keys"]) > 0
        oa, ob = np.argsort(ea["keys"].numpy()), np.argsort(eb["keys"].numpy())
        for field in ("keys", "values", "versions", "freqs"):
            np.testing.assert_array_equal(eb[field].numpy()[ob], ea[field].numpy()[oa], err_msg=field)
        np.testing.assert_array_equal(eb["slots"]["accumulator"].numpy()[ob], ea["slots"]["accumulator"].numpy()[oa])
        fa, fb = np.argsort(ea["filtered_keys"].numpy()), np.argsort(eb["filtered_keys"].numpy())
        for field in ("filtered_keys", "filtered_freqs"):
            np.testing.assert_array_equal(eb[field].numpy()[fb], ea[field].numpy()[fa], err_msg=field)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_loading_into_a_layer_of_another_shape_names_both(tmp_path):
    def model_of(dim):
        ids = keras.Input(shape=(1,), dtype="int64")
        m = keras.Model(ids, evstore.keras.Embedding(dim, name="t")(ids))
        m(np.array([[1]], np.int64), training=True)
        return m
    model_of(4).save_weights(tmp_path / "w.weights.h5")
    other = model_of(6)
    with pytest.raises(ValueError, match="dim=4 .* dim=6"):
        other.load_weights(tmp_path / "w.weights.h5")
