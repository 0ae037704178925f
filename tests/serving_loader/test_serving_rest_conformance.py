"""TF Serving's REST API, behaviour for behaviour (api_rest.md, its HTTP
handler and json_tensor tests), against a real `evstore serve` process over
real sockets: one test per documented behaviour."""
import base64
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import serving_loader
from ckpt_model import probe_inputs, train
from served import Server, serve_ctr


@pytest.fixture(scope="module")
def ctr(tmp_path_factory):
    """The test CTR model exported with TF Serving's classification and
    regression signatures, a full checkpoint, and a server on them."""
    model, mgr, server = serve_ctr(str(tmp_path_factory.mktemp("conformance")))
    try:
        yield model, mgr, server
    finally:
        server.stop()


class Strings(tf.Module):
    """A model with string inputs and a `*_bytes` output (no EVs)."""

    def __call__(self, x):
        text, scale = x
        return {"echo_bytes": text, "length": tf.strings.length(text), "scaled": scale * 1.5}


@pytest.fixture(scope="module")
def strings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strings")
    export = str(tmp / "export")
    serving_loader.export_serving_model(Strings(), export, input_signature=[
        tf.TensorSpec([None], tf.string, name="text"), tf.TensorSpec([None, 2], tf.float32, name="scale")])
    server = Server(str(tmp), export, name="strings")
    try:
        yield server
    finally:
        server.stop()


def _columns():
    users, items = probe_inputs()
    return {"users": users.tolist(), "items": items.tolist()}


def _want(model):
    users, items = probe_inputs()
    return model.predict([users, items], verbose=0)


def _is_error(body):
    return isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str) and body["error"]


# ---- signature_name and request fields ----------------------------------------------------
def test_empty_signature_name_means_the_default_signature(ctr):
    model, _, server = ctr
    status, body = server.predict({"signature_name": "", "inputs": _columns()})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_unknown_top_level_fields_are_ignored(ctr):
    model, _, server = ctr
    status, body = server.predict({"inputs": _columns(), "batch": 1, "options": {"x": 1}})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_unknown_signature_name_is_400(ctr):
    _, _, server = ctr
    status, body = server.predict({"signature_name": "train", "inputs": _columns()})
    assert status == 400 and body == {"error": 'Serving signature name: "train" not found in signature def'}


def test_non_string_signature_name_is_400(ctr):
    _, _, server = ctr
    status, body = server.predict({"signature_name": 1, "inputs": _columns()})
    assert status == 400 and "'signature_name' key must be a string value" in body["error"]


# ---- paths, methods and status codes ---------------------------------------------------------
def test_get_v1_models_without_a_name_is_400_naming_the_served_model(ctr):
    """TF Serving answers 400 (its REST API lists no models); the message names the path to ask."""
    _, _, server = ctr
    assert server.call("GET", "/v1/models") == (
        400, {"error": "Missing model name in request. This server serves 'ctr': GET /v1/models/ctr"})


def test_non_numeric_version_is_400_malformed_request(ctr):
    _, _, server = ctr
    status, body = server.call("GET", "/v1/models/ctr/versions/abc")
    assert (status, body) == (400, {"error": "Malformed request: GET /v1/models/ctr/versions/abc"})


def test_version_label_is_400_unrecognized(ctr):
    _, _, server = ctr
    status, body = server.call("GET", "/v1/models/ctr/labels/stable")
    assert (status, body) == (400, {"error": "Unrecognized servable version label: stable"})
    status, body = server.call("POST", "/v1/models/ctr/labels/stable:predict", {"inputs": _columns()})
    assert status == 400 and "stable" in body["error"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/models/ctr:predict"), ("POST", "/v1/models/ctr"),
                                          ("POST", "/v1/models/ctr/metadata"), ("DELETE", "/v1/models/ctr"),
                                          ("PUT", "/v1/models/ctr:predict")])
def test_wrong_method_is_400_malformed_request(ctr, method, path):
    _, _, server = ctr
    status, body = server.call(method, path, b"{}" if method in ("POST", "PUT") else None)
    assert (status, body) == (400, {"error": f"Malformed request: {method} {path}"})


@pytest.mark.parametrize("path", ["/v1/foo", "/v1/models/ctr/", "/v1/models/ctr/versions/1/extra"])
def test_unknown_v1_path_is_400_malformed_request(ctr, path):
    _, _, server = ctr
    assert server.call("GET", path) == (400, {"error": f"Malformed request: GET {path}"})


def test_v1_paths_are_case_insensitive(ctr):
    model, _, server = ctr
    status, body = server.call("POST", "/V1/Models/ctr:Predict", {"inputs": _columns()})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_unknown_model_is_404_servable_not_found_naming_the_served_model(ctr):
    _, _, server = ctr
    status, body = server.predict({"inputs": _columns()}, name="other")
    assert (status, body) == (404, {"error": "Servable not found for request: Latest(other) (serving 'ctr')"})
    status, body = server.call("GET", "/v1/models/other")
    assert (status, body) == (404, {"error": "Could not find any versions of model other (serving 'ctr')"})


