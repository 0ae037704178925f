"""A small HTTP/1.1 server on asyncio, for the serving REST API.

Why not a framework: every error, down to a malformed request line or
Content-Length, must be answered with a JSON body ({"error": ...}), and the
per-request cost must stay far below the model's (a predict is a few hundred
microseconds of model time). This layer frames requests (Content-Length or
chunked bodies, keep-alive, pipelining, `Expect: 100-continue`), caps header
and body sizes, and hands each request to a `Router`.

Routes: `Router.add(methods, pattern, handler)` with a regular expression
matched against the whole path (case-sensitive unless the pattern says
otherwise); `handler(request)` returns a `Response`, or an awaitable of one
(a coroutine or an asyncio future). A handler raising `ServingError` is
answered with its status and {"error": message}; any other exception with
500. Paths no route takes go to the router's `fallback`.
"""
import asyncio
import logging
import re

import orjson

from serving_loader.tfs import ServingError

__all__ = ["Request", "Response", "Router", "HttpServer", "json_response", "error_response"]

log = logging.getLogger("evstore.serving")

MAX_HEADER_BYTES = 64 * 1024
_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
            411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 499: "Client Closed Request", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable", 504: "Gateway Timeout",
            505: "HTTP Version Not Supported"}
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class Request:
    __slots__ = ("method", "target", "path", "query", "version", "headers", "body", "match")

    def __init__(self, method, target, version, headers):
        self.method = method
        self.target = target
        path, _, query = target.partition("?")
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers      # {lower-case name: value}
        self.body = b""
        self.match = None


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
    return Response(status, orjson.dumps({"error": message}))


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


