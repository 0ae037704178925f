"""`evstore serve` as a real process: TF Serving's REST API (row and columnar
predict, status, metadata), hot-applied deltas, refused requests, Prometheus
metrics, and a clean exit on SIGTERM."""
import http.client
import json
import os
import signal
import sys

import numpy as np
import pytest

import checkpoint
import serving_loader

from ckpt_model import make_model, probe_inputs, train  # tests/checkpoint, registered by tests/conftest.py


from served import Server as _Server  # noqa: E402

MAX_BODY = 64 * 1024


def Server(tmp, export, root=None, name="ctr"):
    return _Server(tmp, export, root, name=name, max_body=MAX_BODY)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A trained model, its serving export, a full checkpoint, and a server on them."""
    tmp = tmp_path_factory.mktemp("serve")
    model = make_model()
    train(model, 0, 3)
    export = str(tmp / "export")
    serving_loader.export_serving_model(model, export)
    train(model, 3, 6)     # the served state comes from the checkpoint, not from the export
    mgr = checkpoint.CheckpointManager(str(tmp / "ckpt"), model)
    mgr.save_full()
    server = Server(str(tmp), export, str(tmp / "ckpt"))
    try:
        yield model, mgr, server
    finally:
        server.stop()


def _fresh(job):
    """The model and the server once it serves the newest commit."""
    model, mgr, server = job
    server.wait_version(mgr.last_committed.seq)
    return model, server


def _want(model):
    users, items = probe_inputs()
    return model.predict([users, items], verbose=0)


def _rows():
    users, items = probe_inputs()
    return [{"users": u.tolist(), "items": i.tolist()} for u, i in zip(users, items)]


def _columns():
    users, items = probe_inputs()
    return {"users": users.tolist(), "items": items.tolist()}


def test_predict_instances_equals_the_training_model(job):
    model, server = _fresh(job)
    status, body = server.predict({"instances": _rows()})
    assert status == 200, body
    # one output: each prediction is that output's value for the example (TF Serving unwraps it)
    np.testing.assert_allclose(np.array(body["predictions"]), _want(model), rtol=1e-6, atol=1e-7)


def test_predict_inputs_equals_the_training_model(job):
    model, server = _fresh(job)
    status, body = server.predict({"inputs": _columns()})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_signature_name_of_the_export_is_accepted(job):
    model, server = _fresh(job)
    status, body = server.predict({"signature_name": "serving_default", "inputs": _columns()})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_status_reports_the_committed_sequence(job):
    _, mgr, server = job
    server.wait_version(mgr.last_committed.seq)
    status, body = server.call("GET", "/v1/models/ctr")
    assert status == 200
    assert body == {"model_version_status": [{"version": str(mgr.last_committed.seq), "state": "AVAILABLE",
                                              "status": {"error_code": "OK", "error_message": ""}}]}
    status, body = server.call("GET", f"/v1/models/ctr/versions/{mgr.last_committed.seq}")
    assert status == 200 and body["model_version_status"][0]["version"] == str(mgr.last_committed.seq)


def test_metadata_lists_the_signature_inputs(job):
    _, _, server = job
    status, body = server.call("GET", "/v1/models/ctr/metadata")
    assert status == 200, body
    sig = body["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["users"]["dtype"] == "DT_INT64"
    assert sig["inputs"]["items"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in sig["inputs"]["users"]["tensor_shape"]["dim"]] == ["-1", "2"]
    assert sig["method_name"] == "tensorflow/serving/predict"


def test_a_new_delta_is_served_without_restart(job):
    model, mgr, server = job
    _fresh(job)
    before = _want(model)
    train(model, 6, 12)
    seq = mgr.save_delta()
    server.wait_version(seq)
    status, body = server.predict({"inputs": _columns()})
    assert status == 200, body
    after = _want(model)
    assert not np.allclose(after, before)      # the delta changes what the probe sees
    np.testing.assert_allclose(np.array(body["outputs"]), after, rtol=1e-6, atol=1e-7)


BAD_REQUESTS = {
    "malformed JSON": b'{"inputs": ',
    "not UTF-8": b'{"inputs": "\xff"}',
    "not an object": [1, 2],
    "neither instances nor inputs": {"signature_name": "serving_default"},
    "both instances and inputs": {"instances": [], "inputs": {}},
    "unknown signature": {"signature_name": "train", "inputs": {"users": [[1, 2]], "items": [[1]]}},
    "missing input": {"inputs": {"users": [[1, 2]]}},
    "bare batch for a two-input model": {"inputs": [[1, 2]]},
    "instances without input names": {"instances": [[1, 2]]},
    "empty instances": {"instances": []},
    "instance missing an input": {"instances": [{"users": [1, 2], "items": [1]}, {"users": [1, 2]}]},
    "mixed instance forms": {"instances": [{"users": [1, 2], "items": [1]}, [1, 2]]},
    "wrong rank": {"inputs": {"users": [1, 2], "items": [[1]]}},
    "wrong fixed dimension": {"inputs": {"users": [[1, 2, 3]], "items": [[1]]}},
    "ragged batch": {"inputs": {"users": [[1, 2], [3]], "items": [[1], [2]]}},
    "non-integer ids": {"inputs": {"users": [[1.5, 2]], "items": [[1]]}},
    "float-typed integral ids": {"inputs": {"users": [[1.0, 2.0]], "items": [[1]]}},
    "string ids": {"inputs": {"users": [["1", "2"]], "items": [[1]]}},
    "boolean ids": {"inputs": {"users": [[True, False]], "items": [[1]]}},
    "null ids": {"inputs": {"users": [[None, 2]], "items": [[1]]}},
    "id beyond int64": {"inputs": {"users": [[2 ** 70, 2]], "items": [[1]]}},
    "id beyond int32": {"inputs": {"users": [[1, 2]], "items": [[2 ** 40]]}},
    "object as an id": {"inputs": {"users": [[{"b64": "AA=="}, 2]], "items": [[1]]}},
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_with_400(job, case):
    _, server = _fresh(job)
    status, body = server.predict(BAD_REQUESTS[case])
    assert status == 400, (case, body)
    assert isinstance(body, dict) and list(body) == ["error"] and body["error"], body


def test_a_refused_request_leaves_serving_intact(job):
    model, server = _fresh(job)
    assert server.predict(BAD_REQUESTS["id beyond int64"])[0] == 400
    status, body = server.predict({"inputs": _columns()})
    assert status == 200
    np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)


def test_unknown_model_name_is_404(job):
    _, _, server = job
    for method, path, body in [("POST", "/v1/models/other:predict", {"inputs": _columns()}),
                               ("GET", "/v1/models/other", None)]:
        status, answer = server.call(method, path, body)
        assert status == 404 and "other" in answer["error"], answer


def test_version_not_served_is_404(job):
    _, _, server = job
    status, body = server.call("POST", "/v1/models/ctr/versions/999999:predict", {"inputs": _columns()})
    assert status == 404 and "999999" in body["error"], body


def test_path_outside_v1_is_404_with_a_json_body(job):
    _, _, server = job
    status, body = server.call("GET", "/v2/whatever")
    assert status == 404 and body["error"]


def test_oversize_body_is_413(job):
    _, _, server = job
    big = {"inputs": {"users": [[1, 2]] * (MAX_BODY // 4), "items": [[1]] * (MAX_BODY // 4)}}
    status, body = server.predict(big)
    assert status == 413 and str(MAX_BODY) in body["error"], body


def test_oversize_chunked_body_is_413(job):
    """Without Content-Length the cap applies while the body streams in."""
    _, _, server = job
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        chunks = (b"[" + b"1," * 1024 for _ in range(MAX_BODY // 1024))
        conn.request("POST", "/v1/models/ctr:predict", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 413, r.read()
        assert "error" in json.loads(r.read())
    finally:
        conn.close()


def test_metrics_are_prometheus_text_with_the_serving_metrics(job):
    from prometheus_client.parser import text_string_to_metric_families

    model, server = _fresh(job)
    seq = job[1].last_committed.seq
    assert server.predict({"inputs": _columns()})[0] == 200
    status, text = server.call("GET", "/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("evstore_serving_freshness_seconds", "evstore_serving_apply_latency_seconds",
                 "evstore_serving_checkpoints_applied", "evstore_serving_apply_failures",
                 "evstore_serving_applied_sequence", "evstore_serving_rows", "evstore_serving_predict_latency_seconds",
                 "evstore_serving_request_errors"):
        assert name in fams, (name, sorted(fams))

    def value(fam, sample, **labels):
        return next(s.value for s in fams[fam].samples if s.name == sample and s.labels == labels)

    assert value("evstore_serving_applied_sequence", "evstore_serving_applied_sequence") == seq
    assert value("evstore_serving_apply_failures", "evstore_serving_apply_failures_total") == 0
    assert value("evstore_serving_checkpoints_applied", "evstore_serving_checkpoints_applied_total") >= 1
    assert value("evstore_serving_freshness_seconds", "evstore_serving_freshness_seconds_count") >= 1
    assert value("evstore_serving_predict_latency_seconds", "evstore_serving_predict_latency_seconds_count") >= 1
    for table in ("user", "item"):
        rows = int(model.get_layer(table).ev.export()["keys"].shape[0])
        assert value("evstore_serving_rows", "evstore_serving_rows", table=table) == rows


def test_tensorflow_thread_flags_reach_tensorflow_and_the_server_answers(tmp_path):
    from served import serve_ctr

    model, _, server = serve_ctr(str(tmp_path), extra=["--tensorflow_intra_op_parallelism", "1",
                                                       "--tensorflow_inter_op_parallelism", "2"])
    try:
        status, body = server.predict({"instances": _rows()})
        assert status == 200, body
        np.testing.assert_allclose(np.array(body["predictions"]), _want(model), rtol=1e-6, atol=1e-7)
        with open(server.log.name) as f:   # read back from TensorFlow once set
            assert "TensorFlow threads: intra-op 1, inter-op 2" in f.read()
    finally:
        server.stop()


def test_a_negative_tensorflow_thread_flag_exits_1_with_the_reason(tmp_path):
    import subprocess

    p = subprocess.run([sys.executable, "-m", "evstore_app.cli", "serve", "--export", str(tmp_path),
                        "--tensorflow_inter_op_parallelism", "-1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "inter_op_parallelism must be an integer >= 0" in p.stderr


def test_sigterm_stops_the_server_with_status_0(tmp_path):
    model = make_model()
    train(model, 0, 2)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    server = Server(str(tmp_path), export)          # no checkpoint root: serves the export as written
    try:
        assert server.version() == 0
        status, body = server.predict({"inputs": _columns()})
        assert status == 200
        np.testing.assert_allclose(np.array(body["outputs"]), _want(model), rtol=1e-6, atol=1e-7)
    finally:
        assert server.stop(signal.SIGTERM) == 0


# ---- TF Serving's request and response formats, in process -----------------
def test_inputs_are_converted_to_each_signature_dtype():
    from serving_loader.tfs import to_array

    assert to_array("ids", [7, 8], (np.dtype(np.int32), [None], "int32")).dtype == np.int32
    dense = to_array("dense", [[1, float("nan")], [0.5, 2]], (np.dtype(np.float32), [None, 2], "float32"))
    assert dense.dtype == np.float32 and np.isnan(dense[0, 1])
    assert to_array("flag", [True, False], (np.dtype(np.bool_), [None], "bool")).tolist() == [True, False]


@pytest.mark.parametrize("spec, value", [((np.dtype(np.bool_), [None], "bool"), [1]),
                                         ((np.dtype(np.float32), [None, 2], "float32"), [[True, False]]),
                                         ((np.dtype(np.float32), [None, 2], "float32"), [["1", "2"]])])
def test_a_value_of_another_type_is_refused(spec, value):
    from serving_loader.tfs import ServingError, to_array

    with pytest.raises(ServingError) as e:
        to_array("x", value, spec)
    assert e.value.http_status == 400 and "'x'" in e.value.message


def test_one_output_is_unwrapped_in_both_formats():
    from serving_loader.tfs import format_predict_json

    out = {"score": np.array([[0.5], [0.25]], np.float32)}
    assert json.loads(format_predict_json(out, "row")) == {"predictions": [[0.5], [0.25]]}
    assert json.loads(format_predict_json(out, "columnar")) == {"outputs": [[0.5], [0.25]]}


def test_several_outputs_are_objects_per_example_or_per_output():
    from serving_loader.tfs import format_predict_json

    out = {"score": np.array([0.5, 0.25], np.float32), "label": np.array([1, 0], np.int64)}
    assert json.loads(format_predict_json(out, "row")) == {"predictions": [{"label": 1, "score": 0.5},
                                                                           {"label": 0, "score": 0.25}]}
    assert json.loads(format_predict_json(out, "columnar")) == {"outputs": {"label": [1, 0], "score": [0.5, 0.25]}}
