"""TF Serving's gRPC API: tensorflow.serving.PredictionService (Predict,
Classify, Regress, GetModelMetadata) and tensorflow.serving.ModelService
(GetModelStatus), on the request and answer protos of the
`tensorflow-serving-api` package.

The transport is not Python's: serving_loader/native/grpc_frontend.cc speaks
HTTP/2 (nghttp2) and gRPC's message framing in a C++ thread and hands whole
request messages to one Python dispatch thread in batches; answers go back
from whichever thread finishes them. grpcio's own server spends more CPU per
call before any model work than a whole REST request
(bench/LOG.md).
Requests reach the model as REST ones do (ServingApp.call_model: the default
signature through the batcher); errors are TF Serving's canonical codes
(ServingError.code) with its messages. ModelService.HandleReloadConfigRequest
is not served (UNIMPLEMENTED): the model comes from the export and its
checkpoint root.
"""
import logging
import threading
import time
import zlib

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     predict_pb2, regression_pb2)

from serving_loader.batching import deadline_exceeded
from serving_loader.tensor_proto import TensorLimits, array_to_tensor, tensor_to_array
from serving_loader.tfs import CLASSIFY_METHOD, REGRESS_METHOD, ServingError, examples_with_context, invalid

__all__ = ["start_grpc", "GrpcServer", "DEFAULT_IDLE_TIMEOUT_S", "tensor_to_array", "array_to_tensor"]

log = logging.getLogger("evstore.serving")

def _spec(request):
    spec = request.model_spec
    version = spec.version.value if spec.HasField("version") else None
    label = spec.version_label if spec.WhichOneof("version_choice") == "version_label" else None
    return spec.name, version, label


_CODE = {c.name: c.value[0] for c in grpc.StatusCode}   # "INVALID_ARGUMENT" -> 3
_CODE_NAME = {v: k for k, v in _CODE.items()}


