"""Serving a model whose tables are sharded EVs: the export is the same stock
TensorFlow export as an unsharded one (one table per EV), and ServingModel
applies the per-shard parts of each checkpoint to that one table."""
import json
import os

import numpy as np
import tensorflow as tf

import checkpoint
import serving_loader

from ckpt_model import make_model, probe_inputs, train  # tests/checkpoint, registered by tests/conftest.py


def _want(model):
    return model.predict(list(probe_inputs()), verbose=0)


def _served(export):
    m = tf.saved_model.load(export)
    users, items = probe_inputs()
    return m.signatures["serving_default"](users=tf.constant(users), items=tf.constant(items))["outputs"].numpy()


def test_export_of_a_sharded_ev_equals_the_unsharded_export(tmp_path):
    plain, sharded = make_model(), make_model(user_shards=3)
    train(plain, 0, 4)
    train(sharded, 0, 4)
    a, b = str(tmp_path / "plain"), str(tmp_path / "sharded")
    map_a = serving_loader.export_serving_model(plain, a)
    map_b = serving_loader.export_serving_model(sharded, b)
    assert map_a == map_b          # same tables, names, dims, sentinels, inputs
    np.testing.assert_allclose(_served(b), _served(a), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_served(b), _want(sharded), rtol=1e-6, atol=1e-7)
    with open(os.path.join(b, serving_loader.export.MAP_FILE)) as f:
        assert set(json.load(f)["evs"]) == {"user", "item"}


def test_serving_model_applies_the_parts_of_sharded_checkpoints(tmp_path):
    model = make_model(user_shards=2)
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    for i in range(2):
        train(model, 3 + i, 4 + i)
        seq = mgr.save_delta()
        assert sm.poll() == seq
        np.testing.assert_array_equal(sm.predict(dict(zip(("users", "items"), probe_inputs())))[0]["outputs"],
                                      _want(model))
    model.get_layer("user").ev.remove(tf.constant(np.arange(1, 9), tf.int64))
    seq = mgr.save_delta()
    assert sm.poll() == seq
    np.testing.assert_array_equal(sm.predict(dict(zip(("users", "items"), probe_inputs())))[0]["outputs"],
                                  _want(model))
