"""The admin listener: hold and roll back (serving_loader.admin) and the
metrics, on a socket of their own, away from TF Serving's API.

`evstore serve` binds it to --admin_host (default 127.0.0.1: only this
machine reaches it) on --admin_port. With a token (--admin_token_file), every
request must carry `Authorization: Bearer <token>`, compared in constant time
(hmac.compare_digest), else it is answered 401; binding it to an address
other than loopback without a token is refused at start, so the admin
routes are never open to the network. `evstore serve-admin` is its client.

Routes (JSON bodies, errors {"error": message}): serving_loader.admin.PATH
(status, pin, resume, rollback) and GET /metrics (the same Prometheus text as
on the REST port); any other path is 404.
"""
import asyncio
import hmac
import ipaddress

from serving_loader import admin
from serving_loader.httpserver import Response, Router, error_response, json_response

__all__ = ["admin_router", "read_token", "check_exposure", "default_port", "is_loopback", "MIN_TOKEN_CHARS"]

MIN_TOKEN_CHARS = 16


def default_port(rest_api_port):
    """The admin port when none is given: 8502 beside TF Serving's default REST
    port 8501 (or with no REST port); with any other REST port, any free port
    (0, printed at start), so servers given their own ports never collide on it."""
    return 8502 if rest_api_port in (8501, None) else 0


def is_loopback(host):
    """True for an address only this machine reaches (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path, what="admin"):
    """The `what` token (admin, or a sharded fleet's shard token) in file
    `path` (surrounding whitespace dropped); ValueError when it cannot be read
    or has fewer than MIN_TOKEN_CHARS characters."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} token file {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the {what} token in {path} must be at least {MIN_TOKEN_CHARS} characters without "
                         "whitespace")
    return token


def check_exposure(host, token):
    """ValueError when the admin listener would be reachable from the network without a token."""
    if token is None and not is_loopback(host):
        raise ValueError(f"the admin listener on {host} (not loopback) needs a token: --admin_token_file FILE "
                         "(or keep the default --admin_host 127.0.0.1)")


def admin_router(app, token=None):
    """A Router of the admin routes of `app` (a ServingApp), each behind the
    bearer `token` when one is given."""
    expected = None if token is None else f"Bearer {token}".encode()

    def guarded(handler):
        if expected is None:
            return handler

        def check(request):
            got = request.headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(got, expected):
                return Response(401, b'{"error":"the admin listener needs Authorization: Bearer <token>"}',
                                headers=(("WWW-Authenticate", 'Bearer realm="evstore-admin"'),))
            return handler(request)
        return check

    async def run_admin(request):
        status, answer = await asyncio.get_running_loop().run_in_executor(
            None, admin.handle, app.model, app.model_name, request.method, request.path, request.body or b"")
        return json_response(answer, status)

    router = Router(fallback=guarded(lambda request: error_response(
        404, f"no such endpoint: {request.method} {request.path} (this is the admin listener)")))
    router.add(["GET"], r"/metrics", guarded(app.metrics_response))
    router.add(["GET", "POST", "PUT", "DELETE", "PATCH"], admin.PATH, guarded(run_admin))
    return router
