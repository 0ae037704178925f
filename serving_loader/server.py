"""`evstore serve`: TF Serving's REST API and Prometheus metrics over a ServingModel.

Endpoints (TF Serving's REST semantics, https://www.tensorflow.org/tfx/serving/api_rest):
  POST /v1/models/<name>[/versions/<v>]:predict
      {"instances": [...]}  row format: one item per example; with one model
                            input an item is that input's value (or an object
                            naming it), with several it is an object
                            {input name: value}. Answer {"predictions": [...]}:
                            one item per example, the bare value when the model
                            has one output, else an object per example.
      {"inputs": ...}       columnar format: {input name: batch}, or the bare
                            batch when the model has one input. Answer
                            {"outputs": ...}: the bare batch for one output,
                            else {output name: batch}.
      "signature_name" is optional and must name the export's signature.
  GET  /v1/models/<name>[/versions/<v>]            model_version_status; the
                            version is the checkpoint sequence number served
                            ("0" while no checkpoint is applied yet)
  GET  /v1/models/<name>[/versions/<v>]/metadata   the signature (saved_model.pb)
  GET  /metrics             Prometheus text format (one registry per server)

Every request field is data: the body is capped (413 past max_request_bytes,
checked against Content-Length and while reading), parsed as JSON, and each
input is converted with numpy to the signature's dtype and checked for rank,
fixed dimensions and (integer inputs) integrality and range before anything
reaches TensorFlow. Errors are JSON {"error": message}: 400 for a bad body,
404 for an unknown model, version or path, 405 for a wrong method, 413 for an
oversize body, 500 if the model itself fails.

Threads: the asyncio loop (uvicorn) only routes and reads bodies; parsing,
predict and JSON encoding run in starlette's thread pool, so predictions run
concurrently (ServingModel holds its lock shared for each). ServingModel
polls the checkpoint root on its own apscheduler thread; metrics are copied
from its counters and sample lists at each scrape and every poll interval.
"""
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time

import numpy as np

from serving_loader import admin

log = logging.getLogger("evstore.serving")

