"""`evstore serve`: TF Serving's REST and gRPC APIs and Prometheus metrics over a ServingModel.

REST (TF Serving's paths and behaviour, https://www.tensorflow.org/tfx/serving/api_rest;
request / answer formats in serving_loader.tfs):
  POST /v1/models/<name>[/versions/<v>|/labels/<l>]:predict | :classify | :regress
  GET  /v1/models/<name>[/versions/<v>|/labels/<l>]            model status
  GET  /v1/models/<name>[/versions/<v>|/labels/<l>]/metadata   signatures
  GET  /metrics     Prometheus text format (one registry per server)
Hold and roll back (serving_loader.admin) are on the admin listener
(serving_loader.admin_listener: its own socket, 127.0.0.1 by default), not here.
Any other /v1/ request is TF Serving's 400 "Malformed request"; paths outside
/v1/ and the routes added to `ServingApp.router` are 404. Every error is
answered with a JSON body {"error": message}, down to a malformed request
line, header or Content-Length (serving_loader.httpserver).

gRPC: tensorflow.serving.PredictionService (Predict, Classify, Regress,
GetModelMetadata) and ModelService.GetModelStatus (serving_loader.grpc_service).

Versions: the version is the checkpoint sequence number served ("0" while no
checkpoint is applied yet); versions replaced in this process are listed as
END in the status.

Threads: one asyncio loop frames HTTP requests, parses JSON (orjson) and
protos, and writes answers; predictions of the default signature go to the
Batcher (serving_loader.batching), whose thread calls the model once per batch
under its read lock; other signatures run in the loop's executor.
ServingModel polls the checkpoint root on its own apscheduler thread; metrics
are copied from its counters at each scrape and every poll interval.
"""
import asyncio
import concurrent.futures
import errno
import gc
import logging
import math
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse

import numpy as np
import uvloop

from serving_loader import admin, admin_listener, fleet_metrics
from serving_loader.batching import Batcher, BatchingOptions, cancelled_by_client, deadline_exceeded
from serving_loader.gate import Gate, GateState
from serving_loader.gate import register_metrics as gate_metrics
from serving_loader.httpserver import (DEFAULT_IDLE_TIMEOUT_S, HttpServer, Response, Router, error_response,
                                      json_response)
from serving_loader.tfs import (CLASSIFY_METHOD, REGRESS_METHOD, Servable, ServingError, format_classify_json,
                                format_predict_json, format_regress_json, missing_name_message, parse_examples_json,
                                parse_predict_json)

log = logging.getLogger("evstore.serving")

__all__ = ["ServingApp", "ServingMetrics", "serve", "DEFAULT_MAX_REQUEST_BYTES", "PortError"]

DEFAULT_MAX_REQUEST_BYTES = 10 * 2**20
_LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0)
_FRESHNESS_BUCKETS = (.1, .25, .5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# TF Serving's REST path rules (http_rest_api_util.cc), case-insensitive
_PREDICT_PATH = re.compile(r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
                           r":(classify|regress|predict)")
_STATUS_PATH = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
                          r"(?:/(metadata))?")


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
        # A tiered serving table's cache (docs/guides/tiered-storage.md), since the table was loaded: a
        # reload or rollback starts a new table, so these are gauges.
        self.tier = {f: Gauge(f"evstore_serving_tier_{f}", help_, ["table"], registry=r) for f, help_ in (
            ("cache_hits", "Row reads of a tiered serving table answered from its DRAM cache"),
            ("cache_misses", "Row reads of a tiered serving table that read its disk tier"),
            ("cache_rows", "Rows of a tiered serving table in its DRAM cache"),
            ("cache_capacity", "Rows a tiered serving table's DRAM budget holds at the served precision"),
            ("disk_bytes", "Bytes of a tiered serving table's row file on disk"))}
        self.predict_latency = Histogram("evstore_serving_predict_latency_seconds", "Predict request time "
                                         "(parse, model, encode) of answered requests", registry=r,
                                         buckets=_LATENCY_BUCKETS)
        self.request_errors = Counter("evstore_serving_request_errors", "Refused or failed requests by HTTP "
                                      "status", ["code"], registry=r)
        self.grpc_calls = Counter("evstore_serving_grpc_calls", "gRPC calls answered, by method and status "
                                  "code (OK included)", ["method", "code"], registry=r)
        self.batches = Counter("evstore_serving_batches", "Model calls of the predict batcher", registry=r)
        self.batched = Counter("evstore_serving_batched_requests", "Requests answered by the predict batcher "
                               "(batched_requests / batches = mean requests per model call)", registry=r)
        self.batcher = None      # set by ServingApp when it batches
        self._seen_batches = self._seen_tasks = 0
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
        b = self.batcher
        if b is not None:
            batches, tasks = b.batches, b.tasks
            self.batches.inc(batches - self._seen_batches)
            self.batched.inc(tasks - self._seen_tasks)
            self._seen_batches, self._seen_tasks = batches, tasks
        self.version.set(-1 if m.version is None else m.version)
        for name, n in m.rows().items():
            self.rows.labels(table=name).set(n)
        for name, st in m.tier_stats().items():
            for field, v in st.items():
                self.tier[field].labels(table=name).set(v)

    def exposition(self):
        from prometheus_client import generate_latest

        self.refresh(wait=True)   # a scrape waits for an apply in progress: its counts are current
        return generate_latest(self.registry)


