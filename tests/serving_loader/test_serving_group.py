"""Serving a model whose lookups are grouped (`evstore.embedding_lookup_group`,
as the cluster job's model does): the export substitutes the grouped lookup
like any other (evstore/substitution.py), so the SavedModel holds no evstore
op, and ServingModel applies checkpoints to it."""
import numpy as np
import tensorflow as tf

import checkpoint
import evstore
import serving_loader

USERS = np.array([[1, 2], [3, 99], [5, 1]], np.int64)
ITEMS = np.array([[10], [11], [77]], np.int64)   # 99 and 77 are never inserted: they read the default


class GroupedModel(tf.Module):
    """Two tables, one of them sharded, looked up in one grouped call."""

    def __init__(self):
        super().__init__()
        self.user = evstore.EmbeddingVariable("user", 4, default_value=0.5)
        self.item = evstore.EmbeddingVariable("item", 4, shards=2)
        self.w = tf.Variable(np.linspace(-1, 1, 4).astype(np.float32)[:, None])

    def __call__(self, x, training=False):
        users, items = x
        u, i = evstore.embedding_lookup_group([self.user, self.item], [users, items], training=training)
        return tf.matmul(tf.reduce_sum(u, 1) * tf.reduce_sum(i, 1), self.w)


SIGNATURE = [tf.TensorSpec([None, 2], tf.int64, name="users"), tf.TensorSpec([None, 1], tf.int64, name="items")]


def _model():
    model = GroupedModel()
    model([tf.constant([[1, 2], [3, 5]], tf.int64), tf.constant([[10], [11]], tf.int64)], training=True)
    return model


def test_a_model_built_on_grouped_lookups_exports_and_serves(tmp_path):
    model = _model()
    export = str(tmp_path / "export")
    mapping = serving_loader.export_serving_model(model, export, input_signature=SIGNATURE)
    assert set(mapping["evs"]) == {"user", "item"}
    served = tf.saved_model.load(export).signatures["serving_default"](users=tf.constant(USERS),
                                                                      items=tf.constant(ITEMS))["outputs"]
    np.testing.assert_allclose(served.numpy(), model([USERS, ITEMS]).numpy(), rtol=1e-6)


def test_serving_model_applies_checkpoints_to_a_grouped_lookup_export(tmp_path):
    model = _model()
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export, input_signature=SIGNATURE)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    model.user.load(tf.constant([1, 3], tf.int64), tf.fill([2, 4], 2.0))
    model.item.load(tf.constant([10, 11], tf.int64), tf.fill([2, 4], -1.0))
    seq = mgr.save_delta()
    assert sm.poll() == seq
    out, version = sm.predict({"users": USERS, "items": ITEMS})
    assert version == seq
    np.testing.assert_allclose(out["outputs"], model([USERS, ITEMS]).numpy(), rtol=1e-6)
