"""A small HTTP/1.1 server on asyncio, for the serving REST API.

Why not a framework: every error, down to a malformed request line or
Content-Length, must be answered with a JSON body ({"error": ...}), and the
per-request cost must stay small beside the model's own (BENCHMARKS.md,
"Serving": the REST layer against the signature call). Framing is llhttp's (through httptools); the
connection (serving_loader.http_connection) adds limits, in-order answers to
pipelined requests, bounded output, `Expect: 100-continue` and an idle
timeout, and hands each request to a `Router` (serving_loader.http_routing).
"""
import asyncio

from serving_loader.http_connection import DEFAULT_IDLE_TIMEOUT_S, MAX_HEADER_BYTES, HttpConnection, HttpLimits
from serving_loader.http_routing import Request, Response, Router, error_response, json_response

__all__ = ["Request", "Response", "Router", "HttpServer", "HttpLimits", "json_response", "error_response",
           "MAX_HEADER_BYTES", "DEFAULT_IDLE_TIMEOUT_S"]


class HttpServer:
    """Serves `router` on a bound socket in the running asyncio loop.

    `max_body`: largest request body in bytes (413 past it).
    `on_response(status)` is called for each answer (metrics).
    `idle_timeout_s`: a connection with no bytes in, no answer drained and no
    request in progress for this long is closed (None: never).
    """

    def __init__(self, router, max_body, on_response=None, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S):
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be a positive number of seconds or None, got {idle_timeout_s!r}")
        self.router = router
        self.limits = HttpLimits(max_body, max_header_bytes=MAX_HEADER_BYTES, idle_timeout_s=idle_timeout_s)
        self.on_response = on_response or (lambda status: None)
        self.connections = set()
        self.stopping = False
        self._server = None

    @property
    def max_body(self):
        return self.limits.max_body

    async def start(self, sock):
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HttpConnection(self), sock=sock)

    async def stop(self, grace_s=10.0):
        """Stops accepting, lets requests in flight finish (up to `grace_s`), closes idle connections."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy or c.queue for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
