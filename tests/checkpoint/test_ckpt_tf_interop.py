"""TensorFlow's own save paths hold EVs too: tf.train.Checkpoint of a Keras
model, tf.compat.v1.train.Saver in graph mode (tensor names `<name>-keys`...),
and a SavedModel of a training model, loaded in a fresh interpreter."""
import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import evstore
from ckpt_model import assert_same_state, make_model, state, train

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tf_train_checkpoint_of_a_keras_model_round_trips_its_evs(tmp_path):
    model = make_model()
    train(model, 0, 4)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ck"))
    names = dict(tf.train.list_variables(path))
    assert any(n.endswith("/.ATTRIBUTES/-keys") for n in names)
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path).assert_existing_objects_matched()
    want, got = state(model), state(fresh)
    assert_same_state({k: v for k, v in got.items() if k.startswith("user:") or k.startswith("item:")},
                      {k: v for k, v in want.items() if k.startswith("user:") or k.startswith("item:")})


def test_v1_saver_writes_design_tensor_names_and_restores(tmp_path):
    prefix = str(tmp_path / "model")
    g = tf.Graph()
    with g.as_default():
        ev = evstore.EmbeddingVariable("user", dim=4, filter=evstore.CounterFilter(2))
        ids = tf.constant([1, 2, 2, 3, 3], tf.int64)
        emb = evstore.embedding_lookup(ev, ids)
        loss = tf.reduce_sum(emb * emb)
        grad = tf.gradients(loss, [ev.handle])[0]
        train_op = evstore.training.sparse_apply_adagrad(ev, grad, learning_rate=0.1, global_step=3)
        saver = tf.compat.v1.train.Saver([ev])
        with tf.compat.v1.Session(graph=g) as s:
            s.run(tf.compat.v1.tables_initializer())
            for _ in range(2):
                s.run(train_op)
            want = s.run(ev._export_tensors())
            saver.save(s, prefix)
    names = dict(tf.train.list_variables(prefix))
    assert {"user-keys", "user-values", "user-versions", "user-freqs", "user-keys_filtered",
            "user-freqs_filtered", "user-slots", "user-slot_names"} <= set(names)
    g2 = tf.Graph()
    with g2.as_default():
        ev2 = evstore.EmbeddingVariable("user", dim=4, filter=evstore.CounterFilter(2))
        saver = tf.compat.v1.train.Saver([ev2])
        with tf.compat.v1.Session(graph=g2) as s:
            s.run(tf.compat.v1.tables_initializer())
            saver.restore(s, prefix)
            got = s.run(ev2._export_tensors())
    order_w, order_g = np.argsort(want["-keys"]), np.argsort(got["-keys"])
    for k in ("-keys", "-values", "-versions", "-freqs", "-slots"):
        np.testing.assert_array_equal(got[k][order_g], want[k][order_w])
    assert got["-slot_names"].tolist() == [b"accumulator"]


SAVED_MODEL_LOADER = r'''
import sys, numpy as np, tensorflow as tf
import evstore  # a training SavedModel needs the op library
m = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
out = m.serve([tf.constant(x["users"]), tf.constant(x["items"])])
np.save(sys.argv[3], out.numpy())
'''


def test_saved_model_of_a_training_model_round_trips_its_evs_in_a_fresh_process(tmp_path):
    model = make_model()
    train(model, 0, 4)
    export = str(tmp_path / "sm")
    # Keras's own export archive, asked for directly: `model.export()` refuses
    # a model holding evstore tables and points at the serving export, while a
    # training SavedModel (evstore's ops inside) is still a deliberate choice.
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", model.call, input_signature=[[tf.TensorSpec([None, 2], tf.int64),
                                                                tf.TensorSpec([None, 1], tf.int32)]])
    archive.write_out(export)
    users = np.array([[1, 2], [3, 4], [999, 5]], np.int64)
    items = np.array([[1], [2], [3]], np.int32)
    want = model.predict([users, items], verbose=0)
    np.savez(tmp_path / "x.npz", users=users, items=items)
    script = tmp_path / "load.py"
    script.write_text(SAVED_MODEL_LOADER)
    p = subprocess.run([sys.executable, str(script), export, str(tmp_path / "x.npz"), str(tmp_path / "y.npy")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-6)