# ---- the application ----------------------------------------------------------------
class ServingApp:
    """TF Serving's REST API (and the model calls gRPC shares) for `model` (a
    ServingModel) served as `model_name`.

    `router` (serving_loader.httpserver.Router) holds the routes: add more
    with `app.router.add(methods, path_regex, handler)` (a handler takes a
    Request and returns a Response or an awaitable of one); a path no route
    takes goes to TF Serving's API under /v1/, else is 404.
    `batching`: BatchingOptions, or None to call the model once per request.
    `idle_timeout_s`: an idle connection is closed after this many seconds
    (None: never; serving_loader.httpserver). `admin_http` serves the admin
    routes (serving_loader.admin_listener), behind `admin_token` if given.
    """

    def __init__(self, model, model_name="default", max_request_bytes=DEFAULT_MAX_REQUEST_BYTES,
                 refresh_every_s=1.0, batching=None, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S, admin_token=None):
        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
        self.model = model
        self.model_name = model_name
        self.servable = Servable(model, model_name)
        self.max_request_bytes = max_request_bytes
        self.refresh_every_s = refresh_every_s
        self.metrics = ServingMetrics(model)
        self.batcher = Batcher(self._run_default, batching) if batching is not None else None
        self.metrics.batcher = self.batcher
        # TF Serving's API takes every /v1/ path no route takes (routes added later win over it)
        self.router = Router(fallback=self._unrouted)
        self.router.add(["GET"], r"/metrics", self.metrics_response)
        admin.register_metrics(self.metrics.registry, model)
        if getattr(model, "gate", None) is not None:
            gate_metrics(self.metrics.registry, model)
        fleet_metrics.register_metrics(self.metrics.registry, model)
        self.http = HttpServer(self.router, max_request_bytes, on_response=self._count, idle_timeout_s=idle_timeout_s)
        self.admin_http = HttpServer(admin_listener.admin_router(self, admin_token), admin.MAX_BODY,
                                     idle_timeout_s=idle_timeout_s)
        self._loop = None
        # Model calls that skip the batcher (signatures other than the default, or batching off), for
        # REST and gRPC alike; its threads start on first use.
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="model")

    # -- model calls (shared with gRPC)
    def _run(self, key, arrays):
        import tensorflow as tf

        try:
            return self.model.run(key, arrays)
        except (tf.errors.InvalidArgumentError, ValueError, TypeError) as e:
            raise ServingError("INVALID_ARGUMENT", f"the model refused the inputs: {e}") from None

    def _run_default(self, arrays):
        return self._run(self.servable.default_signature, arrays)

    def close(self):
        """Stops the batcher (after the batches queued) and the model-call pool."""
        if self.batcher is not None:
            self.batcher.stop()
        self._pool.shutdown(wait=False)

    def call_model(self, key, arrays, done, deadline=None, cancelled=None):
        """Calls signature `key` on `arrays` and then `done(value, error)` on
        the thread that ran it: value = (outputs, version), or error = the
        exception. The default signature goes through the batcher, others run
        on a small thread pool. A call still waiting at `deadline`
        (time.monotonic(); None: none) is not run: its error is
        DEADLINE_EXCEEDED; nor is one whose `cancelled()` (None: never) is
        then true: its error is CANCELLED. Raises ServingError when the
        batcher refuses the task (never calls `done` then)."""
        if self.batcher is not None and key == self.servable.default_signature:
            self.batcher.submit(arrays, callback=done, deadline=deadline, cancelled=cancelled)
            return

        def run():
            try:
                if deadline is not None and time.monotonic() >= deadline:
                    raise deadline_exceeded()
                if cancelled is not None and cancelled():
                    raise cancelled_by_client()
                value = self._run(key, arrays)
            except Exception as e:  # noqa: BLE001 - handed to done
                done(None, e)
                return
            done(value, None)

        self._pool.submit(run)

    def submit(self, key, arrays):
        """A future (of the running loop) of (outputs, version) of signature
        `key` on `arrays`; the default signature goes through the batcher."""
        loop = asyncio.get_running_loop()
        if self.batcher is not None and key == self.servable.default_signature:
            return self.batcher.submit(arrays, loop)
        return loop.run_in_executor(self._pool, self._run, key, arrays)

    def warm_up(self):
        """Calls each predict signature once on a one-example batch of zeros
        (empty strings), so the first client does not pay TensorFlow's first
        call; a signature that refuses zeros is skipped."""
        from serving_loader.model import zero_example

        for key, inputs in self.servable.inputs.items():
            if self.servable.signature_defs[key].method_name not in ("", "tensorflow/serving/predict"):
                continue
            arrays = zero_example({n: (dtype, shape or [1]) for n, (dtype, shape, _) in inputs.items()})
            try:
                self._run(key, arrays)
            except Exception as e:  # noqa: BLE001 - a warm-up only
                log.info("warm-up of signature %r skipped: %s", key, e)

    # -- plumbing
    def _count(self, status):
        if status >= 400:
            self.metrics.request_errors.labels(code=str(status)).inc()

    async def refresh_loop(self):
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.refresh_every_s)
            try:
                await loop.run_in_executor(None, self.metrics.refresh)
            except Exception as e:  # noqa: BLE001 - metrics must not stop the server
                log.warning("metrics refresh failed: %r", e)

    async def metrics_response(self, request):
        """GET /metrics: the Prometheus text of this server's registry."""
        from prometheus_client import CONTENT_TYPE_LATEST

        text = await asyncio.get_running_loop().run_in_executor(None, self.metrics.exposition)
        return Response(200, text, CONTENT_TYPE_LATEST)

    # -- TF Serving's /v1 API
    def _unrouted(self, request):
        if request.path[:4].lower() == "/v1/":
            return self._v1(request)
        raise ServingError("NOT_FOUND", f"no such endpoint: {request.method} {request.path}")

    def _v1(self, request):
        path, method = request.path, request.method
        if method == "POST":
            m = _PREDICT_PATH.fullmatch(path)
            if m is not None:
                name, version, label = _model_spec(m)
                return getattr(self, "_" + m.group(4).lower())(request, name, version, label)
        elif method == "GET":
            m = _STATUS_PATH.fullmatch(path)
            if m is not None:
                name, version, label = _model_spec(m)
                if not name:
                    raise ServingError("INVALID_ARGUMENT", missing_name_message(self.model_name))
                if m.group(4):
                    self.servable.check_spec(name, version, label)
                    return json_response(self.servable.metadata_json())
                return json_response(self.servable.status_json(name, version, label))
        raise ServingError("INVALID_ARGUMENT", f"Malformed request: {method} {path}")

    def _predict(self, request, name, version, label):
        t0 = time.perf_counter()
        self.servable.check_spec(name, version, label)
        key, arrays, fmt = parse_predict_json(request.body, self.servable)
        return self._answer(self.submit(key, arrays), version, t0,
                            lambda outputs: format_predict_json(outputs, fmt))

    def _classify(self, request, name, version, label):
        return self._examples(request, name, version, label, CLASSIFY_METHOD)

    def _regress(self, request, name, version, label):
        return self._examples(request, name, version, label, REGRESS_METHOD)

    def _examples(self, request, name, version, label, method):
        t0 = time.perf_counter()
        self.servable.check_spec(name, version, label)
        sig, examples = parse_examples_json(request.body, method)
        key = self.servable.signature(sig, method)
        (input_name,) = self.servable.inputs[key]
        arrays = {input_name: np.array(examples, dtype=object)}
        return self._answer(self.submit(key, arrays), version, t0,
                            lambda outputs: _format_examples(outputs, method))

    def _answer(self, fut, version, t0, fmt):
        """A future of the Response for model call `fut`."""
        out = asyncio.get_running_loop().create_future()

        def done(f):
            if out.cancelled():
                return
            try:
                outputs, served = f.result()
                if version is not None and (served or 0) != version:
                    raise ServingError("NOT_FOUND", f"Servable not found for request: Specific({self.model_name}, "
                                                    f"{version})")
                resp = Response(200, fmt(outputs))
            except ServingError as e:
                resp = error_response(e.http_status, e.message)
            except Exception as e:  # noqa: BLE001
                log.exception("predict failed")
                resp = error_response(500, f"predict failed: {type(e).__name__}: {e}")
            else:
                self.metrics.predict_latency.observe(time.perf_counter() - t0)
            out.set_result(resp)

        fut.add_done_callback(done)
        return out


