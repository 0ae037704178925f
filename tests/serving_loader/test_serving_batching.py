"""Server-side batching: TF Serving's semantics (max_batch_size,
batch_timeout_micros, one model call per batch, answers split back), and a
concurrent storm of REST and gRPC callers against a real server while deltas
are committed and applied: every caller gets its own rows, each answer from
exactly one committed version."""
import concurrent.futures
import http.client
import json
import os
import threading

import numpy as np
import pytest

from served import Server

from serving_loader.batching import Batcher, BatchingOptions
from serving_loader.tfs import ServingError


# ---- the batcher in process (the model is a plain function) ------------------------------------
class Model:
    """Doubles its input; records the rows of each call."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, inputs):
        with self.lock:
            self.calls.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}, len(self.calls)


def _storm(batcher, n, rows_of):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(lambda i: (i, batcher.submit({"x": np.full((rows_of(i), 3), i)}).result()), i)
                for i in range(n)]
        return [f.result() for f in futs]


def test_each_caller_gets_its_own_rows():
    b = Batcher(Model(), BatchingOptions(max_batch_size=16, batch_timeout_micros=5000))
    try:
        for i, (out, _) in _storm(b, 200, lambda i: 1 + i % 3):
            assert out["y"].shape == (1 + i % 3, 3)
            assert (out["y"] == 2 * i).all()
    finally:
        b.stop()


def test_no_batch_exceeds_max_batch_size_and_calls_are_batched():
    model = Model()
    b = Batcher(model, BatchingOptions(max_batch_size=8, batch_timeout_micros=20000))
    try:
        _storm(b, 200, lambda i: 1 + i % 3)
    finally:
        b.stop()
    assert max(model.calls) <= 8
    assert sum(model.calls) == sum(1 + i % 3 for i in range(200))
    assert len(model.calls) < 200          # several requests shared model calls
    assert b.batches == len(model.calls) and b.tasks == 200


def test_a_task_larger_than_max_batch_size_is_refused():
    b = Batcher(Model(), BatchingOptions(max_batch_size=4))
    try:
        with pytest.raises(ServingError) as e:
            b.submit({"x": np.zeros((5, 3))})
        assert e.value.code == "INVALID_ARGUMENT" and "larger than maximum input batch size 4" in e.value.message
    finally:
        b.stop()


def test_inputs_of_unequal_batch_size_are_refused():
    b = Batcher(Model())
    try:
        with pytest.raises(ServingError) as e:
            b.submit({"x": np.zeros((2, 3)), "z": np.zeros((3,))})
        assert e.value.code == "INVALID_ARGUMENT" and "0th-dimension" in e.value.message
    finally:
        b.stop()


def test_a_task_whose_deadline_passed_before_its_batch_ran_is_not_run():
    import time

    model = Model()
    # A batch closes when full (2 rows) or after 10 s: the two tasks below share one.
    b = Batcher(model, BatchingOptions(max_batch_size=2, batch_timeout_micros=10_000_000))
    try:
        late = b.submit({"x": np.full((1, 3), 7)}, deadline=time.monotonic() - 1)
        live = b.submit({"x": np.full((1, 3), 5)}, deadline=time.monotonic() + 3600)
        with pytest.raises(ServingError) as e:
            late.result(timeout=60)
        assert e.value.code == "DEADLINE_EXCEEDED"
        assert (live.result(timeout=60)[0]["y"] == 10).all()
    finally:
        b.stop()
    assert model.calls == [1] and b.expired == 1 and b.tasks == 1   # only the live task reached the model


def test_a_failing_request_does_not_fail_its_batch_neighbours():
    def run(inputs):
        if (inputs["x"] < 0).any():
            raise ServingError("INVALID_ARGUMENT", "negative")
        return {"y": inputs["x"] * 2}, 1

    b = Batcher(run, BatchingOptions(max_batch_size=64, batch_timeout_micros=20000))
    try:
        futs = [b.submit({"x": np.full((1,), -1 if i == 3 else i)}) for i in range(8)]
        for i, f in enumerate(futs):
            if i == 3:
                with pytest.raises(ServingError):
                    f.result()
            else:
                assert f.result()[0]["y"].tolist() == [2 * i]
    finally:
        b.stop()


# ---- a real server under a storm while deltas apply -----------------------------------------------
KEYS = 64
IDS = 4


def _build():
    import keras
    import tensorflow as tf

    import evstore

    ids = keras.Input(shape=(IDS,), dtype="int64", name="ids")
    e = evstore.keras.Embedding(1, name="emb", embeddings_initializer=tf.constant_initializer(0.0))(ids)
    model = keras.Model(ids, keras.layers.Flatten()(e))
    model(np.zeros((1, IDS), np.int64))
    return model, model.get_layer("emb").ev


def _set_version(ev, v):
    """Every row of version v: v * 1000 + key (an answer tells its version and its keys)."""
    keys = np.arange(KEYS, dtype=np.int64)
    ev.load(keys, (v * 1000 + keys).astype(np.float32).reshape(-1, 1))


def _serve(tmp_path, version, extra, tables="stock"):
    """The model exported (`tables`: export_serving_model's), a full of `version`, a server (flags `extra`)
    serving it: (ev, manager, server)."""
    import checkpoint
    import serving_loader

    model, ev = _build()
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export, tables=tables)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    _set_version(ev, version)
    mgr.save_full()
    server = Server(str(tmp_path), export, str(tmp_path / "ckpt"), name="m", extra=extra)
    try:
        server.wait_version(mgr.last_committed.seq)
    except BaseException:
        server.stop()
        raise
    return ev, mgr, server


@pytest.fixture
def storm_server(tmp_path):
    ev, mgr, server = _serve(tmp_path, 1, ["--max_batch_size", "8", "--batch_timeout_micros", "20000"])
    try:
        yield ev, mgr, server
    finally:
        server.stop()


def _check(ids, values, committed):
    """The version v of one answer: values == v * 1000 + ids for one v that was committed."""
    versions = (np.asarray(values) - np.asarray(ids)) / 1000.0
    assert np.all(versions == versions.flat[0]), (ids, values)
    assert int(versions.flat[0]) in committed, (versions.flat[0], sorted(committed))
    return int(versions.flat[0])


def test_storm_of_callers_gets_own_rows_from_one_committed_version_while_deltas_apply(storm_server):
    _storm_while_deltas_apply(*storm_server)


def test_a_served_tiered_model_under_a_predict_storm_while_deltas_apply_answers_each_request_from_one_version(
        tmp_path):
    # 64 rows of 1 float; a cache of ~8 rows: most lookups read the disk tier
    ev, mgr, server = _serve(tmp_path, 1, ["--max_batch_size", "8", "--batch_timeout_micros", "20000",
                                           "--tiered-dram-bytes", "100", "--tier-path", str(tmp_path / "tier")],
                             tables="evstore")
    try:
        _storm_while_deltas_apply(ev, mgr, server)
        status, text = server.call("GET", "/metrics")
        misses = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('evstore_serving_tier_cache_misses{table="emb"}')]
        assert misses and misses[0] > 0, "the storm was answered from DRAM alone"
    finally:
        server.stop()


def _storm_while_deltas_apply(ev, mgr, server):
    """REST and gRPC callers against `server` while deltas of new versions are committed: each answer
    holds the caller's rows of exactly one committed version."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    committed = {1}
    values_of = {mgr.last_committed.seq: 1}
    stop = threading.Event()
    errors = []
    seen = []

    def committer():
        v = 1
        while not stop.is_set() and v < 12:
            v += 1
            _set_version(ev, v)
            committed.add(v)               # before the commit: a reader may see it as soon as it lands
            values_of[mgr.save_delta()] = v
            stop.wait(0.2)

    def rest_caller(seed):
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            for _ in range(40):
                ids = rng.integers(0, KEYS, size=(int(rng.integers(1, 4)), IDS))
                conn.request("POST", "/v1/models/m:predict", json.dumps({"instances": ids.tolist()}))
                r = conn.getresponse()
                body = json.loads(r.read())
                assert r.status == 200, body
                seen.append(_check(ids, body["predictions"], committed))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            conn.close()

    def grpc_caller(seed):
        rng = np.random.default_rng(seed)
        channel = server.channel()
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        try:
            for _ in range(40):
                ids = rng.integers(0, KEYS, size=(int(rng.integers(1, 4)), IDS))
                req = predict_pb2.PredictRequest()
                req.model_spec.name = "m"
                req.inputs["ids"].CopyFrom(tf.make_tensor_proto(ids))
                answer = stub.Predict(req, timeout=60)
                v = _check(ids, tf.make_ndarray(answer.outputs["outputs"]), committed)
                assert values_of.get(answer.model_spec.version.value, v) == v   # the version reported is the one used
                seen.append(v)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            channel.close()

    threads = [threading.Thread(target=committer)]
    threads += [threading.Thread(target=rest_caller, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=grpc_caller, args=(100 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors[:3]
    assert len(seen) == 10 * 40
    status, text = server.call("GET", "/metrics")
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["evstore_serving_batched_requests_total"]) == 10 * 40
    assert float(samples["evstore_serving_batches_total"]) < 10 * 40     # requests shared model calls


def test_without_batching_each_request_is_its_own_model_call(tmp_path):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    _, _, server = _serve(tmp_path, 3, ["--no-enable_batching"])
    try:
        ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int64)
        status, body = server.predict({"instances": ids.tolist()})
        assert status == 200 and _check(ids, body["predictions"], {3}) == 3
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "m"
        req.inputs["ids"].CopyFrom(tf.make_tensor_proto(ids))
        with server.channel() as channel:
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(req, timeout=60)
        assert _check(ids, tf.make_ndarray(answer.outputs["outputs"]), {3}) == 3
        _, text = server.call("GET", "/metrics")
        assert "evstore_serving_batches_total" not in text or "evstore_serving_batches_total 0.0" in text
    finally:
        server.stop()