# ---- errors below the API: every one a JSON body --------------------------------------------------
def test_malformed_request_line_is_a_json_400(ctr):
    _, _, server = ctr
    status, head, body = server.raw(b"GARBAGE\r\n\r\n")
    assert status == 400 and "application/json" in head and _is_error(json.loads(body))


def test_malformed_content_length_is_a_json_400(ctr):
    _, _, server = ctr
    status, head, body = server.raw(b"POST /v1/models/ctr:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n")
    assert status == 400 and "application/json" in head and "Content-Length" in json.loads(body)["error"]


def test_malformed_header_line_is_a_json_400(ctr):
    _, _, server = ctr
    status, head, body = server.raw(b"GET /v1/models/ctr HTTP/1.1\r\nno colon here\r\n\r\n")
    assert status == 400 and "application/json" in head and _is_error(json.loads(body))


def test_unsupported_http_version_is_a_json_error(ctr):
    _, _, server = ctr
    status, head, body = server.raw(b"GET /v1/models/ctr HTTP/2.0\r\n\r\n")
    assert status == 505 and _is_error(json.loads(body))


def test_empty_body_is_400_document_is_empty(ctr):
    _, _, server = ctr
    assert server.predict(b"") == (400, {"error": "JSON Parse error: The document is empty"})


