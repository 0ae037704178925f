"""`evstore serve`'s gRPC port against hostile clients: the stock stub and
raw HTTP/2 (the `h2` library) send what a well-behaved client never does.
Every class of input must get a gRPC status with a bounded message (never
silence, never a logged traceback), cost memory bounded by the request's own
bytes and the server's limits, and leave the server alive and correct: each
test ends with a predict whose answer equals the training model's."""
import re
import socket

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_service_pb2_grpc)

from ckpt_model import probe_inputs
from served import serve_ctr

from serving_loader.native._grpc_frontend import MAX_STATUS_MESSAGE
from serving_loader.tensor_proto import MAX_RANK

IDLE_S = 3            # the server's --grpc_idle_timeout_s here
BATCH_WAIT_US = 300000   # --batch_timeout_micros: a call waits this long at the batcher before it runs
HUGE = 70000          # bytes of a client field echoed in an error (over nghttp2's 64 KiB header block)
PREDICT = "/tensorflow.serving.PredictionService/Predict"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    model, mgr, server = serve_ctr(str(tmp_path_factory.mktemp("hostile")),
                                   extra=("--grpc_idle_timeout_s", str(IDLE_S),
                                          "--batch_timeout_micros", str(BATCH_WAIT_US)))
    try:
        yield model, server
    finally:
        server.stop()


@pytest.fixture
def served(job):
    """The server, checked after the test: alive, correct, no traceback logged."""
    model, server = job
    yield server
    _check_alive_and_correct(model, server)


def _check_alive_and_correct(model, server):
    with server.channel() as channel:
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(_request(), timeout=60)
    users, items = probe_inputs()
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["outputs"]), model.predict([users, items], verbose=0),
                               rtol=1e-6, atol=1e-7)
    server.log.flush()
    with open(server.log.name) as f:
        log = f.read()
    assert "Traceback" not in log, log[-3000:]


def _request(name="ctr"):
    users, items = probe_inputs()
    req = predict_pb2.PredictRequest()
    req.model_spec.name = name
    req.inputs["users"].CopyFrom(tf.make_tensor_proto(users))
    req.inputs["items"].CopyFrom(tf.make_tensor_proto(items))
    return req


def _refused(server, call, request, code):
    """Calls stub method `call` with `request`; asserts status `code` with a
    bounded message and returns the message."""
    with server.channel() as channel:
        stubs = {"Predict": prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict,
                 "GetModelMetadata": prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata,
                 "GetModelStatus": model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus}
        with pytest.raises(grpc.RpcError) as e:
            stubs[call](request, timeout=60)
    assert e.value.code() == code, (e.value.code(), e.value.details()[:300])
    details = e.value.details()
    assert len(details.encode()) <= MAX_STATUS_MESSAGE, len(details)
    return details


def _peak_rss_mb(server):
    with open(f"/proc/{server.proc.pid}/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


# ---- error messages that echo client input ------------------------------------------------
def _long_model_name():
    return "Predict", _request(name="m" * HUGE), grpc.StatusCode.NOT_FOUND


def _long_signature_name():
    req = _request()
    req.model_spec.signature_name = "s" * HUGE
    return "Predict", req, grpc.StatusCode.INVALID_ARGUMENT


def _long_version_label():
    req = _request()
    req.model_spec.version_label = "v" * HUGE
    return "Predict", req, grpc.StatusCode.INVALID_ARGUMENT


def _long_input_name():
    req = _request()
    req.inputs["i" * HUGE].CopyFrom(tf.make_tensor_proto(np.zeros([1], np.float32)))
    return "Predict", req, grpc.StatusCode.INVALID_ARGUMENT


def _long_output_filter():
    req = _request()
    req.output_filter.append("o" * HUGE)
    return "Predict", req, grpc.StatusCode.INVALID_ARGUMENT


def _long_metadata_field():
    req = get_model_metadata_pb2.GetModelMetadataRequest()
    req.model_spec.name = "ctr"
    req.metadata_field.append("f" * HUGE)
    return "GetModelMetadata", req, grpc.StatusCode.INVALID_ARGUMENT


def _long_status_model_name():
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = "\u00e9" * HUGE   # two UTF-8 bytes each: the cut keeps whole characters
    return "GetModelStatus", req, grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("make", [_long_model_name, _long_signature_name, _long_version_label, _long_input_name,
                                  _long_output_filter, _long_metadata_field, _long_status_model_name],
                         ids=lambda f: f.__name__.strip("_"))
def test_an_error_echoing_a_70000_byte_field_is_delivered_cut_to_the_bound(served, make):
    call, req, code = make()
    details = _refused(served, call, req, code)
    assert details.endswith("..."), details[-50:]


def test_an_unknown_method_with_a_long_path_gets_unimplemented(served):
    (response, trailers, _), = served.h2_calls([("/x/" + "p" * 16000, b"", (), 0)])
    assert trailers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]), trailers
    assert len(trailers["grpc-message"]) <= 3 * MAX_STATUS_MESSAGE


