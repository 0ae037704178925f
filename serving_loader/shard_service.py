"""The serving shard's gRPC service (`evstore serve --shard i/N`), on grpcio.

Service `evstore.ServingShard`, four unary methods:

  * Lookup: a tensorflow.serving.PredictRequest whose `model_spec.version`
    names the version to read and whose `inputs` are {EV: 1-D keys routed to
    this shard}; answered with a PredictResponse {EV: float32 rows [n, dim]}
    at exactly that version (FAILED_PRECONDITION when the shard does not hold
    it readable).
  * Stage, Publish, Status: a small JSON object each way ({"target": seq,
    "fleet": seq} / {"target": seq} / {}), answered with the shard's status
    (ShardModel.status()).

The port is attack surface: a request is read only after grpcio's message
size cap (`max_request_bytes`); bytes that do not parse, a wrong dtype or
rank, an unknown EV, more keys than the cap allows get INVALID_ARGUMENT; at
most `max_concurrent` calls run at once, more get RESOURCE_EXHAUSTED from
grpcio; a connection idle for `idle_timeout_s` is closed. Stage and Publish
act only on committed checkpoints of the shard's own root (the front's
`fleet` argument cannot make it serve anything uncommitted). With a token
(`--shard-token-file`, the same file on the shards and the front) every call
must carry `authorization: Bearer <token>` (compared in constant time), else
it gets UNAUTHENTICATED. With a certificate (`--shard-tls-cert/-key` on the
shard, `--shard-tls-ca` on the front) the port speaks TLS only (grpcio's
ssl credentials), so the token and the rows are encrypted and the front
checks the shard's certificate.

Why grpcio and not TensorFlow's distributed runtime: see
docs/guides/sharded-serving.md ("Runtime") and BENCHMARKS.md.
"""
import hmac
import json
import logging
from concurrent import futures

import grpc
import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import predict_pb2

from checkpoint.errors import CheckpointError
from serving_loader.shard_model import VersionNotHeld
from serving_loader.tensor_proto import TensorLimits, array_to_tensor, tensor_to_array
from serving_loader.tfs import ServingError

__all__ = ["SERVICE", "AUTH_HEADER", "ShardServer", "DEFAULT_MAX_REQUEST_BYTES"]

log = logging.getLogger("evstore.serving")

SERVICE = "evstore.ServingShard"
AUTH_HEADER = "authorization"   # gRPC metadata keys are lower case
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
MAX_CONTROL_BYTES = 4096


def _abort(context, code, message):
    context.abort(code, message)


class _Handlers:
    def __init__(self, model, max_request_bytes):
        self.model = model
        self.limits = TensorLimits(max_request_bytes)

    def _specs(self):
        out = {}
        for n, t in self.model._tables.items():
            out[n] = (None if t.key_dtype == tf.string else t.key_dtype.as_numpy_dtype, [None], t.key_dtype.name)
        return out

    def lookup(self, request, context):
        try:
            req = predict_pb2.PredictRequest.FromString(request)
        except DecodeError:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Lookup: the request is not a PredictRequest")
        if not req.model_spec.HasField("version"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Lookup: model_spec.version names the version to read")
        specs = self._specs()
        unknown = sorted(set(req.inputs) - set(specs))
        if unknown:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"Lookup: this shard serves EVs {sorted(specs)}, not {unknown}")
        try:
            keys = {n: tensor_to_array(n, p, specs[n], self.limits) for n, p in req.inputs.items()}
        except ServingError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Lookup: {e.message}")
        version = req.model_spec.version.value
        try:
            rows = self.model.lookup(version, keys)
        except VersionNotHeld as e:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        resp = predict_pb2.PredictResponse()
        resp.model_spec.version.value = version
        for n, r in rows.items():
            array_to_tensor(np.asarray(r, np.float32), resp.outputs[n])
        return resp.SerializeToString()

    def _control(self, request, context, fields):
        if len(request) > MAX_CONTROL_BYTES:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "control request too large")
        try:
            body = json.loads(request.decode("utf-8")) if request else {}
        except (UnicodeDecodeError, ValueError):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "control request is not a JSON object")
        if not isinstance(body, dict) or set(body) - set(fields):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"control request takes the fields {sorted(fields)}")
        for f, required in fields.items():
            v = body.get(f)
            if (v is None and required) or (v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                                or v < 1)):
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                       f"control request field {f!r} must be a commit sequence number (an integer >= 1)")
        return body

    @staticmethod
    def _answer(status):
        return json.dumps(status).encode()

    def stage(self, request, context):
        body = self._control(request, context, {"target": True, "fleet": False})
        try:
            return self._answer(self.model.stage(body["target"], body.get("fleet")))
        except (CheckpointError, ValueError, tf.errors.OpError) as e:
            self.model.apply_metrics.last_error = f"cannot stage {body['target']}: {e}"
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, self.model.last_error)
        except OSError as e:
            self.model.apply_metrics.last_error = f"cannot stage {body['target']}: {e}"
            _abort(context, grpc.StatusCode.UNAVAILABLE, self.model.last_error)

    def publish(self, request, context):
        body = self._control(request, context, {"target": True})
        try:
            return self._answer(self.model.publish(body["target"]))
        except VersionNotHeld as e:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def status(self, request, context):
        self._control(request, context, {})
        return self._answer(self.model.status())


