"""Hold and roll back a served model: the admin REST routes and their metrics
(`evstore serve-admin`, in evstore_app.cli, is their client).

REST (on the admin listener, serving_loader.admin_listener: its own socket,
127.0.0.1 by default, never the public REST port; JSON bodies, errors
{"error": message}):
  GET  /v1/models/<name>/admin             the admin status (ServingModel.admin_status + "retained")
  POST /v1/models/<name>/admin/pin         stop applying new commits
  POST /v1/models/<name>/admin/resume      apply new commits again (catches up before answering)
  POST /v1/models/<name>/admin/rollback    {"version": <seq>, "then": "pin" | "resume"} ("pin" by default):
                                           serve the retained commit <seq>, whole or not at all
Each POST answers the admin status after the operation. `handle` holds the
logic, independent of the HTTP stack (the server routes PATH to it).
Statuses: 400 bad body
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
import re

__all__ = ["handle", "register_metrics", "PATH", "MAX_BODY"]

MAX_BODY = 64 * 1024


PATH = r"/v1/models/(?P<name>[^/:]+)/admin(?:/(?P<action>[^/]*))?"
_PATH = re.compile(PATH)
_ACTIONS = ("pin", "resume", "rollback")


def handle(model, model_name, method, path, body=b""):
    """Answers one admin request: (HTTP status, JSON-able answer), or None when
    `path` is not an admin path. Blocking (it waits for an apply in progress and
    runs the rollback): call it off the event loop. Independent of the HTTP
    stack: a server routes PATH (a regex, full match) here."""
    from serving_loader.model import RollbackError
    from serving_loader.tfs import serving_note

    m = _PATH.fullmatch(path)
    if m is None:
        return None
    name, what = m["name"], m["action"]
    if name != model_name:
        return 404, {"error": f"Servable not found for request: Latest({name}){serving_note(model_name)}"}
    if what is not None and what not in _ACTIONS:
        return 404, {"error": f"no admin action {what!r}; the actions are {', '.join(_ACTIONS)}"}
    want = "GET" if what is None else "POST"
    if method != want:
        return 405, {"error": f"method {method} not allowed on {path} (allowed: {want})"}
    if what is None:
        return 200, _state(model)
    if len(body) > MAX_BODY:
        return 413, {"error": f"admin request body exceeds {MAX_BODY} bytes"}
    try:
        args = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as e:
        return 400, {"error": f"request body is not valid JSON: {e}"}
    if not isinstance(args, dict):
        return 400, {"error": "request body must be a JSON object"}
    allowed = {"version", "then"} if what == "rollback" else set()
    unknown = sorted(set(args) - allowed)
    if unknown:
        return 400, {"error": f"unknown fields {unknown} for {what}; it takes {sorted(allowed)}"}
    try:
        if what == "pin":
            model.pin()
        elif what == "resume":
            if model.storage is None:
                raise RollbackError(409, "no checkpoint root: this server serves its export as it is")
            model.resume()
        else:
            if "version" not in args:
                raise RollbackError(400, 'a rollback names the commit: {"version": <sequence number>}')
            seq = args["version"]
            if isinstance(seq, str) and seq.isdigit():   # TF Serving writes versions as strings
                seq = int(seq)
            model.rollback(seq, args.get("then", "pin"))
    except RollbackError as e:
        return e.status, {"error": e.message}
    return 200, _state(model)


def _state(model):
    return dict(model.admin_status(), retained=model.retained())


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
