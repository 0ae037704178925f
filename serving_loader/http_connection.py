"""One HTTP/1.1 client connection of the serving REST layer.

Framing is llhttp's (Node.js's parser, through httptools): request line,
headers, Content-Length and chunked bodies, keep-alive and pipelining, with
its strict rules (a Transfer-Encoding other than a final "chunked", both
Content-Length and Transfer-Encoding, repeated Content-Length, chunk sizes
other than bare hex, bare LF line ends, whitespace before a colon: all
refused). This class adds what a parser leaves to its user, each answered
with a JSON body {"error": ...} and then the connection closed:

- request line + headers (+ chunked trailers) over `max_header_bytes`: 431
  (a trailer: 400); a single line is bounded too, since bytes that make no
  parsing progress are counted as they arrive;
- a body over `max_body` bytes: 413, from Content-Length before the body is
  read, or while a chunked body streams in;
- an HTTP version other than 1.1 / 1.0: 505; any other framing error: 400;
- a request line other than `method SP request-target SP HTTP-version` with
  one space each (llhttp accepts runs of spaces): 400, so each request line
  is fed to the parser, and checked, whole (a Content-Length body goes in one
  piece, the head and a chunked body line by line);
- a transfer coding other than chunked (`Transfer-Encoding: gzip, chunked`):
  501, as RFC 9112 section 6.1 asks of a coding the server does not
  implement; chunked applied twice: 400.

Requests are answered in order, one at a time: complete requests wait in a
queue, handed to the router by a loop (never by recursion, so a thousand
pipelined requests in one send are a thousand loop turns). Output is
bounded: once the transport's unsent output passes its high-water mark, or
`max_pipelined` requests wait, the connection stops reading until the client
catches up; likewise once the waiting requests' bodies pass `max_body`
bytes. `Expect: 100-continue` is answered when the request is next in
line and its body has not arrived. A connection with no bytes in and no
output drained for `idle_timeout_s` seconds, and no request with the model,
is closed (a request half received is first answered 408).
"""
import asyncio
import collections
import functools
import http

import httptools

from serving_loader.http_routing import Request, Response, error_response, exception_response

__all__ = ["HttpConnection", "HttpLimits", "MAX_HEADER_BYTES", "DEFAULT_IDLE_TIMEOUT_S", "reason_phrase"]

MAX_HEADER_BYTES = 64 * 1024
DEFAULT_IDLE_TIMEOUT_S = 60.0


def reason_phrase(status):
    """The reason phrase of an HTTP status code (http.HTTPStatus's; 499, a client that went away before
    its answer, is nginx's "Client Closed Request")."""
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Status"


class HttpLimits:
    """What one connection may cost.

    max_body: largest request body in bytes (413 past it).
    max_header_bytes: request line + header fields (+ chunked trailer fields) in bytes (431 past it).
    idle_timeout_s: a connection idle this long is closed (None: never).
    max_pipelined: complete requests waiting for their answer before the connection stops reading
      (it also stops once their bodies pass max_body bytes).
    linger_s: after a closing answer, how long the client's further bytes are read and dropped
      (so the kernel does not reset the connection over unread data and lose the answer).
    """

    __slots__ = ("max_body", "max_header_bytes", "idle_timeout_s", "max_pipelined", "linger_s")

    def __init__(self, max_body, max_header_bytes=MAX_HEADER_BYTES, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S,
                 max_pipelined=64, linger_s=5.0):
        self.max_body = max_body
        self.max_header_bytes = max_header_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_pipelined = max_pipelined
        self.linger_s = linger_s