def _guarded(fn, token):
    """`fn` behind the fleet's bearer token (compared in constant time): a call
    without it gets UNAUTHENTICATED and is not read further."""
    if token is None:
        return fn
    expected = f"Bearer {token}".encode()

    def call(request, context):
        got = dict(context.invocation_metadata()).get(AUTH_HEADER, "")
        if not hmac.compare_digest(got.encode("utf-8", "replace"), expected):
            _abort(context, grpc.StatusCode.UNAUTHENTICATED,
                   "this shard needs the fleet's token (--shard-token-file on the shard and the front)")
        return fn(request, context)

    return call


class ShardServer:
    """Serves ShardModel `model` on host:port (0: a free port; `port` is the
    bound one) until stop(); with `token`, only to callers that send it
    (`authorization: Bearer <token>` metadata); with `tls` (private key
    PEM, certificate chain PEM, bytes), over TLS only."""

    def __init__(self, model, host="127.0.0.1", port=0, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES,
                 max_concurrent=64, workers=8, idle_timeout_s=300.0, token=None, tls=None):
        h = _Handlers(model, max_request_bytes)
        methods = {name: grpc.unary_unary_rpc_method_handler(_guarded(fn, token)) for name, fn in
                   (("Lookup", h.lookup), ("Stage", h.stage), ("Publish", h.publish), ("Status", h.status))}
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard"),
            handlers=[grpc.method_handlers_generic_handler(SERVICE, methods)],
            maximum_concurrent_rpcs=max_concurrent,
            options=[("grpc.max_receive_message_length", max_request_bytes),
                     ("grpc.max_send_message_length", -1),
                     # above max_concurrent, so calls past it get RESOURCE_EXHAUSTED, not a refused stream
                     ("grpc.max_concurrent_streams", max(256, 4 * max_concurrent)),
                     ("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)),
                     ("grpc.so_reuseport", 0)])
        shown = f"[{host}]" if ":" in host else host
        if tls is None:
            self.port = self._server.add_insecure_port(f"{shown}:{port}")
        else:   # (private key PEM, certificate chain PEM): grpcio's own TLS
            self.port = self._server.add_secure_port(f"{shown}:{port}", grpc.ssl_server_credentials([tls]))
        if not self.port:
            raise OSError(f"cannot listen on {shown}:{port}")
        self._server.start()

    def stop(self, grace_s=5.0):
        self._server.stop(grace_s).wait()

    def wait(self):
        self._server.wait_for_termination()


def serve_shard(export_dir, checkpoint_root, shard, host="127.0.0.1", port=0, evs=None, tier=None,
                max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, storage_options=None, out=None, disk_bytes=None,
                token=None, tls=None):
    """`evstore serve --shard I/N`: serves shard `shard` ("I/N") of the
    export's EVs `evs` (None: all) on host:port until SIGTERM (returns 0) or
    SIGINT (130). Prints `shard I/N of <export> on <host>:<port>` once it
    listens; `disk_bytes`: its disk budget (ShardModel); `token`: the
    fleet's bearer token, `tls`: (key PEM, certificate PEM) (ShardServer).
    Raises ValueError
    for a bad shard, export, EV list or budget."""
    import signal
    import sys
    import threading

    from serving_loader.shard_model import ShardModel, parse_shard

    if checkpoint_root is None:
        raise ValueError("a serving shard needs --checkpoints (the root its front serves)")
    i, n = parse_shard(shard)
    model = ShardModel(export_dir, checkpoint_root, i, n, evs=evs, storage_options=storage_options, storage=tier,
                       disk_bytes=disk_bytes)
    server = ShardServer(model, host, port, max_request_bytes=max_request_bytes, token=token, tls=tls)
    stop, received = threading.Event(), []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda num, _frame: (received.append(num), stop.set()))
    shown = f"[{host}]" if ":" in host else host
    print(f"shard {i}/{n} of {export_dir} on {shown}:{server.port}", file=out or sys.stdout, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(5.0)
        model.close()
    return 130 if signal.SIGINT in received else 0