def test_keep_alive_connection_answers_pipelined_requests_in_order(ctr):
    _, _, server = ctr
    one = json.dumps({"inputs": _columns()}).encode()
    req = (b"POST /v1/models/ctr:predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(one), one)
           + b"GET /v1/models/ctr HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(req)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    answers = got.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"200"]
    assert b'"outputs"' in answers[0] and b"model_version_status" in answers[1]


# ---- b64 strings in and out -----------------------------------------------------------------------
def test_b64_strings_in_row_format(strings):
    raw = [b"\x00\xffbin", b"plain"]
    body = {"instances": [{"text": {"b64": base64.b64encode(r).decode()}, "scale": [1, 2]} for r in raw]}
    status, out = strings.predict(body)
    assert status == 200, out
    assert [p["length"] for p in out["predictions"]] == [len(r) for r in raw]


def test_b64_strings_in_columnar_format(strings):
    status, out = strings.predict({"inputs": {"text": [{"b64": base64.b64encode(b"\x01\x02").decode()}, "abc"],
                                              "scale": [[1, 2], [3, 4]]}})
    assert status == 200, out
    assert out["outputs"]["length"] == [2, 3]


def test_bytes_outputs_are_written_as_b64_objects(strings):
    raw = b"\x00\xff\x10"
    status, out = strings.predict({"inputs": {"text": [{"b64": base64.b64encode(raw).decode()}],
                                              "scale": [[1, 2]]}})
    assert status == 200, out
    assert out["outputs"]["echo_bytes"] == [{"b64": base64.b64encode(raw).decode()}]


def test_invalid_b64_is_400(strings):
    status, out = strings.predict({"inputs": {"text": [{"b64": "not base64!"}], "scale": [[1, 2]]}})
    assert (status, out) == (400, {"error": "Unable to base64 decode"})


def test_float_input_refuses_integers_beyond_float32_precision(strings):
    status, out = strings.predict({"inputs": {"text": ["a"], "scale": [[16777217, 1]]}})
    assert status == 400 and "without loss of precision" in out["error"]


def test_nan_and_infinity_are_read_and_written_bare(strings):
    status, head, body = strings.raw(_post("/v1/models/strings:predict",
                                           b'{"inputs": {"text": ["a"], "scale": [[NaN, -Infinity]]}}'))
    assert status == 200, body
    assert re.search(rb'"scaled":\[\[NaN,-Infinity\]\]', body), body


def _post(path, body):
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (
        path.encode(), len(body), body)


# ---- float text -----------------------------------------------------------------------------------
def test_float32_outputs_are_written_with_at_most_9_significant_digits(ctr):
    model, _, server = ctr
    status, head, body = server.raw(_post("/v1/models/ctr:predict", json.dumps({"inputs": _columns()}).encode()))
    assert status == 200
    numbers = re.findall(rb"-?\d+\.\d+(?:e[-+]?\d+)?", body)
    assert numbers
    for n in numbers:
        digits = n.split(b"e")[0].lstrip(b"-").replace(b".", b"").lstrip(b"0")
        assert len(digits) <= 9, n
    want = _want(model).astype(np.float32).ravel()
    got = np.array([float(n) for n in numbers], np.float32)
    np.testing.assert_array_equal(got, want)       # and they round-trip to the float32 values exactly


# ---- :classify and :regress -----------------------------------------------------------------------
def _examples():
    users, items = probe_inputs()
    return [{"users": u.tolist(), "items": int(i[0])} for u, i in zip(users, items)]


def test_classify_answers_label_score_pairs_per_example(ctr):
    model, _, server = ctr
    status, body = server.call("POST", "/v1/models/ctr:classify",
                               {"signature_name": "classification", "examples": _examples()})
    assert status == 200, body
    want = _want(model).ravel()
    assert [len(r) for r in body["results"]] == [1] * len(want)
    assert all(label == "" for r in body["results"] for label, _ in r)
    np.testing.assert_allclose([r[0][1] for r in body["results"]], want, rtol=1e-6)


def test_classify_context_features_apply_to_every_example(ctr):
    model, _, server = ctr
    users, items = probe_inputs()
    body = {"signature_name": "classification", "context": {"items": int(items[0][0])},
            "examples": [{"users": u.tolist()} for u in users[:2]]}
    status, out = server.call("POST", "/v1/models/ctr:classify", body)
    assert status == 200, out
    want = model.predict([users[:2], np.repeat(items[:1], 2, axis=0)], verbose=0).ravel()
    np.testing.assert_allclose([r[0][1] for r in out["results"]], want, rtol=1e-6)


def test_regress_answers_one_value_per_example(ctr):
    model, _, server = ctr
    status, body = server.call("POST", "/v1/models/ctr:regress",
                               {"signature_name": "regression", "examples": _examples()})
    assert status == 200, body
    np.testing.assert_allclose(body["results"], _want(model).ravel(), rtol=1e-6)


def test_classify_on_a_predict_signature_is_tf_servings_400(ctr):
    _, _, server = ctr
    status, body = server.call("POST", "/v1/models/ctr:classify", {"examples": _examples()})
    assert (status, body) == (400, {"error": "Expected classification signature method_name to be "
                                             "tensorflow/serving/classify. Was: tensorflow/serving/predict"})


def test_regress_on_a_predict_signature_is_tf_servings_400(ctr):
    _, _, server = ctr
    status, body = server.call("POST", "/v1/models/ctr:regress", {"examples": _examples()})
    assert (status, body) == (400, {"error": "Expected regression signature method_name to be "
                                             "tensorflow/serving/regress. Was: tensorflow/serving/predict"})


def test_classify_without_examples_is_400(ctr):
    _, _, server = ctr
    status, body = server.call("POST", "/v1/models/ctr:classify", {"signature_name": "classification"})
    assert status == 400 and "'examples' is expected" in body["error"]


# ---- status and metadata --------------------------------------------------------------------------
def test_status_lists_replaced_versions_as_end(ctr):
    model, mgr, server = ctr
    first = mgr.last_committed.seq
    train(model, 3, 5)
    seq = mgr.save_delta()
    server.wait_version(seq)
    status, body = server.call("GET", "/v1/models/ctr")
    assert status == 200
    listed = [(s["version"], s["state"]) for s in body["model_version_status"]]
    assert listed[0] == (str(seq), "AVAILABLE")
    assert (str(first), "END") in listed
    assert all(s["status"] == {"error_code": "OK", "error_message": ""} for s in body["model_version_status"])


def test_status_of_a_replaced_version_is_end(ctr):
    model, mgr, server = ctr
    old = mgr.last_committed.seq
    train(model, 5, 6)
    server.wait_version(mgr.save_delta())
    status, body = server.call("GET", f"/v1/models/ctr/versions/{old}")
    assert status == 200
    assert [(s["version"], s["state"]) for s in body["model_version_status"]] == [(str(old), "END")]


def test_metadata_has_default_valued_fields_and_every_signature(ctr):
    _, mgr, server = ctr
    status, body = server.call("GET", "/v1/models/ctr/metadata")
    assert status == 200, body
    assert body["model_spec"] == {"name": "ctr", "signature_name": "", "version": str(server.version())}
    sigs = body["metadata"]["signature_def"]["signature_def"]
    assert set(sigs) == {"serving_default", "classification", "regression", "__saved_model_init_op"}
    init = sigs["__saved_model_init_op"]
    assert init["inputs"] == {} and init["method_name"] == "" and init["defaults"] == {}
    assert init["outputs"]["__saved_model_init_op"]["name"] == "NoOp"
    users = sigs["serving_default"]["inputs"]["users"]
    assert users["dtype"] == "DT_INT64"
    assert users["tensor_shape"] == {"dim": [{"size": "-1", "name": ""}, {"size": "2", "name": ""}],
                                     "unknown_rank": False}
    assert sigs["classification"]["method_name"] == "tensorflow/serving/classify"