class _Methods:
    """The five methods on request protos, without a transport. Each returns
    the answer proto, or (signature key, inputs, finish) when the model is to
    be called: `finish(outputs, version)` makes the answer once the call is done."""

    def __init__(self, app):
        self.app = app
        self.servable = app.servable
        batch = app.batcher.options.max_batch_size if app.batcher is not None else None
        self._limits = TensorLimits(app.max_request_bytes)   # inputs not batched (other signatures)
        self._batched_limits = TensorLimits(app.max_request_bytes, batch)   # the default signature's

    def _fill_spec(self, response, key, version):
        response.model_spec.name = self.servable.name
        response.model_spec.version.value = version or 0
        response.model_spec.signature_name = key

    def _checked_version(self, version, served):
        if version is not None and (served or 0) != version:
            raise ServingError("NOT_FOUND", f"Servable not found for request: Specific({self.servable.name}, "
                                            f"{version})")

    def predict(self, request):
        name, version, label = _spec(request)
        self.servable.check_spec(name, version, label)
        key = self.servable.signature(request.model_spec.signature_name)
        inputs = self.servable.inputs[key]
        sent = set(request.inputs)
        if sent != inputs.keys():
            raise invalid(f"Request inputs do not match required inputs for model `{name}`. Send extra: "
                          f"{{{','.join(sorted(sent - inputs.keys()))}}}. Missing but required: "
                          f"{{{','.join(sorted(inputs.keys() - sent))}}}.")
        wanted = list(request.output_filter) or None
        outs = self.servable.outputs[key]
        for n in wanted or ():
            if n not in outs:
                raise invalid(f"output tensor alias not found in signature: {n} Outputs expected to be in the "
                              f"set {{{','.join(sorted(outs))}}}.")
        limits = self._batched_limits if key == self.servable.default_signature else self._limits
        arrays = {n: tensor_to_array(n, request.inputs[n], inputs[n], limits) for n in inputs}

        def finish(outputs, served):
            self._checked_version(version, served)
            response = predict_pb2.PredictResponse()
            self._fill_spec(response, key, served)
            for n in wanted or outputs:
                array_to_tensor(outputs[n], response.outputs[n])
            return response

        return key, arrays, finish

    def _examples(self, request, method, answer):
        name, version, label = _spec(request)
        self.servable.check_spec(name, version, label)
        key = self.servable.signature(request.model_spec.signature_name, method)
        kind = request.input.WhichOneof("kind")
        if kind == "example_list":
            examples = examples_with_context(request.input.example_list.examples, None)
        elif kind == "example_list_with_context":
            lst = request.input.example_list_with_context
            examples = examples_with_context(lst.examples, lst.context)
        else:
            examples = []
        if not examples:
            raise invalid("Input is empty.")
        (input_name,) = self.servable.inputs[key]

        def finish(outputs, served):
            self._checked_version(version, served)
            return answer(key, outputs, served)

        return key, {input_name: np.array(examples, dtype=object)}, finish

    def classify(self, request):
        def answer(key, outputs, served):
            scores, classes = outputs.get("scores"), outputs.get("classes")
            if scores is None and classes is None:
                raise invalid("classification signature has neither 'classes' nor 'scores'")
            ref = scores if scores is not None else classes
            ref = ref.reshape(ref.shape[0], -1)
            scores = None if scores is None else scores.reshape(ref.shape)
            classes = None if classes is None else classes.reshape(ref.shape)
            response = classification_pb2.ClassificationResponse()
            self._fill_spec(response, key, served)
            for i in range(ref.shape[0]):
                c = response.result.classifications.add()
                for j in range(ref.shape[1]):
                    cls = c.classes.add()
                    if classes is not None:
                        cls.label = classes[i, j].decode("utf-8", "replace")
                    if scores is not None:
                        cls.score = float(scores[i, j])
            return response

        return self._examples(request, CLASSIFY_METHOD, answer)

    def regress(self, request):
        def answer(key, outputs, served):
            if "outputs" not in outputs:
                raise invalid("regression signature has no 'outputs'")
            response = regression_pb2.RegressionResponse()
            self._fill_spec(response, key, served)
            for v in outputs["outputs"].ravel().tolist():
                response.result.regressions.add().value = v
            return response

        return self._examples(request, REGRESS_METHOD, answer)

    def get_model_metadata(self, request):
        name, version, label = _spec(request)
        self.servable.check_spec(name, version, label)
        if not request.metadata_field:
            raise invalid("GetModelMetadataRequest must specify at least one metadata_field")
        for f in request.metadata_field:
            if f != "signature_def":
                raise invalid(f"Metadata field {f} is not supported")
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = self.servable.name
        response.model_spec.version.value = self.servable.version
        sigs = get_model_metadata_pb2.SignatureDefMap()
        for k, v in self.servable.signature_defs.items():
            sigs.signature_def[k].CopyFrom(v)
        response.metadata["signature_def"].Pack(sigs)
        return response

    def get_model_status(self, request):
        name, version, label = _spec(request)
        self.servable.check_status_spec(name, label)
        response = get_model_status_pb2.GetModelStatusResponse()
        states = get_model_status_pb2.ModelVersionStatus.State
        for v, state in self.servable.versions(version):
            s = response.model_version_status.add()
            s.version = v
            s.state = states.Value(state)
            s.status.error_code = 0
        return response


# Seconds a gRPC connection may stay idle (nothing received, no call at the
# model) before it is told GOAWAY and closed: `evstore serve --grpc_idle_timeout_s`.
DEFAULT_IDLE_TIMEOUT_S = 300.0