def test_an_unknown_compression_with_a_long_name_gets_unimplemented(served):
    message = _request().SerializeToString()
    (_, trailers, _), = served.h2_calls([(PREDICT, message, (("grpc-encoding", "z" * 16000),), 1)])
    assert trailers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]), trailers
    assert len(trailers["grpc-message"]) <= 3 * MAX_STATUS_MESSAGE


# ---- hostile tensors ------------------------------------------------------------------------
def _with_users(mutate):
    req = _request()
    mutate(req.inputs["users"])
    return req


def _dims(t, dims):
    del t.tensor_shape.dim[:]
    for d in dims:
        t.tensor_shape.dim.add().size = d


def _one_value(t, dims):
    t.ClearField("tensor_content")
    t.ClearField("int64_val")
    t.int64_val.append(1)
    _dims(t, dims)


def _strings(t, dims):
    t.Clear()
    t.dtype = tf.string.as_datatype_enum
    t.string_val.append(b"x")
    _dims(t, dims)


HOSTILE_TENSORS = {
    "dtype_enum_9999": lambda t: setattr(t, "dtype", 9999),
    "dtype_enum_minus_1": lambda t: setattr(t, "dtype", -1),
    "tensor_content_of_7_bytes": lambda t: (setattr(t, "tensor_content", b"\1" * 7), _dims(t, [1, 2])),
    "tensor_content_of_15_bytes": lambda t: (setattr(t, "tensor_content", b"\1" * 15), _dims(t, [1, 2])),
    "negative_dims": lambda t: _dims(t, [-8, 2]),
    "rank_65": lambda t: _dims(t, [1] * 65),
    "rank_100": lambda t: _dims(t, [1] * 100),
    "dims_2e40_by_2": lambda t: _dims(t, [2**40, 2]),
    "dims_whose_product_overflows_int64": lambda t: _dims(t, [1, 2**62, 2**62]),
    "rows_over_the_batch_limit": lambda t: _one_value(t, [1001, 2]),
    "one_value_broadcast_to_2e26_by_2": lambda t: _one_value(t, [2**26, 2]),
    "one_value_broadcast_past_the_request_limit": lambda t: _one_value(t, [1000, 2**20]),
}


@pytest.mark.parametrize("mutate", HOSTILE_TENSORS.values(), ids=HOSTILE_TENSORS.keys())
def test_a_hostile_tensor_is_invalid_argument(served, mutate):
    details = _refused(served, "Predict", _with_users(mutate), grpc.StatusCode.INVALID_ARGUMENT)
    assert "users" in details


def test_a_tiny_request_asking_for_a_huge_tensor_allocates_nothing_for_it(served):
    before = _peak_rss_mb(served)
    numbers = _with_users(lambda t: _one_value(t, [2**26, 2]))   # 1 GiB of int64 once expanded
    strings = _request()
    _strings(strings.inputs["users"], [2**23, 3])                  # 192 MiB of references once expanded
    assert len(numbers.SerializeToString()) < 200
    for req in (numbers, strings, numbers, strings):
        _refused(served, "Predict", req, grpc.StatusCode.INVALID_ARGUMENT)
    assert _peak_rss_mb(served) - before < 64   # MB: none of the tensors was expanded


def test_rank_is_checked_against_the_documented_maximum(served):
    details = _refused(served, "Predict", _with_users(lambda t: _dims(t, [1] * (MAX_RANK + 1))),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert str(MAX_RANK) in details


# ---- rapid reset ------------------------------------------------------------------------------
def _batched_requests(server):
    status, text = server.call("GET", "/metrics")
    assert status == 200
    return float(re.search(r"^evstore_serving_batched_requests_total (\S+)$", text, re.M).group(1))


def test_calls_reset_by_their_client_before_the_model_are_not_run(served):
    import h2.config
    import h2.connection
    import h2.errors

    before = _batched_requests(served)
    message = _request().SerializeToString()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    for _ in range(200):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"),
                                (":path", PREDICT), ("content-type", "application/grpc"), ("te", "trailers")])
        conn.send_data(sid, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
        conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    with socket.create_connection(("127.0.0.1", served.grpc_port), timeout=60) as sock:
        sock.sendall(conn.data_to_send())
        # One more call, on its own connection, after them: once it is answered every reset
        # call ahead of it at the batcher has been run or dropped.
        with served.channel() as channel:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(_request(), timeout=60)
    assert _batched_requests(served) - before == 1


# ---- idle connections ----------------------------------------------------------------------
def test_an_idle_connection_is_told_goaway_and_closed(served):
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    events = []
    with socket.create_connection(("127.0.0.1", served.grpc_port), timeout=20 * IDLE_S) as sock:
        sock.sendall(conn.data_to_send())
        while True:
            data = sock.recv(65536)   # a timeout here (socket.timeout) fails the test: never closed
            if not data:
                break
            events += conn.receive_data(data)
            sock.sendall(conn.data_to_send())
    assert any(isinstance(e, h2.events.ConnectionTerminated) and e.error_code == 0 for e in events), events
