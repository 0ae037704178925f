"""`evstore serve`'s gRPC API, driven as a TF Serving client drives it: the
`tensorflow-serving-api` package's PredictionServiceStub and ModelServiceStub
against a real server process."""

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc,
                                     regression_pb2)

from ckpt_model import probe_inputs, train
from served import serve_ctr


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    model, mgr, server = serve_ctr(str(tmp_path_factory.mktemp("grpc")))
    channel = server.channel()
    try:
        yield model, mgr, server, prediction_service_pb2_grpc.PredictionServiceStub(channel), channel
    finally:
        channel.close()
        server.stop()


def _request(name="ctr", **kw):
    users, items = probe_inputs()
    req = predict_pb2.PredictRequest()
    req.model_spec.name = name
    for k, v in kw.items():
        setattr(req.model_spec, k, v)
    req.inputs["users"].CopyFrom(tf.make_tensor_proto(users))
    req.inputs["items"].CopyFrom(tf.make_tensor_proto(items))
    return req


def _want(model):
    return model.predict(list(probe_inputs()), verbose=0)


def test_predict_with_the_stub_equals_the_training_model(job):
    model, mgr, _, stub, _ = job
    answer = stub.Predict(_request(), timeout=60)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), _want(model), rtol=1e-6, atol=1e-7)
    assert answer.model_spec.name == "ctr"
    assert answer.model_spec.signature_name == "serving_default"
    assert answer.model_spec.version.value == mgr.last_committed.seq