def _model_spec(m):
    name = urllib.parse.unquote(m.group(1)) if m.group(1) else ""
    version = None
    if m.group(2):
        version = int(m.group(2))
        if version >= 2 ** 63:
            raise ServingError("INVALID_ARGUMENT", f"Failed to convert version: {m.group(2)} to numeric.")
    label = urllib.parse.unquote(m.group(3)) if m.group(3) else None
    return name, version, label


def _format_examples(outputs, method):
    if method == CLASSIFY_METHOD:
        scores, classes = outputs.get("scores"), outputs.get("classes")
        if scores is None and classes is None:
            raise ServingError("INVALID_ARGUMENT", "classification signature has neither 'classes' nor 'scores'")
        return format_classify_json(None if scores is None else scores.reshape(scores.shape[0], -1),
                                    None if classes is None else classes.reshape(classes.shape[0], -1))
    if "outputs" not in outputs:
        raise ServingError("INVALID_ARGUMENT", "regression signature has no 'outputs'")
    return format_regress_json(outputs["outputs"])


# ---- the process ---------------------------------------------------------------------
class PortError(OSError):
    """A port `serve` cannot listen on (in use, not permitted, no such address);
    the message names the API, the address and the argument that moves it."""


# serve()'s listeners: the API and its port argument (serve's keyword, `evstore serve`'s flag, TF Serving's name)
_PORT_ARGS = {"REST": "rest_api_port", "admin": "admin_port", "gRPC": "port"}