class _BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection(asyncio.Protocol):
    """One client connection: requests are answered in order, one at a time."""

    def __init__(self, server):
        self.server = server
        self.transport = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False
        self.head = None          # (Request, body offset, length or -1 for chunked, keep_alive)
        self.continued = False
        self.draining = False

    def connection_made(self, transport):
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc):
        self.closed = True
        self.server.connections.discard(self)

    def data_received(self, data):
        if self.draining:         # answered and closing: what the client still sends is read and dropped
            return
        self.buf += data
        if not self.busy:
            self._process()

    def _process(self):
        while not self.busy and not self.closed:
            try:
                req = self._parse()
            except _BadRequest as e:
                self._write(error_response(e.status, e.message), keep_alive=False)
                return
            if req is None:
                return
            self.busy = True
            self._dispatch(req)

    # -- framing
    def _parse(self):
        if self.head is None:
            while self.buf[:2] == b"\r\n":   # tolerated empty lines between requests
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    raise _BadRequest(431, f"request header exceeds {MAX_HEADER_BYTES} bytes")
                if self.buf and not self.buf[:1].isalpha():
                    raise _BadRequest(400, f"Malformed HTTP request line: {bytes(self.buf[:80])!r}")
                return None
            if end > MAX_HEADER_BYTES:
                raise _BadRequest(431, f"request header exceeds {MAX_HEADER_BYTES} bytes")
            self.head = self._parse_head(bytes(self.buf[:end])) + (end + 4,)
            self.continued = False
        req, length, keep_alive, start = self.head
        if length >= 0:
            if len(self.buf) - start < length:
                self._maybe_continue(req)
                return None
            req.body = bytes(self.buf[start:start + length])
            del self.buf[:start + length]
        else:
            got = self._dechunk(start)
            if got is None:
                self._maybe_continue(req)
                return None
            req.body, used = got
            del self.buf[:used]
        self.head = None
        req.headers["__keep_alive"] = keep_alive
        return req

    def _maybe_continue(self, req):
        if not self.continued and req.headers.get("expect", "").lower() == "100-continue":
            self.continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _parse_head(self, head):
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1] or not parts[2].startswith(b"HTTP/"):
            raise _BadRequest(400, f"Malformed HTTP request line: {lines[0][:200]!r}")
        method, target, version = parts
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise _BadRequest(505, f"HTTP version {version.decode('latin-1')!r} not supported (HTTP/1.1, HTTP/1.0)")
        if not target.startswith(b"/"):
            if target.lower().startswith((b"http://", b"https://")):   # absolute form
                target = b"/" + target.split(b"/", 3)[3] if target.count(b"/") >= 3 else b"/"
            else:
                raise _BadRequest(400, f"Malformed HTTP request target: {target[:200]!r}")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.match(name):
                raise _BadRequest(400, f"Malformed HTTP header line: {line[:200]!r}")
            key = name.decode("latin-1").lower()
            value = value.strip().decode("latin-1")
            if key in headers and key in ("content-length", "transfer-encoding", "host"):
                if key != "content-length" or headers[key] != value:
                    raise _BadRequest(400, f"repeated {key} header")
            headers[key] = value
        te = headers.get("transfer-encoding")
        cl = headers.get("content-length")
        if te is not None:
            if te.lower() != "chunked":
                raise _BadRequest(501, f"Transfer-Encoding {te!r} is not supported (chunked is)")
            if cl is not None:
                raise _BadRequest(400, "both Content-Length and Transfer-Encoding given")
            length = -1
        elif cl is not None:
            if not cl.isdigit() or not cl.isascii():
                raise _BadRequest(400, f"bad Content-Length {cl!r}")
            length = int(cl)
            if length > self.server.max_body:
                raise _BadRequest(413, f"request body of {length} bytes exceeds the limit of "
                                       f"{self.server.max_body} bytes (--max_request_bytes)")
        else:
            length = 0
        conn = headers.get("connection", "").lower()
        keep_alive = "close" not in conn if version == b"HTTP/1.1" else "keep-alive" in conn
        try:
            text = target.decode("ascii")
        except UnicodeDecodeError:
            raise _BadRequest(400, f"Malformed HTTP request target: {target[:200]!r}") from None
        return Request(method.decode("ascii"), text, version.decode("ascii"), headers), length, keep_alive

    def _dechunk(self, pos):
        """(body, bytes used) once a whole chunked body is buffered, else None."""
        buf, body = self.buf, bytearray()
        cap = self.server.max_body
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if len(buf) - pos > 1024:
                    raise _BadRequest(400, "bad chunk size line")
                return None
            size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest(400, f"bad chunk size {size_text[:40]!r}") from None
            if size < 0:
                raise _BadRequest(400, f"bad chunk size {size_text[:40]!r}")
            if len(body) + size > cap:
                raise _BadRequest(413, f"request body exceeds the limit of {cap} bytes (--max_request_bytes)")
            pos = eol + 2
            if size == 0:
                while True:   # trailer fields, then an empty line
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        return None
                    if eol == pos:
                        return bytes(body), eol + 2
                    pos = eol + 2
            if len(buf) < pos + size + 2:
                return None
            if buf[pos + size:pos + size + 2] != b"\r\n":
                raise _BadRequest(400, "chunk data not followed by CRLF")
            body += buf[pos:pos + size]
            pos += size + 2

    def _linger(self):
        """Closes after an answer without losing it: the write side is shut
        (the client reads the answer, then end of stream) while whatever the
        client is still sending (e.g. the rest of a refused body) is read and
        dropped, so the kernel does not reset the connection over unread
        data; the socket closes when the client closes it, or after 5 s."""
        self.draining = True
        self.buf.clear()
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
                asyncio.get_running_loop().call_later(5.0, self.transport.close)
                return
        except (OSError, RuntimeError):
            pass
        self.transport.close()

    # -- dispatch and answer
    def _dispatch(self, req):
        keep_alive = req.headers.pop("__keep_alive")
        try:
            out = self.server.router.resolve(req)(req)
        except Exception as e:  # noqa: BLE001 - answered, the connection lives on
            out = _exception_response(e, req)
        if isinstance(out, Response):
            self._write(out, keep_alive)
            return
        fut = asyncio.ensure_future(out)
        fut.add_done_callback(lambda f: self._done(f, req, keep_alive))

    def _done(self, fut, req, keep_alive):
        try:
            resp = fut.result()
        except Exception as e:  # noqa: BLE001
            resp = _exception_response(e, req)
        except asyncio.CancelledError:
            resp = error_response(503, "the request was cancelled (the server is stopping)")
        self._write(resp, keep_alive)

    def _write(self, resp, keep_alive):
        if self.closed:
            return
        head = (f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Status')}\r\n"
                f"Content-Type: {resp.content_type}\r\nContent-Length: {len(resp.body)}\r\n")
        for k, v in resp.headers:
            head += f"{k}: {v}\r\n"
        if not keep_alive or self.server.stopping:
            head += "Connection: close\r\n"
        self.transport.write(head.encode("latin-1") + b"\r\n" + resp.body)
        self.server.on_response(resp.status)
        if not keep_alive or self.server.stopping:
            self.closed = True
            self._linger()
            return
        self.busy = False
        if self.buf:
            self._process()


def _exception_response(e, req):
    if isinstance(e, ServingError):
        return error_response(e.http_status, e.message)
    log.exception("request %s %s failed", req.method, req.path, exc_info=e)
    return error_response(500, f"{type(e).__name__}: {e}")


class HttpServer:
    """Serves `router` on a bound socket in the running asyncio loop.

    `on_response(status)` is called for each answer (metrics)."""

    def __init__(self, router, max_body, on_response=None):
        self.router = router
        self.max_body = max_body
        self.on_response = on_response or (lambda status: None)
        self.connections = set()
        self.stopping = False
        self._server = None

    async def start(self, sock):
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    async def stop(self, grace_s=10.0):
        """Stops accepting, lets requests in flight finish (up to `grace_s`), closes idle connections."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