def test_predict_of_a_served_version_and_output_filter(job):
    model, mgr, _, stub, _ = job
    req = _request()
    req.model_spec.version.value = mgr.last_committed.seq
    req.output_filter.append("outputs")
    answer = stub.Predict(req, timeout=60)
    assert list(answer.outputs) == ["outputs"]
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_predict_of_an_unknown_model_is_not_found(job):
    _, _, _, stub, _ = job
    with pytest.raises(grpc.RpcError) as e:
        stub.Predict(_request(name="other"), timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details() == "Servable not found for request: Latest(other) (serving 'ctr')"


def test_predict_of_a_version_not_served_is_not_found(job):
    _, _, _, stub, _ = job
    req = _request()
    req.model_spec.version.value = 999999
    with pytest.raises(grpc.RpcError) as e:
        stub.Predict(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_predict_with_a_wrong_dtype_is_invalid_argument(job):
    _, _, _, stub, _ = job
    req = _request()
    req.inputs["items"].CopyFrom(tf.make_tensor_proto(np.array([[1.5]], np.float32)))
    with pytest.raises(grpc.RpcError) as e:
        stub.Predict(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items" in e.value.details()


def test_predict_with_a_missing_input_is_invalid_argument(job):
    _, _, _, stub, _ = job
    req = _request()
    del req.inputs["items"]
    with pytest.raises(grpc.RpcError) as e:
        stub.Predict(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Missing but required: {items}" in e.value.details()


def test_predict_of_an_unknown_signature_is_invalid_argument(job):
    _, _, _, stub, _ = job
    with pytest.raises(grpc.RpcError) as e:
        stub.Predict(_request(signature_name="train"), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_classify_answers_scores_per_example(job):
    model, _, _, stub, _ = job
    users, items = probe_inputs()
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "ctr"
    req.model_spec.signature_name = "classification"
    for u, i in zip(users, items):
        ex = req.input.example_list.examples.add()
        ex.features.feature["users"].int64_list.value.extend(u.tolist())
        ex.features.feature["items"].int64_list.value.append(int(i[0]))
    answer = stub.Classify(req, timeout=60)
    scores = [c.classes[0].score for c in answer.result.classifications]
    np.testing.assert_allclose(scores, _want(model).ravel(), rtol=1e-6)


def test_regress_answers_one_value_per_example(job):
    model, _, _, stub, _ = job
    users, items = probe_inputs()
    req = regression_pb2.RegressionRequest()
    req.model_spec.name = "ctr"
    req.model_spec.signature_name = "regression"
    ctx = req.input.example_list_with_context
    ctx.context.features.feature["items"].int64_list.value.append(int(items[0][0]))
    for u in users[:2]:
        ctx.examples.add().features.feature["users"].int64_list.value.extend(u.tolist())
    answer = stub.Regress(req, timeout=60)
    want = model.predict([users[:2], np.repeat(items[:1], 2, axis=0)], verbose=0).ravel()
    np.testing.assert_allclose([r.value for r in answer.result.regressions], want, rtol=1e-6)


def test_classify_on_the_predict_signature_is_invalid_argument(job):
    _, _, _, stub, _ = job
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "ctr"
    req.input.example_list.examples.add().features.feature["items"].int64_list.value.append(1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Classify(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Expected classification signature method_name" in e.value.details()


def test_get_model_metadata_packs_every_signature(job):
    _, mgr, _, stub, _ = job
    req = get_model_metadata_pb2.GetModelMetadataRequest()
    req.model_spec.name = "ctr"
    req.metadata_field.append("signature_def")
    answer = stub.GetModelMetadata(req, timeout=60)
    sigs = get_model_metadata_pb2.SignatureDefMap()
    assert answer.metadata["signature_def"].Unpack(sigs)
    assert set(sigs.signature_def) == {"serving_default", "classification", "regression", "__saved_model_init_op"}
    assert sigs.signature_def["serving_default"].inputs["users"].dtype == tf.int64.as_datatype_enum
    assert answer.model_spec.version.value >= mgr.last_committed.seq


def test_get_model_metadata_without_fields_is_invalid_argument(job):
    _, _, _, stub, _ = job
    req = get_model_metadata_pb2.GetModelMetadataRequest()
    req.model_spec.name = "ctr"
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelMetadata(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_model_status_lists_the_served_version(job):
    _, mgr, server, _, channel = job
    server.wait_version(mgr.last_committed.seq)
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = "ctr"
    answer = stub.GetModelStatus(req, timeout=60)
    first = answer.model_version_status[0]
    assert first.version == mgr.last_committed.seq
    assert first.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    assert first.status.error_code == 0


def test_get_model_status_of_an_unknown_model_is_not_found(job):
    _, _, _, _, channel = job
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = "other"
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelStatus(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_new_delta_is_served_over_grpc(job):
    model, mgr, server, stub, _ = job
    train(model, 3, 6)
    seq = mgr.save_delta()
    server.wait_version(seq)
    answer = stub.Predict(_request(), timeout=60)
    assert answer.model_spec.version.value == seq
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


# ---- the transport (serving_loader/native/grpc_frontend.cc) ------------------------------
def test_an_unknown_method_is_unimplemented(job):
    _, _, _, _, channel = job
    call = channel.unary_unary("/tensorflow.serving.PredictionService/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as e:
        call(b"", timeout=60)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "NoSuchMethod" in e.value.details()


def test_a_request_message_that_does_not_parse_is_internal(job):
    _, _, _, _, channel = job
    call = channel.unary_unary("/tensorflow.serving.PredictionService/Predict")
    with pytest.raises(grpc.RpcError) as e:
        call(b"\x0a\xff\x01", timeout=60)   # field 1 says 255 bytes follow; one does
    assert e.value.code() == grpc.StatusCode.INTERNAL


def test_calls_their_clients_abandon_leave_the_server_serving(job):
    model, _, _, stub, _ = job
    futures = [stub.Predict.future(_request(), timeout=60) for _ in range(50)]
    for f in futures:
        f.cancel()   # RST_STREAM for every call still in flight; their answers are dropped
    assert any(f.cancelled() for f in futures)
    answer = stub.Predict(_request(), timeout=60)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_concurrent_calls_on_one_channel_each_get_their_own_answer(job):
    model, _, _, stub, _ = job
    users, items = probe_inputs()
    futures = []
    for i in range(len(users)):
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "ctr"
        req.inputs["users"].CopyFrom(tf.make_tensor_proto(users[i:i + 1]))
        req.inputs["items"].CopyFrom(tf.make_tensor_proto(items[i:i + 1]))
        futures.append(stub.Predict.future(req, timeout=60))
    got = np.concatenate([tf.make_ndarray(f.result().outputs["outputs"]) for f in futures])
    np.testing.assert_allclose(got, _want(model), rtol=1e-5, atol=1e-6)


def test_a_request_over_the_size_cap_is_resource_exhausted(tmp_path):
    _, _, small = serve_ctr(str(tmp_path), max_body=2048)
    try:
        with small.channel() as channel:
            req = _request()
            req.inputs["pad"].CopyFrom(tf.make_tensor_proto(np.zeros(4096, np.float32)))
            with pytest.raises(grpc.RpcError) as e:
                prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(_request(), timeout=60)
            assert "outputs" in answer.outputs
    finally:
        small.stop()


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate], ids=["gzip", "deflate"])
def test_a_compressed_request_is_inflated_and_answered(job, compression):
    model, _, server, _, _ = job
    users, items = (np.tile(a, (100, 1)) for a in probe_inputs())   # repetitive: the client does compress it
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "ctr"
    req.inputs["users"].CopyFrom(tf.make_tensor_proto(users))
    req.inputs["items"].CopyFrom(tf.make_tensor_proto(items))
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", compression=compression) as channel:
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(req, timeout=60)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), np.tile(_want(model), (100, 1)),
                               rtol=1e-5, atol=1e-6)


def test_a_compressed_request_over_the_size_cap_once_inflated_is_resource_exhausted(tmp_path):
    _, _, small = serve_ctr(str(tmp_path), max_body=2048)
    try:
        req = _request()
        req.inputs["pad"].CopyFrom(tf.make_tensor_proto(np.zeros(4096, np.float32)))   # 16 KB, ~100 B gzipped
        with grpc.insecure_channel(f"127.0.0.1:{small.grpc_port}", compression=grpc.Compression.Gzip) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.Predict(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "decompressed" in e.value.details()
            assert "outputs" in stub.Predict(_request(), timeout=60).outputs
    finally:
        small.stop()


def test_a_request_compressed_with_an_encoding_the_server_lacks_is_unimplemented(job):
    _, _, server, _, _ = job
    response, trailers, _ = server.h2_call("/tensorflow.serving.PredictionService/Predict",
                                           _request().SerializeToString(), [("grpc-encoding", "snappy")], flag=1)
    assert trailers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
    assert "snappy" in trailers["grpc-message"]
    assert response["grpc-accept-encoding"] == "identity,deflate,gzip"   # what it reads instead


def test_a_call_whose_grpc_timeout_has_passed_is_deadline_exceeded_without_running(job):
    _, _, server, _, _ = job

    def batched():
        status, text = server.call("GET", "/metrics")
        return [ln for ln in text.splitlines() if ln.startswith("evstore_serving_batched_requests_total")]

    before = batched()
    assert before
    _, trailers, body = server.h2_call("/tensorflow.serving.PredictionService/Predict",
                                       _request().SerializeToString(), [("grpc-timeout", "1n")])
    assert trailers["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]) and body == b""
    assert batched() == before   # the model was not called for it
    status, text = server.call("GET", "/metrics")
    assert 'evstore_serving_grpc_calls_total{code="DEADLINE_EXCEEDED",method="Predict"} 1.0' in text


def test_a_connection_buffering_over_four_max_messages_of_unfinished_requests_is_refused_the_excess(tmp_path):
    _, _, small = serve_ctr(str(tmp_path), max_body=4096)   # 4 x (4,096 + 5) bytes per connection
    try:
        # Six requests, each under the message cap, sent whole but not ended: all held at once, over the
        # connection's budget.
        unfinished = [("/tensorflow.serving.PredictionService/NoSuchMethod", b"\0" * 3500, (), 0)] * 6
        codes = [int(trailers["grpc-status"]) for _, trailers, _ in small.h2_calls(unfinished)]
        # The first four fit (and reach the dispatcher: unknown method); the two that cross are refused.
        assert codes == [grpc.StatusCode.UNIMPLEMENTED.value[0]] * 4 + [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * 2
        with small.channel() as channel:   # the server goes on serving
            assert "outputs" in prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                _request(), timeout=60).outputs
    finally:
        small.stop()


def test_sigterm_with_calls_in_flight_answers_each_and_exits_0(tmp_path):
    import signal

    _, _, server = serve_ctr(str(tmp_path))
    channel = server.channel()
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    try:
        stub.Predict(_request(), timeout=60)   # connected and warm
        futures = [stub.Predict.future(_request(), timeout=60) for _ in range(200)]
        server.proc.send_signal(signal.SIGTERM)
        for f in futures:   # every call ends: answered, or refused as the server goes (never hangs)
            try:
                assert "outputs" in f.result().outputs
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
        assert server.proc.wait(60) == 0
    finally:
        channel.close()
        server.stop()


def test_messages_larger_than_http2_windows_arrive_whole_both_ways(tmp_path):
    """A 2 MB request (over the server's 1 MiB stream window) and a ~400 KB answer (over a
    client's initial 64 KiB one) are split into many DATA frames under flow control."""
    model, _, big = serve_ctr(str(tmp_path), extra=["--max_batch_size", "200000"])
    try:
        users, items = (np.tile(a, (12500, 1)) for a in probe_inputs())   # 100,000 rows
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "ctr"
        req.inputs["users"].CopyFrom(tf.make_tensor_proto(users))
        req.inputs["items"].CopyFrom(tf.make_tensor_proto(items))
        assert req.ByteSize() > 2_000_000
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{big.grpc_port}", options=options) as channel:
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(req, timeout=120)
        got = tf.make_ndarray(answer.outputs["outputs"])
        assert got.shape[0] == 100_000
        np.testing.assert_allclose(got, np.tile(_want(model), (12500, 1)), rtol=1e-5, atol=1e-6)
    finally:
        big.stop()


def test_grpc_calls_are_counted_by_method_and_code_in_metrics(job):
    _, _, server, stub, channel = job
    stub.Predict(_request(), timeout=60)
    with pytest.raises(grpc.RpcError):
        stub.Predict(_request(name="other"), timeout=60)
    with pytest.raises(grpc.RpcError):
        channel.unary_unary("/tensorflow.serving.PredictionService/NoSuchMethod")(b"", timeout=60)
    status, text = server.call("GET", "/metrics")
    assert status == 200
    counts = {}
    for line in text.splitlines():
        if line.startswith("evstore_serving_grpc_calls_total{"):
            labels, value = line[len("evstore_serving_grpc_calls_total"):].rsplit(" ", 1)
            counts[labels] = float(value)
    assert counts['{code="OK",method="Predict"}'] >= 1
    assert counts['{code="NOT_FOUND",method="Predict"}'] >= 1
    assert counts['{code="UNIMPLEMENTED",method="unknown"}'] >= 1