class _Refused(Exception):
    """A request answered with `status` and the connection closed after it."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def _parse_error(e):
    reason = str(e) or type(e).__name__
    if "HTTP version" in reason:
        return _Refused(505, "HTTP version not supported (HTTP/1.1, HTTP/1.0)")
    if isinstance(e, httptools.HttpParserInvalidMethodError):
        return _Refused(400, f"Malformed HTTP request line: {reason}")
    if isinstance(e, httptools.HttpParserInvalidURLError):
        return _Refused(400, f"Malformed HTTP request target: {reason}")
    return _Refused(400, f"Malformed HTTP request: {reason}")


def _check_request_line(line):
    """Raises _Refused(400) unless `line` is `method SP request-target SP HTTP-version CRLF`."""
    parts = line.rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not all(parts):
        raise _Refused(400, f"Malformed HTTP request line: {line[:200]!r} (method, request target and version "
                            "are separated by one space each)")


class HttpConnection(asyncio.Protocol):
    """One client connection of `server` (an HttpServer: router, limits,
    on_response, stopping, connections); see the module docstring."""

    def __init__(self, server):
        self.server = server
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.loop = None
        self.queue = collections.deque()   # complete requests (and a final _Refused) waiting for their answer
        self.queued_bytes = 0              # body bytes of the waiting requests
        self.busy = False                  # the head of the line is with its handler
        self.closed = False                # nothing more is written
        self.stopped = False               # no more requests are read from this connection
        self.reading = True
        self.writing_paused = False
        self.last_active = 0.0
        self._idle = None
        self.progress = False              # a parser callback ran during the current feed
        self.stall = 0                     # bytes fed since the parser last made progress
        self._reset_message()

    def _reset_message(self):
        self.line = b""                    # the next request line, until its LF (None: past it)
        self.body_left = None              # bytes of a Content-Length body still to feed (None: none)
        self.in_message = False
        self.headers_done = False
        self.expecting = False             # Expect: 100-continue not answered yet
        self.url = b""
        self.headers = {}
        self.head_bytes = 0
        self.body = None
        self.body_bytes = 0
        self.request = None

    # -- asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.last_active = self.loop.time()
        self.server.connections.add(self)
        if self.limits.idle_timeout_s is not None:
            self._idle = self.loop.call_later(self.limits.idle_timeout_s, self._idle_check)

    def connection_lost(self, exc):
        self.closed = True
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()

    def pause_writing(self):
        self.writing_paused = True
        self._flow()

    def resume_writing(self):
        self.writing_paused = False
        self.last_active = self.loop.time()
        self._pump()

    def data_received(self, data):
        if self.stopped:           # the last request this connection takes is read: the rest is dropped
            return
        self.last_active = self.loop.time()
        self.progress = False
        try:
            self._feed(data)
        except _Refused as refusal:
            self._refuse(refusal)
        except httptools.HttpParserCallbackError as e:
            refusal = e.__context__
            if not isinstance(refusal, _Refused):
                refusal = _Refused(500, f"{type(refusal).__name__}: {refusal}")
            self._refuse(refusal)
        except httptools.HttpParserUpgrade:
            # CONNECT or an Upgrade header: not spoken here. What came before is
            # answered (a CONNECT's target is refused 400); the connection then closes.
            self.stopped = True
            if self.queue:
                self.queue[-1].keep_alive = False
            else:
                self._refuse(_Refused(400, "protocol upgrade is not supported"))
        except httptools.HttpParserError as e:
            self._refuse(_parse_error(e))
        else:
            if self.progress:
                self.stall = 0
            else:
                self.stall += len(data)
                if self.stall > self.limits.max_header_bytes:
                    self._refuse(_Refused(431, f"request header exceeds {self.limits.max_header_bytes} bytes")
                                 if not self.headers_done else
                                 _Refused(400, f"a chunk line or trailer exceeds {self.limits.max_header_bytes} bytes"))
        self._pump()

    def _feed(self, data):
        """Feeds `data` to the parser: a request line whole (then checked), a
        Content-Length body in one piece, anything else (headers, a chunked
        body) line by line, so the next pipelined request line starts a piece."""
        pos, n = 0, len(data)
        while pos < n and not self.stopped:
            if self.body_left:
                stop = min(n, pos + self.body_left)
                self.body_left -= stop - pos
            else:
                end = data.find(b"\n", pos)
                stop = n if end < 0 else end + 1
            piece = data[pos:stop]
            if self.line is not None:
                self.line += piece
            self.parser.feed_data(piece)
            pos = stop
            if self.line is not None and self.line.endswith(b"\n"):
                line, self.line = self.line, None
                if line.strip():           # empty lines before a request line are ignored (RFC 9112 2.2)
                    _check_request_line(line)
                else:
                    self.line = b""

    # -- parser callbacks (httptools)
    def on_message_begin(self):
        self.progress = True
        self.in_message = True

    def on_url(self, url):
        self.progress = True
        self.url += url
        self._count_head(len(url))

    def on_header(self, name, value):
        self.progress = True
        self._count_head(len(name) + len(value) + 4)
        if self.headers_done:          # a chunked trailer field: counted, then dropped
            return
        key = name.decode("latin-1").lower()
        if key in self.headers and key in ("host", "transfer-encoding"):
            raise _Refused(400, f"repeated {key} header")
        self.headers[key] = value.decode("latin-1")

    def _count_head(self, n):
        self.head_bytes += n
        if self.head_bytes > self.limits.max_header_bytes:
            if self.headers_done:
                raise _Refused(400, f"chunk trailer exceeds {self.limits.max_header_bytes} bytes")
            raise _Refused(431, f"request header exceeds {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self):
        self.progress = True
        self.headers_done = True
        p = self.parser
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):
            raise _Refused(505, f"HTTP version {version!r} not supported (HTTP/1.1, HTTP/1.0)")
        target = self.url
        if not target.startswith(b"/"):
            if target[:8].lower().startswith((b"http://", b"https://")):   # absolute form
                target = b"/" + target.split(b"/", 3)[3] if target.count(b"/") >= 3 else b"/"
            else:
                raise _Refused(400, f"Malformed HTTP request target: {target[:200]!r}")
        try:
            text = target.decode("ascii")
        except UnicodeDecodeError:
            raise _Refused(400, f"Malformed HTTP request target: {target[:200]!r}") from None
        headers = self.headers
        te = headers.get("transfer-encoding")
        if te is not None:
            codings = [c.strip().lower() for c in te.split(",")]
            unknown = [c for c in codings if c != "chunked"]
            if unknown:
                raise _Refused(501, f"transfer coding {unknown[0]!r} is not implemented (only chunked is)")
            if len(codings) > 1:
                raise _Refused(400, f"chunked applied more than once: Transfer-Encoding {te!r}")
        cl = headers.get("content-length")
        if cl is not None and te is None:
            self.body_left = int(cl)
        if cl is not None and int(cl) > self.limits.max_body:    # llhttp checked it is digits
            raise _Refused(413, f"request body of {int(cl)} bytes exceeds the limit of {self.limits.max_body} "
                                f"bytes (--max_request_bytes)")
        self.request = Request(p.get_method().decode("ascii"), text, version, headers)
        self.expecting = (headers.get("expect", "").lower() == "100-continue"
                          and ("transfer-encoding" in headers or (cl is not None and int(cl) > 0)))

    def on_body(self, body):
        self.progress = True
        self.body_bytes += len(body)
        if self.body_bytes > self.limits.max_body:
            raise _Refused(413, f"request body exceeds the limit of {self.limits.max_body} bytes "
                                f"(--max_request_bytes)")
        if self.body is None:           # one piece (the usual Content-Length body): kept as it is
            self.body = body
        elif type(self.body) is bytes:  # more pieces (chunks, reads): one growing buffer, linear in the size
            self.body = bytearray(self.body) + body
        else:
            self.body += body

    def on_message_complete(self):
        self.progress = True
        req = self.request
        body = self.body
        req.body = b"" if body is None else body if type(body) is bytes else bytes(body)
        req.keep_alive = self.parser.should_keep_alive()
        self.queued_bytes += len(req.body)
        self.queue.append(req)
        self._reset_message()

    # -- answering, in order
    def _refuse(self, refusal):
        self.stopped = True
        self.queue.append(refusal)

    def _pump(self):
        """Answers waiting requests in order while the head of the line
        answers at once; an awaited answer resumes this loop from its callback."""
        queue = self.queue
        while queue and not self.busy and not self.closed and not self.writing_paused:
            req = queue.popleft()
            if isinstance(req, _Refused):
                self._send(error_response(req.status, req.message), False)
                break
            self.busy = True
            self.queued_bytes -= len(req.body)
            try:
                out = self.server.router.resolve(req)(req)
            except Exception as e:  # noqa: BLE001 - answered, the connection lives on
                out = exception_response(e, req)
            if type(out) is Response:
                self._send(out, req.keep_alive)
                continue
            fut = asyncio.ensure_future(out)
            fut.add_done_callback(functools.partial(self._done, req))
            break
        if self.expecting and not queue and not self.busy and not self.closed:
            self.expecting = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._flow()

    def _done(self, req, fut):
        try:
            resp = fut.result()
        except asyncio.CancelledError:
            resp = error_response(503, "the request was cancelled (the server is stopping)")
        except Exception as e:  # noqa: BLE001
            resp = exception_response(e, req)
        self._send(resp, req.keep_alive)
        self._pump()

    def _send(self, resp, keep_alive):
        self.busy = False
        if self.closed:
            return
        close = not keep_alive or self.server.stopping
        head = (f"HTTP/1.1 {resp.status} {reason_phrase(resp.status)}\r\n"
                f"Content-Type: {resp.content_type}\r\nContent-Length: {len(resp.body)}\r\n")
        for k, v in resp.headers:
            head += f"{k}: {v}\r\n"
        if close:
            head += "Connection: close\r\n"
        self.transport.write(head.encode("latin-1") + b"\r\n" + resp.body)
        self.last_active = self.loop.time()
        self.server.on_response(resp.status)
        if close:
            self._linger()

    def _flow(self):
        """Reads from the client only while its answers drain and few requests wait."""
        want = (not self.writing_paused and len(self.queue) < self.limits.max_pipelined
                and self.queued_bytes < self.limits.max_body)
        if want != self.reading and not self.closed:
            self.reading = want
            if want:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def _linger(self):
        """Closes after an answer without losing it: the write side is shut
        (the client reads the answer, then end of stream) while whatever the
        client is still sending (e.g. the rest of a refused body) is read and
        dropped; the socket closes when the client closes it, or after
        `linger_s`."""
        self.closed = self.stopped = True
        self.queue.clear()
        if not self.reading:
            self.reading = True
            self.transport.resume_reading()
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(self.limits.linger_s, self.transport.close)
                return
        except (OSError, RuntimeError):
            pass
        self.transport.close()

    def _idle_check(self):
        if self.closed:
            return
        now = self.loop.time()
        due = self.last_active + self.limits.idle_timeout_s
        if self.busy or now < due:
            self._idle = self.loop.call_at(max(due, now + 0.05) if not self.busy
                                           else now + self.limits.idle_timeout_s, self._idle_check)
            return
        if self.writing_paused:         # the client does not read its answers: they are dropped
            self.closed = True
            self.transport.abort()
        elif self.in_message or self.queue:
            self.queue.clear()
            self._send(error_response(408, f"no request bytes for {self.limits.idle_timeout_s:g} s "
                                           "(--rest_idle_timeout_s)"), False)
        else:
            self.closed = True
            self.transport.close()