__all__ = ["ServingApp", "ServingMetrics", "RequestError", "parse_predict_request", "format_predict_response",
           "serve"]

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20
_LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0)
_FRESHNESS_BUCKETS = (.1, .25, .5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_MODEL_PATH = re.compile(r"^/v1/models/(?P<name>[^/:]+)"
                         r"(?:/versions/(?P<version>[^/:]+)|/labels/(?P<label>[^/:]+))?"
                         r"(?P<tail>:predict|/metadata)?$")


class RequestError(Exception):
    """A request we refuse: HTTP `status` and a message for {"error": ...}."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


# ---- request parsing (pure numpy: nothing here touches TensorFlow) -----------
def _numpy_dtype(name):
    import tensorflow as tf

    return np.dtype(tf.as_dtype(name).as_numpy_dtype) if name != "string" else None


def _to_array(name, value, spec):
    """`value` (JSON data) as an ndarray of input `name`'s dtype and shape, or RequestError(400)."""
    shape = spec["shape"]
    want = spec["dtype"]
    try:
        raw = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise RequestError(400, f"input {name!r}: not a rectangular array of {want} values ({e})") from None
    if raw.ndim != len(shape) or any(d is not None and d != g for d, g in zip(shape, raw.shape)):
        dims = ", ".join("None" if d is None else str(d) for d in shape)
        raise RequestError(400, f"input {name!r} must have shape [{dims}] (batch first), got {list(raw.shape)}")
    kind = raw.dtype.kind
    if want == "string":
        if kind != "U" and raw.size:
            raise RequestError(400, f"input {name!r} takes strings, got {raw.dtype.name} values")
        return np.char.encode(raw.astype(str), "utf-8")
    dtype = _numpy_dtype(want)
    if raw.size == 0:
        return raw.astype(dtype)
    if dtype.kind in "iu":
        if kind not in "iu":
            what = {"f": "non-integer numbers", "b": "booleans", "U": "strings", "O": "values that are not "
                    "64-bit integers (objects, nulls or out-of-range numbers)"}.get(kind, raw.dtype.name)
            raise RequestError(400, f"input {name!r} takes {want} ids, got {what}")
        info = np.iinfo(dtype)
        lo, hi = int(raw.min()), int(raw.max())
        if lo < info.min or hi > info.max:
            raise RequestError(400, f"input {name!r}: ids must lie in [{info.min}, {info.max}] ({want}), "
                                    f"got values in [{lo}, {hi}]")
        return raw.astype(dtype)
    if dtype.kind == "f":
        if kind not in "iuf":
            raise RequestError(400, f"input {name!r} takes {want} numbers, got "
                                    f"{ {'b': 'booleans', 'U': 'strings'}.get(kind, 'non-numeric values') }")
        return raw.astype(dtype)
    if dtype.kind == "b":
        if kind != "b":
            raise RequestError(400, f"input {name!r} takes booleans, got {raw.dtype.name} values")
        return raw
    raise RequestError(400, f"input {name!r}: dtype {want} is not supported by the REST server")


def parse_predict_request(body, inputs, signature="serving_default"):
    """Parses a :predict body. `inputs`: ServingModel.inputs ({name: {"name", "dtype", "shape"}}).

    Returns (arrays {input name: ndarray}, "row" | "columnar"). Raises RequestError(400).
    """
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError(400, 'request body must be a JSON object with "instances" or "inputs"')
    unknown = sorted(set(req) - {"instances", "inputs", "signature_name"})
    if unknown:
        raise RequestError(400, f"unknown request fields {unknown}; a predict request has \"instances\" or "
                                "\"inputs\" and optionally \"signature_name\"")
    sig = req.get("signature_name", signature)
    if sig != signature:
        raise RequestError(400, f"signature_name {sig!r} not found; this model serves {signature!r}")
    if ("instances" in req) == ("inputs" in req):
        raise RequestError(400, 'a predict request has exactly one of "instances" (row format) and "inputs" '
                                "(columnar format)")
    names = sorted(inputs)

    def check_names(got, where):
        unknown = sorted(set(got) - set(inputs))
        missing = sorted(set(inputs) - set(got))
        if unknown or missing:
            raise RequestError(400, f"{where}: unknown inputs {unknown}, missing inputs {missing}; the model "
                                    f"takes {names}")

    if "inputs" in req:
        cols = req["inputs"]
        if not isinstance(cols, dict):
            if len(inputs) != 1:
                raise RequestError(400, f'"inputs" must be an object {{input name: batch}} naming {names}')
            cols = {names[0]: cols}
        check_names(cols, '"inputs"')
        return {n: _to_array(n, v, inputs[n]) for n, v in cols.items()}, "columnar"

    rows = req["instances"]
    if not isinstance(rows, list) or not rows:
        raise RequestError(400, '"instances" must be a non-empty list with one item per example')
    named = [isinstance(r, dict) for r in rows]
    if any(named) and not all(named):
        raise RequestError(400, '"instances" mixes objects and bare values; use one form for every item')
    if not named[0]:
        if len(inputs) != 1:
            raise RequestError(400, f'the model takes several inputs {names}: each item of "instances" must '
                                    "be an object naming them")
        return {names[0]: _to_array(names[0], rows, inputs[names[0]])}, "row"
    for i, r in enumerate(rows):
        check_names(r, f'"instances"[{i}]')
    return {n: _to_array(n, [r[n] for r in rows], inputs[n]) for n in names}, "row"


def _jsonable(a):
    if a.dtype.kind in "SO":
        return np.vectorize(lambda b: b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b),
                            otypes=[object])(a).tolist()
    return a.tolist()


def format_predict_response(outputs, fmt):
    """TF Serving's answer for `outputs` ({name: ndarray}) to a request in format `fmt`."""
    names = sorted(outputs)
    if fmt == "columnar":
        if len(names) == 1:
            return {"outputs": _jsonable(outputs[names[0]])}
        return {"outputs": {n: _jsonable(outputs[n]) for n in names}}
    if len(names) == 1:
        return {"predictions": _jsonable(outputs[names[0]])}
    sizes = {n: (outputs[n].shape[0] if outputs[n].ndim else None) for n in names}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise RequestError(400, f"outputs do not share a batch dimension ({sizes}); use the columnar "
                                '"inputs" format')
    cols = {n: _jsonable(outputs[n]) for n in names}
    return {"predictions": [{n: cols[n][i] for n in names} for i in range(sizes[names[0]])]}