def _bind(host, port, api):
    """A socket bound to host:port, not yet listening (a client's connect is
    refused until `listen`, so it never waits on a server still loading):
    PortError naming `api`'s port argument when the address cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        err = PortError(f"{api} port {port} on {_shown(host)} {reason}: --{_PORT_ARGS[api]} chooses another, "
                        f"-1 turns {api} off")
        err.errno = e.errno
        raise err from None
    sock.setblocking(False)
    return sock


def _shown(host):
    return f"[{host}]" if ":" in host else host


def serve(export_dir, checkpoint_root=None, host="127.0.0.1", port=8500, rest_api_port=8501, model_name="default",
          poll_every=1.0, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, batching=BatchingOptions(),
          storage_options=None, out=sys.stdout, allow_empty=False, intra_op_parallelism=0, inter_op_parallelism=0,
          grpc_idle_timeout_s=None, gate=None, gate_min_examples=None, gate_max_hold_commits=None,
          gate_max_hold_s=None, gate_past_max_hold="hold", admin_port=None, admin_host="127.0.0.1",
          admin_token=None, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S, tier=None, use_serving_view=True, shards=None,
          shard_token=None, shard_tls_ca=None):
    """Loads the export, applies the newest chain, polls `checkpoint_root`
    every `poll_every` seconds and serves REST on `rest_api_port` and gRPC on
    `port` (TF Serving's flags; 0: any free port; None: that API off; a build
    without the gRPC front end serves REST only and logs a warning, and
    refuses gRPC alone with ValueError) until
    SIGTERM / SIGINT (then stops polling, finishes requests in flight and
    returns 0 after SIGTERM, 130 after SIGINT / Ctrl-C, the shell's
    convention for an interrupted command).

    Prints `serving <name> version <v> on http://<host>:<rest port>`, then
    `admin <name> on http://<admin host>:<admin port>`, then `grpc <name> on
    <host>:<port>` to `out` once the sockets listen (with port 0 the printed
    port is the one bound). The ports are checked before the model loads: one
    that cannot be bound (in use, say) is a PortError (an OSError) naming the
    API, the address and the flag that moves it. The admin listener (serving_loader.admin_listener)
    binds `admin_host` on `admin_port` (None: admin_listener.default_port of
    the REST port; -1: none), behind bearer `admin_token` if given (a
    non-loopback `admin_host` without one is a ValueError). `idle_timeout_s`:
    REST and admin connections idle this long are closed (None: never). `batching`: BatchingOptions,
    or None to call the model once per request. `intra_op_parallelism`,
    `inter_op_parallelism`: TensorFlow's two thread pools, as TF Serving's
    --tensorflow_intra_op_parallelism / --tensorflow_inter_op_parallelism
    (0: TensorFlow's choice); they must be set before TensorFlow has run
    anything in this process (ValueError otherwise). `grpc_idle_timeout_s`:
    a gRPC connection that sends nothing for this long with no call in
    progress is closed (None: grpc_service.DEFAULT_IDLE_TIMEOUT_S; 0: never).
    `gate`: a quality gate expression (serving_loader/gate.py; "default": its
    DEFAULT_GATE), refused with GateError (a ValueError) before anything loads; commits are
    judged on runs of at least `gate_min_examples` examples (None: evstore.gate.DEFAULT_MIN_EXAMPLES);
    a hold past `gate_max_hold_commits` commits or `gate_max_hold_s` seconds (None: no bound) is
    reported as overdue and, with `gate_past_max_hold="serve"`, ends by serving the newest commit
    (GateState's arguments). `tier`: an
    evstore.TieredStorage for an export of evstore tables (ServingModel's
    `storage`): each table's rows in a DRAM cache over a private directory,
    removed when serve returns. `use_serving_view`: serve a commit's serving
    view when it has one (False: its float32 rows; ServingModel's argument).
    `shards`: "host:port,..." of serving shards (replicas of one joined by
    "|"; serving_loader/front.py): this server is their front (an export of
    evstore tables; the sharded EVs' rows come from the shards, the others'
    are held here in DRAM); `shard_token`: the fleet's token sent to them;
    `shard_tls_ca`: PEM of the CA of the shards' TLS certificates.
    """
    from serving_loader.model import ServingModel

    if isinstance(poll_every, bool) or not isinstance(poll_every, (int, float)) or not poll_every > 0 \
            or not math.isfinite(poll_every):
        raise ValueError(f"poll_every must be a positive number of seconds, got {poll_every!r}")
    for what, p in (("port", port), ("rest_api_port", rest_api_port)):
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 65535):
            raise ValueError(f"{what} must be an integer in [0, 65535], got {p!r}")
    if port is None and rest_api_port is None:
        raise ValueError("serve needs a gRPC port or a REST port (or both)")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    if gate is not None:
        gate = GateState(Gate.parse(gate, min_examples=gate_min_examples), max_hold_commits=gate_max_hold_commits,
                         max_hold_s=gate_max_hold_s, past_max_hold=gate_past_max_hold)
    port = _grpc_port_served(port, rest_api_port)
    if admin_port is None:
        admin_port = admin_listener.default_port(rest_api_port)
    if admin_port != -1:
        if isinstance(admin_port, bool) or not isinstance(admin_port, int) or not 0 <= admin_port <= 65535:
            raise ValueError(f"admin_port must be an integer in [0, 65535] or -1, got {admin_port!r}")
        admin_listener.check_exposure(admin_host, admin_token)
    _set_tf_threads(intra_op_parallelism, inter_op_parallelism)
    # The ports are taken (REST, admin) or checked (gRPC, which the native front end binds) before
    # the model loads: a port in use is one line at once, not after the load.
    socks, model, app = [], None, None
    try:
        rest_sock = _bind(host, rest_api_port, "REST") if rest_api_port is not None else None
        socks.append(rest_sock)
        admin_sock = _bind(admin_host, admin_port, "admin") if admin_port != -1 else None
        socks.append(admin_sock)
        if port:   # 0: any free port
            _bind(host, port, "gRPC").close()
        if shards is not None:
            from serving_loader.front import FrontModel
            from serving_loader.shard_client import parse_addresses

            if tier is not None:
                raise ValueError("a front holds its small EVs in DRAM; --tiered-dram-bytes is the shards' (--shard)")
            model = FrontModel(export_dir, checkpoint_root, parse_addresses(shards), storage_options=storage_options,
                               allow_empty=allow_empty, gate=gate, token=shard_token, tls_ca=shard_tls_ca)
        else:
            model = ServingModel(export_dir, checkpoint_root, storage_options=storage_options,
                                 allow_empty=allow_empty, gate=gate, storage=tier, use_serving_view=use_serving_view)
        app = ServingApp(model, model_name=model_name, max_request_bytes=max_request_bytes,
                         refresh_every_s=poll_every, batching=batching, idle_timeout_s=idle_timeout_s,
                         admin_token=admin_token)
        # The loaded model leaves a large heap of long-lived Python objects (TF,
        # Keras, the restored graph); a full garbage collection walks all of them
        # and stalls every request meanwhile. Frozen, they are skipped by every
        # later collection.
        app.warm_up()
        gc.collect()
        gc.freeze()
        for sock in socks:
            if sock is not None:
                sock.listen(1024)
        # uvloop: libuv's event loop and transports behind asyncio's API, which cost the REST
        # server less CPU per request than asyncio's own (bench/LOG.md).
        return uvloop.run(_serve_async(app, model, rest_sock, admin_sock, host, port, checkpoint_root, poll_every,
                                       out, grpc_idle_timeout_s))
    finally:
        for sock in socks:
            if sock is not None:
                sock.close()
        if app is not None:
            app.close()
        if model is not None:
            model.close()


async def _serve_async(app, model, rest_sock, admin_sock, host, port, checkpoint_root, poll_every, out,
                       grpc_idle_timeout_s):
    from serving_loader.grpc_service import DEFAULT_IDLE_TIMEOUT_S as GRPC_IDLE_TIMEOUT_S
    from serving_loader.grpc_service import start_grpc

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received = []
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, lambda s=s: (received.append(s), stop.set()))
    grpc_server = grpc_port = None
    if port is not None:
        idle = GRPC_IDLE_TIMEOUT_S if grpc_idle_timeout_s is None else grpc_idle_timeout_s
        grpc_server, grpc_port = start_grpc(app, host, port, idle)
    if rest_sock is not None:
        await app.http.start(rest_sock)
    if admin_sock is not None:
        await app.admin_http.start(admin_sock)
    refresh = asyncio.create_task(app.refresh_loop())
    if checkpoint_root is not None:
        model.start(every_s=poll_every)
    try:
        if rest_sock is not None:
            bound = rest_sock.getsockname()
            print(f"serving {app.model_name} version {model.version or 0} on http://{_shown(bound[0])}:{bound[1]}",
                  file=out, flush=True)
        if admin_sock is not None:
            bound = admin_sock.getsockname()
            print(f"admin {app.model_name} on http://{_shown(bound[0])}:{bound[1]}", file=out, flush=True)
        if grpc_server is not None:
            print(f"grpc {app.model_name} on {_shown(host)}:{grpc_port}", file=out, flush=True)
        await stop.wait()
    finally:
        model.stop()
        refresh.cancel()
        await app.http.stop(grace_s=10.0)
        await app.admin_http.stop(grace_s=1.0)
        if grpc_server is not None:
            await loop.run_in_executor(None, grpc_server.stop, 10.0)
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)
    return 130 if signal.SIGINT in received else 0


def _grpc_port_served(port, rest_api_port):
    """`port`, or None when the gRPC front end is not built (REST goes on, with
    a warning); ValueError when gRPC is the only API asked for."""
    from serving_loader.native import GRPC_FRONTEND_MISSING, grpc_frontend_built

    if port is None or grpc_frontend_built():
        return port
    if rest_api_port is None:
        raise ValueError(f"cannot serve gRPC on port {port}: {GRPC_FRONTEND_MISSING}")
    log.warning("gRPC port %d not served, REST only: %s", port, GRPC_FRONTEND_MISSING)
    return None


def _set_tf_threads(intra, inter):
    import tensorflow as tf

    threading_ = tf.config.threading
    for name, n, setter in (("intra_op_parallelism", intra, threading_.set_intra_op_parallelism_threads),
                            ("inter_op_parallelism", inter, threading_.set_inter_op_parallelism_threads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0: TensorFlow's choice), got {n!r}")
        if n:
            try:
                setter(n)
            except RuntimeError as e:   # TensorFlow's context already runs
                raise ValueError(f"{name} must be set before TensorFlow runs anything in this process: {e}") from None
    log.info("TensorFlow threads: intra-op %d, inter-op %d (0: TensorFlow's choice)",
             threading_.get_intra_op_parallelism_threads(), threading_.get_inter_op_parallelism_threads())
