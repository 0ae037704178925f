"""A string-keyed model served by a real `evstore serve` process: the export
holds a stock TF DenseHashTable keyed by strings, deltas (deletions included)
apply in place, and REST (plain strings and {"b64": ...}) and gRPC (the TF
Serving stub, DT_STRING tensors) answer exactly as the trainer does."""
import base64
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

import checkpoint
import evstore
import serving_loader
from serving_loader.export import STRING_SENTINELS
from served import Server

# Any byte string: empty, non-UTF-8, NUL inside, and the served table's own sentinel key.
KEYS = [b"sku:1", b"sku:2", b"", b"\xff\xfe", b"a\x00b", "caf\u00e9".encode(), STRING_SENTINELS[0], b"gone"]
PROBE = np.array([[KEYS[i], KEYS[(i + 3) % len(KEYS)]] for i in range(len(KEYS))] + [[b"never", b"seen"]], object)


def _model():
    ids = keras.Input(shape=(2,), dtype="string", name="skus")
    emb = evstore.keras.Embedding(4, key_dtype="string", name="sku",
                                  embeddings_initializer=tf.random_normal_initializer(0, 0.5, seed=3))
    out = keras.layers.Dense(1, name="out", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
        keras.layers.Flatten()(emb(ids)))
    model = keras.Model(ids, out)
    model.compile(optimizer=evstore.optimizers.Adagrad(0.2), loss="mse")
    return model, emb.ev


def _train(model, seed):
    rng = np.random.default_rng(seed)
    x = np.array(KEYS, object)[rng.integers(0, len(KEYS), size=(32, 2))]
    model.train_on_batch(tf.constant(x), rng.normal(size=(32, 1)).astype(np.float32))


def _want(model):
    return model(tf.constant(PROBE), training=False).numpy()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("strings"))
    model, ev = _model()
    _train(model, 1)
    serving_loader.export_serving_model(model, os.path.join(tmp, "export"))
    mgr = checkpoint.CheckpointManager(os.path.join(tmp, "ckpt"), model)
    mgr.save_full()
    server = Server(tmp, os.path.join(tmp, "export"), os.path.join(tmp, "ckpt"), name="sku")
    channel = server.channel()
    try:
        server.wait_version(mgr.last_committed.seq)
        yield model, ev, mgr, server, prediction_service_pb2_grpc.PredictionServiceStub(channel)
    finally:
        channel.close()
        server.stop()


def _b64(a):
    return [[{"b64": base64.b64encode(k).decode()} for k in row] for row in a]


def test_the_export_is_a_stock_tf_table_keyed_by_strings(served):
    model, _, _, server, _ = served
    loaded = tf.saved_model.load(os.path.join(os.path.dirname(server.log.name), "export"))
    keys, _ = tf.raw_ops.LookupTableExportV2(table_handle=loaded.tables[0].resource_handle, Tkeys=tf.string,
                                             Tvalues=tf.float32)
    trained = set(KEYS) - {STRING_SENTINELS[0]}    # the sentinel's row lives beside the table
    assert trained <= set(keys.numpy().reshape(-1).tolist())   # every bucket, empty ones too
    got = loaded.signatures["serving_default"](skus=tf.constant(PROBE))["outputs"].numpy()
    assert got.shape == (len(PROBE), 1)


def test_rest_predict_with_b64_string_ids_equals_the_trainer(served):
    model, _, _, server, _ = served
    status, body = server.predict({"instances": [{"skus": r} for r in _b64(PROBE)]})
    assert status == 200, body
    np.testing.assert_allclose(body["predictions"], _want(model), rtol=1e-6, atol=1e-7)


def test_rest_predict_with_plain_json_strings_equals_the_trainer(served):
    model, _, _, server, _ = served
    text = [r for r in PROBE if all(_utf8(k) for k in r)]
    status, body = server.predict({"inputs": {"skus": [[k.decode() for k in r] for r in text]}})
    assert status == 200, body
    want = model(tf.constant(np.array(text, object)), training=False).numpy()
    np.testing.assert_allclose(body["outputs"], want, rtol=1e-6, atol=1e-7)


def _utf8(b):
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def _grpc(stub):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "sku"
    req.inputs["skus"].CopyFrom(tf.make_tensor_proto(PROBE.tolist(), dtype=tf.string))
    return tf.make_ndarray(stub.Predict(req, timeout=60).outputs["outputs"])


def test_grpc_predict_with_string_tensors_equals_the_trainer(served):
    model, _, _, _, stub = served
    np.testing.assert_allclose(_grpc(stub), _want(model), rtol=1e-6, atol=1e-7)


def test_a_delta_with_deletions_applies_in_place_and_serves_as_the_trainer(served):
    model, ev, mgr, server, stub = served
    _train(model, 2)
    ev.remove([b"gone", b""])
    mgr.save_delta()
    server.wait_version(mgr.last_committed.seq)
    want = _want(model)
    np.testing.assert_allclose(_grpc(stub), want, rtol=1e-6, atol=1e-7)
    status, body = server.predict({"instances": [{"skus": r} for r in _b64(PROBE)]})
    np.testing.assert_allclose(body["predictions"], want, rtol=1e-6, atol=1e-7)