# ---- metrics -----------------------------------------------------------------
class ServingMetrics:
    """Prometheus metrics of one ServingModel in their own CollectorRegistry.

    The freshness and apply latency histograms are fed from the model's
    sample lists as samples appear (`refresh`, at each scrape and every poll
    interval); predict latency and request errors are observed by the server.
    """

    def __init__(self, model):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.freshness = Histogram("evstore_serving_freshness_seconds", "Wall time from a checkpoint's commit "
                                   "to being served", registry=r, buckets=_FRESHNESS_BUCKETS)
        self.apply_latency = Histogram("evstore_serving_apply_latency_seconds", "Stage + publish time of an "
                                       "applied checkpoint (or of a reload)", registry=r, buckets=_LATENCY_BUCKETS)
        self.applied = Counter("evstore_serving_checkpoints_applied", "Checkpoints applied (deltas, and "
                               "reloads from a full)", registry=r)
        self.failures = Counter("evstore_serving_apply_failures", "Checkpoints that could not be applied "
                                "(gaps, corruption, read errors); the last good state keeps serving", registry=r)
        self.version = Gauge("evstore_serving_applied_sequence", "Checkpoint sequence number served (-1: none "
                             "yet, the export as written)", registry=r)
        self.rows = Gauge("evstore_serving_rows", "Rows in each served embedding table", ["table"], registry=r)
        self.predict_latency = Histogram("evstore_serving_predict_latency_seconds", "Predict request time "
                                         "(parse, model, encode) of answered requests", registry=r,
                                         buckets=_LATENCY_BUCKETS)
        self.request_errors = Counter("evstore_serving_request_errors", "Refused or failed requests by HTTP "
                                      "status", ["code"], registry=r)
        self._seen_applied = 0
        self._seen_failures = 0
        self._lock = threading.Lock()  # scrapes and the periodic refresh run on different threads
        self.refresh()

    def _snapshot(self, wait=False):
        """(applied, freshness samples, latency samples) as of one moment, or
        None while the model is applying (its poll lock is busy; the samples
        are picked up by the next refresh)."""
        return self.model.apply_samples(wait=wait)

    def refresh(self, wait=False):
        with self._lock:
            self._refresh(wait)

    def _refresh(self, wait=False):
        m = self.model
        snap = self._snapshot(wait)
        new = 0 if snap is None else snap[0] - self._seen_applied
        if new > 0:
            applied, fresh, lat = snap
            for x in fresh[-new:]:
                self.freshness.observe(x)
            for x in lat[-new:]:
                self.apply_latency.observe(x)
            self.applied.inc(new)
            self._seen_applied = applied
        failures = m.failures
        if failures > self._seen_failures:
            self.failures.inc(failures - self._seen_failures)
            self._seen_failures = failures
        self.version.set(-1 if m.version is None else m.version)
        for name, n in m.rows().items():
            self.rows.labels(table=name).set(n)

    def exposition(self):
        from prometheus_client import generate_latest

        self.refresh(wait=True)   # a scrape waits for an apply in progress: its counts are current
        return generate_latest(self.registry)


