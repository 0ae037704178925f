"""Requests, responses and routing of the serving HTTP layer (independent of
the wire: serving_loader.http_connection frames requests, this module says
what answers them).

Routes: `Router.add(methods, pattern, handler)` with a regular expression
matched against the whole path (case-sensitive unless the pattern says
otherwise); `handler(request)` returns a `Response`, or an awaitable of one
(a coroutine or an asyncio future). A handler raising `ServingError` is
answered with its status and {"error": message}; any other exception with
500. Paths no route takes go to the router's `fallback`.
"""
import logging
import re

import orjson

from serving_loader.tfs import ServingError

__all__ = ["Request", "Response", "Router", "json_response", "error_response", "exception_response",
           "MAX_ERROR_CHARS"]

log = logging.getLogger("evstore.serving")

# An error message echoes client input (a name, a value); past this many
# characters it is cut, so a hostile request cannot make its answer large.
MAX_ERROR_CHARS = 4096


class Request:
    """One parsed request: method and target as sent (path and query split at
    the first "?"), version ("1.1" / "1.0"), headers {lower-case name: value
    (latin-1 text)}, body bytes; `match` is the route's regex match."""

    __slots__ = ("method", "target", "path", "query", "version", "headers", "body", "match", "keep_alive")

    def __init__(self, method, target, version, headers, body=b"", keep_alive=True):
        self.method = method
        self.target = target
        path, _, query = target.partition("?")
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.body = body
        self.match = None
        self.keep_alive = keep_alive


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status=200, body=b"", content_type="application/json", headers=None):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers or ()


def json_response(obj, status=200):
    return Response(status, orjson.dumps(obj))


def error_response(status, message):
    """{"error": message} with `status`; a message longer than MAX_ERROR_CHARS is cut there."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message)} characters)"
    try:
        return Response(status, orjson.dumps({"error": message}))
    except orjson.JSONEncodeError:   # a lone surrogate echoed from the request: shown escaped
        return Response(status, orjson.dumps({"error": message.encode("utf-8", "backslashreplace").decode()}))


def exception_response(e, request):
    """The answer to exception `e` raised by the handler of `request`."""
    if isinstance(e, ServingError):
        return error_response(e.http_status, e.message)
    log.exception("request %s %s failed", request.method, request.path[:200], exc_info=e)
    return error_response(500, f"{type(e).__name__}: {e}")


class Router:
    """Routes by path (regex, full match) and method; see the module docstring."""

    def __init__(self, fallback=None):
        self._routes = []
        self.fallback = fallback or (lambda request: error_response(
            404, f"no such endpoint: {request.method} {request.path}"))

    def add(self, methods, pattern, handler):
        self._routes.append((frozenset(m.upper() for m in methods), re.compile(pattern), handler))

    def resolve(self, request):
        allowed = set()
        for methods, regex, handler in self._routes:
            m = regex.fullmatch(request.path)
            if m is None:
                continue
            if request.method in methods:
                request.match = m
                return handler
            allowed |= methods
        if allowed:
            return lambda request: error_response(
                405, f"method {request.method} not allowed on {request.path} (allowed: {', '.join(sorted(allowed))})")
        return self.fallback