class GrpcServer:
    """The gRPC endpoint of `app` on host:port (0: any free port); `port` is
    the bound one. One dispatch thread parses requests and starts their model
    calls; answers are sent by the thread that finishes each call.

    `idle_timeout_s`: a connection that has sent nothing for this long and
    has no call waiting for the model is told GOAWAY and closed (0: never).
    A call its client resets (RST_STREAM, or a closed connection) before the
    model runs it is not run. ValueError for a negative `idle_timeout_s`."""

    def __init__(self, app, host, port, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S):
        from serving_loader.native import _grpc_frontend as fe

        if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
                or not 0 <= idle_timeout_s < 1e9:
            raise ValueError(f"idle_timeout_s must be a number of seconds >= 0 (0: never), got {idle_timeout_s!r}")
        self._fe = fe
        self._handle, self.port = fe.start(host, port, app.max_request_bytes, float(idle_timeout_s))
        self._app = app
        m = _Methods(app)
        self._methods = {   # path -> (method name in metrics, request class, handler)
            f"/tensorflow.serving.{service}/{name}".encode(): (name, cls, handler)
            for service, name, cls, handler in (
                ("PredictionService", "Predict", predict_pb2.PredictRequest, m.predict),
                ("PredictionService", "Classify", classification_pb2.ClassificationRequest, m.classify),
                ("PredictionService", "Regress", regression_pb2.RegressionRequest, m.regress),
                ("PredictionService", "GetModelMetadata", get_model_metadata_pb2.GetModelMetadataRequest,
                 m.get_model_metadata),
                ("ModelService", "GetModelStatus", get_model_status_pb2.GetModelStatusRequest, m.get_model_status))}
        self._counted = {}         # (method, status) -> its evstore_serving_grpc_calls child
        self._calls = app.metrics.grpc_calls
        self._pending = 0          # calls taken, not yet answered
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._dispatch, name="grpc-dispatch", daemon=True)
        self._thread.start()

    # -- answers (any thread)
    def _answer(self, cid, method, status, message="", body=b""):
        self._fe.respond(self._handle, cid, status, message, body)
        child = self._counted.get((method, status))
        if child is None:
            child = self._counted[(method, status)] = self._calls.labels(method, _CODE_NAME.get(status, str(status)))
        child.inc()
        with self._pending_lock:
            self._pending -= 1

    def _fail(self, cid, method, e):
        if isinstance(e, ServingError):
            self._answer(cid, method, _CODE[e.code], e.message)
        else:
            log.exception("gRPC call failed", exc_info=e)
            self._answer(cid, method, _CODE["INTERNAL"], f"{type(e).__name__}: {e}")

    def _finished(self, cid, method, finish, value, error):
        """The model call of `cid` is done (the batcher's thread): answer it."""
        try:
            if error is not None:
                raise error
            body = finish(*value).SerializeToString()
        except Exception as e:  # noqa: BLE001 - answered with its status
            self._fail(cid, method, e)
            return
        self._answer(cid, method, 0, "", body)

    # -- the dispatch thread
    def _dispatch(self):
        while True:
            calls = self._fe.next(self._handle, 256, 0.5)
            if calls is None:
                return
            with self._pending_lock:
                self._pending += len(calls)
            for cid, path, message, encoding, left in calls:
                self._one(cid, path, message, encoding, left)

    def _request(self, cls, message, encoding):
        """Request message -> proto of `cls`, inflated first when compressed
        (gzip or deflate, as gRPC clients compress; held to the same size cap
        as an uncompressed message). ServingError when it cannot be read."""
        if encoding is not None:
            d = zlib.decompressobj(31 if encoding == "gzip" else 15)   # gzip header, or zlib's (gRPC's "deflate")
            cap = self._app.max_request_bytes
            try:
                message = d.decompress(message, cap + 1)
            except zlib.error:
                raise ServingError("INTERNAL", f"Failed to decompress the {encoding} request message") from None
            if len(message) > cap:
                raise ServingError("RESOURCE_EXHAUSTED", f"Received message larger than max (over {cap} bytes "
                                                         "once decompressed; --max_request_bytes)")
            if not d.eof:
                raise ServingError("INTERNAL", f"Failed to decompress the {encoding} request message (truncated)")
        try:
            return cls.FromString(message)
        except DecodeError:
            raise ServingError("INTERNAL", "Failed to parse the request message") from None

    def _one(self, cid, path, message, encoding=None, left=None):
        """Call `cid`: `encoding` of a compressed message, `left` seconds
        before its grpc-timeout deadline (None: no deadline)."""
        entry = self._methods.get(path)
        if entry is None:
            self._answer(cid, "unknown", _CODE["UNIMPLEMENTED"], f"Method not found: {path.decode('latin-1')}")
            return
        method, cls, handler = entry
        try:
            if left is not None and left <= 0:   # the client has given up: no work for it
                raise deadline_exceeded()
            out = handler(self._request(cls, message, encoding))
            if isinstance(out, tuple):   # the model is to be called: answered when it is done
                key, arrays, finish = out
                self._app.call_model(key, arrays,
                                     lambda value, error: self._finished(cid, method, finish, value, error),
                                     deadline=None if left is None else time.monotonic() + left,
                                     cancelled=lambda: not self._fe.alive(self._handle, cid))
                return
            body = out.SerializeToString()
        except Exception as e:  # noqa: BLE001 - answered with its status
            self._fail(cid, method, e)
            return
        self._answer(cid, method, 0, "", body)

    def stop(self, grace_s=10.0):
        """Lets calls in flight finish (up to `grace_s`), then says GOAWAY and closes."""
        deadline = time.monotonic() + grace_s
        while self._pending > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self._fe.stop(self._handle)
        self._thread.join()


def start_grpc(app, host, port, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S):
    """Starts the gRPC server of `app` on host:port (0: any free port);
    returns (server, bound port). Stop it with `server.stop(grace_s)`.
    `idle_timeout_s`: see GrpcServer."""
    server = GrpcServer(app, host, port, idle_timeout_s)
    return server, server.port