# ---- the ASGI app ------------------------------------------------------------
class ServingApp:
    """The starlette application serving `model` (a ServingModel) as `model_name`."""

    def __init__(self, model, model_name="default", max_request_bytes=DEFAULT_MAX_REQUEST_BYTES,
                 refresh_every_s=1.0):
        from starlette.applications import Starlette
        from starlette.routing import Route

        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
        self.model = model
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.refresh_every_s = refresh_every_s
        self.signature = model.mapping.get("signature", "serving_default")
        self.metrics = ServingMetrics(model)
        self._signature_def = self._read_signature_def()
        admin.register_metrics(self.metrics.registry, model)
        self.app = Starlette(routes=[*admin.routes(model, model_name),
                                     Route("/metrics", self._metrics, methods=["GET"]),
                                     Route("/v1/models/{rest:path}", self._models, methods=["GET", "POST"])],
                             exception_handlers={404: self._not_found, 405: self._not_allowed},
                             lifespan=self._lifespan)

    def _read_signature_def(self):
        """The export's signature as TF Serving's metadata API shows it (from saved_model.pb)."""
        try:
            from google.protobuf import json_format
            from tensorflow.core.protobuf import saved_model_pb2

            sm = saved_model_pb2.SavedModel()
            with open(os.path.join(self.model.export_dir, "saved_model.pb"), "rb") as f:
                sm.ParseFromString(f.read())
            sig = sm.meta_graphs[0].signature_def[self.signature]
            return json_format.MessageToDict(sig, preserving_proto_field_name=True)
        except Exception as e:  # noqa: BLE001 - metadata is informative; serving goes on without it
            log.warning("cannot read the signature of %s: %s", self.model.export_dir, e)
            return {"inputs": {n: {"dtype": s["dtype"], "shape": s["shape"]} for n, s in self.model.inputs.items()}}

    # -- plumbing
    @staticmethod
    def _json(obj, status=200):
        from starlette.responses import Response

        return Response(json.dumps(obj, allow_nan=True), status_code=status, media_type="application/json")

    def _error(self, status, message):
        self.metrics.request_errors.labels(code=str(status)).inc()
        return self._json({"error": message}, status)

    async def _not_found(self, request, exc):
        return self._error(404, f"no such endpoint: {request.method} {request.url.path}")

    async def _not_allowed(self, request, exc):
        return self._error(405, f"method {request.method} not allowed on {request.url.path}")

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        task = asyncio.create_task(self._refresh_loop())
        try:
            yield
        finally:
            task.cancel()

    async def _refresh_loop(self):
        from starlette.concurrency import run_in_threadpool

        while True:
            await asyncio.sleep(self.refresh_every_s)
            try:
                await run_in_threadpool(self.metrics.refresh)
            except Exception as e:  # noqa: BLE001 - metrics must not stop the server
                log.warning("metrics refresh failed: %r", e)

    async def _read_body(self, request):
        n = request.headers.get("content-length")
        if n is not None:
            if not n.isdigit():
                raise RequestError(400, f"bad Content-Length {n!r}")
            if int(n) > self.max_request_bytes:
                raise RequestError(413, f"request body of {n} bytes exceeds the limit of "
                                        f"{self.max_request_bytes} bytes (--max-request-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise RequestError(413, f"request body exceeds the limit of {self.max_request_bytes} bytes "
                                        "(--max-request-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    # -- endpoints
    async def _metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import Response

        return Response(await run_in_threadpool(self.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    def _status(self, version):
        return {"model_version_status": [{"version": str(version), "state": "AVAILABLE",
                                          "status": {"error_code": "OK", "error_message": ""}}]}

    async def _models(self, request):
        m = _MODEL_PATH.match(request.url.path)
        if m is None:
            return self._error(404, f"no such endpoint: {request.method} {request.url.path}")
        name, version, label, tail = m["name"], m["version"], m["label"], m["tail"]
        want = f"Specific({name}, {version})" if version else f"Label({name}, {label})" if label else f"Latest({name})"
        served = self.model.version or 0
        if name != self.model_name or label is not None or (version is not None and version != str(served)):
            return self._error(404, f"Servable not found for request: {want} (serving {self.model_name!r} "
                                    f"version {served})")
        if tail == ":predict":
            if request.method != "POST":
                return self._error(405, f"{request.url.path} takes POST")
            return await self._predict(request, version)
        if request.method != "GET":
            return self._error(405, f"{request.url.path} takes GET")
        if tail == "/metadata":
            return self._json({"model_spec": {"name": name, "signature_name": "", "version": str(served)},
                               "metadata": {"signature_def": {"signature_def": {self.signature:
                                                                                self._signature_def}}}})
        return self._json(self._status(served))

    async def _predict(self, request, version):
        from starlette.concurrency import run_in_threadpool

        t0 = time.perf_counter()
        try:
            body = await self._read_body(request)
            answer = await run_in_threadpool(self._predict_sync, body, version)
        except RequestError as e:
            return self._error(e.status, e.message)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            log.exception("predict failed")
            return self._error(500, f"predict failed: {type(e).__name__}: {e}")
        self.metrics.predict_latency.observe(time.perf_counter() - t0)
        from starlette.responses import Response

        return Response(answer, media_type="application/json")

    def _predict_sync(self, body, version):
        import tensorflow as tf

        arrays, fmt = parse_predict_request(body, self.model.inputs, self.signature)
        try:
            outputs, served = self.model.predict(arrays)
        except (ValueError, tf.errors.InvalidArgumentError) as e:
            raise RequestError(400, f"the model refused the inputs: {e}") from None
        if version is not None and str(served or 0) != version:
            raise RequestError(404, f"Servable not found for request: Specific({self.model_name}, {version}) "
                                    f"(version {served} is served now)")
        return json.dumps(format_predict_response(outputs, fmt), allow_nan=True).encode()


# ---- the process -------------------------------------------------------------
def _bind(host, port):
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(export_dir, checkpoint_root=None, host="127.0.0.1", port=8501, model_name="default", poll_every=1.0,
          max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, storage_options=None, out=sys.stdout, allow_empty=False):
    """Loads the export, applies the newest chain, polls `checkpoint_root`
    every `poll_every` seconds and serves until SIGTERM / SIGINT (then stops
    polling, finishes requests in flight and returns 0).

    Prints `serving <name> version <v> on http://<host>:<port>` to `out` once
    the socket listens (with port=0 the printed port is the one bound).

    Raises NothingToServeError (a ValueError, one line) when `checkpoint_root`
    does not exist or has nothing the export serves, unless `allow_empty`.
    """
    import uvicorn

    from serving_loader.model import ServingModel

    if isinstance(poll_every, bool) or not isinstance(poll_every, (int, float)) or not poll_every > 0 \
            or not math.isfinite(poll_every):
        raise ValueError(f"poll_every must be a positive number of seconds, got {poll_every!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    model = ServingModel(export_dir, checkpoint_root, storage_options=storage_options, allow_empty=allow_empty)
    app = ServingApp(model, model_name=model_name, max_request_bytes=max_request_bytes, refresh_every_s=poll_every)
    # The loaded model leaves a large heap of long-lived Python objects (TF,
    # Keras, the restored graph); a full garbage collection walks all of them
    # and stalls every request for hundreds of milliseconds (measured ~0.4 s
    # here). Frozen, they are skipped by every later collection.
    gc.collect()
    gc.freeze()
    sock = _bind(host, port)
    config = uvicorn.Config(app.app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)

    # uvicorn captures SIGINT/SIGTERM while it serves, shuts down gracefully
    # and then re-raises the signal to the handler that was installed before:
    # ours only asks to exit, so the process ends with status 0.
    def _exit(signum, frame):
        server.should_exit = True

    previous = {s: signal.signal(s, _exit) for s in (signal.SIGINT, signal.SIGTERM)}
    if checkpoint_root is not None:
        model.start(every_s=poll_every)
    try:
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
        print(f"serving {model_name} version {model.version or 0} on http://{shown}:{bound[1]}", file=out,
              flush=True)
        server.run(sockets=[sock])
    finally:
        model.stop()
        sock.close()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def cli(args):
    """`evstore serve` (arguments parsed by evstore_app.cli)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one line per poll otherwise
    try:
        return serve(args.export, args.checkpoints, host=args.host, port=args.port, model_name=args.model_name,
                     poll_every=args.poll_every, max_request_bytes=args.max_request_bytes,
                     allow_empty=args.allow_empty)
    except (ValueError, OSError) as e:
        from serving_loader.model import NothingToServeError

        hint = " (--allow-empty serves the export as it is)" if isinstance(e, NothingToServeError) else ""
        print(f"evstore serve: {e}{hint}", file=sys.stderr)
        return 2
