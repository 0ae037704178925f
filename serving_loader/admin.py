"""Hold and roll back a served model: the admin REST routes and their metrics
(`evstore serve-admin`, in evstore_app.cli, is their client).

REST (on the serving port, next to TF Serving's API; JSON bodies, errors {"error": message}):
  GET  /v1/models/<name>/admin             the admin status (ServingModel.admin_status + "retained")
  POST /v1/models/<name>/admin/pin         stop applying new commits
  POST /v1/models/<name>/admin/resume      apply new commits again (catches up before answering)
  POST /v1/models/<name>/admin/rollback    {"version": <seq>, "then": "pin" | "resume"} ("pin" by default):
                                           serve the retained commit <seq>, whole or not at all
Each POST answers the admin status after the operation. Statuses: 400 bad body
or argument, 404 unknown model or commit not retained, 409 the operation cannot
be done (no checkpoint root; the commit's chain cannot be staged: still serving
the previous version), 405 wrong method.

Metrics (a collector in the server's registry, read at each scrape):
  evstore_serving_pinned (gauge 1/0), evstore_serving_newest_committed_sequence
  (gauge, -1 none seen), evstore_serving_rollbacks_total,
  evstore_serving_rollback_failures_total, evstore_serving_last_rollback_sequence
  (gauge, -1 none), evstore_serving_last_rollback_seconds (gauge: stage + publish).
"""
import json

__all__ = ["routes", "register_metrics", "MAX_BODY"]

MAX_BODY = 64 * 1024


def _json(obj, status=200):
    from starlette.responses import Response

    return Response(json.dumps(obj), status_code=status, media_type="application/json")


def _state(model):
    return dict(model.admin_status(), retained=model.retained())


def routes(model, model_name):
    """Starlette routes of the admin endpoints for `model` served as `model_name`
    (place them before the catch-all /v1/models route)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.routing import Route

    from serving_loader.model import RollbackError

    def check(request):
        name = request.path_params["name"]
        if name != model_name:
            return _json({"error": f"Servable not found for request: Latest({name}) (serving {model_name!r})"}, 404)
        return None

    async def status(request):
        return check(request) or _json(await run_in_threadpool(_state, model))

    async def action(request):
        bad = check(request)
        if bad:
            return bad
        what = request.path_params["action"]
        if what not in ("pin", "resume", "rollback"):
            return _json({"error": f"no admin action {what!r}; the actions are pin, resume and rollback"}, 404)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return _json({"error": f"admin request body exceeds {MAX_BODY} bytes"}, 413)
        try:
            args = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError) as e:
            return _json({"error": f"request body is not valid JSON: {e}"}, 400)
        if not isinstance(args, dict):
            return _json({"error": "request body must be a JSON object"}, 400)
        allowed = {"version", "then"} if what == "rollback" else set()
        unknown = sorted(set(args) - allowed)
        if unknown:
            return _json({"error": f"unknown fields {unknown} for {what}; it takes {sorted(allowed)}"}, 400)
        try:
            if what == "pin":
                await run_in_threadpool(model.pin)
            elif what == "resume":
                if model.storage is None:
                    raise RollbackError(409, "no checkpoint root: this server serves its export as it is")
                await run_in_threadpool(model.resume)
            else:
                if "version" not in args:
                    raise RollbackError(400, 'a rollback names the commit: {"version": <sequence number>}')
                seq = args["version"]
                if isinstance(seq, str) and seq.isdigit():   # TF Serving writes versions as strings
                    seq = int(seq)
                await run_in_threadpool(model.rollback, seq, args.get("then", "pin"))
        except RollbackError as e:
            return _json({"error": e.message}, e.status)
        return _json(await run_in_threadpool(_state, model))

    async def wrong_method(request):
        return _json({"error": f"method {request.method} not allowed on {request.url.path}"}, 405)

    return [Route("/v1/models/{name}/admin", status, methods=["GET"]),
            Route("/v1/models/{name}/admin", wrong_method, methods=["POST", "PUT", "DELETE", "PATCH"]),
            Route("/v1/models/{name}/admin/{action}", action, methods=["POST"]),
            Route("/v1/models/{name}/admin/{action}", wrong_method, methods=["GET", "PUT", "DELETE", "PATCH"])]


class _Collector:
    """Reads the model's hold / rollback state at each scrape."""

    def __init__(self, model):
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.model
        last = m.last_rollback or {}
        yield GaugeMetricFamily("evstore_serving_pinned", "1 while new commits are not applied (pinned by an "
                                "operator or a rollback), else 0", value=1 if m.pinned else 0)
        yield GaugeMetricFamily("evstore_serving_newest_committed_sequence", "Newest committed sequence seen "
                                "in the checkpoint root (-1: none)",
                                value=-1 if m.newest_committed is None else m.newest_committed)
        yield CounterMetricFamily("evstore_serving_rollbacks", "Rollbacks done (each whole: staged, then "
                                  "published in one step)", value=m.rollbacks)
        yield CounterMetricFamily("evstore_serving_rollback_failures", "Rollbacks that failed (the served "
                                  "state was kept)", value=m.rollback_failures)
        yield GaugeMetricFamily("evstore_serving_last_rollback_sequence", "Commit served by the last rollback "
                                "(-1: none)", value=last.get("to", -1))
        yield GaugeMetricFamily("evstore_serving_last_rollback_seconds", "Stage + publish time of the last "
                                "rollback (0: none)", value=last.get("seconds", 0.0))

    def describe(self):
        return []


def register_metrics(registry, model):
    """Adds the hold / rollback metrics of `model` to a prometheus_client registry."""
    registry.register(_Collector(model))
