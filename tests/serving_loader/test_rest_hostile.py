"""The REST port against hostile clients: raw sockets sending what a well-behaved
client never does. Each class of input gets a clean answer (4xx with a JSON
body {"error": ...}, or the connection closed where the client gave nothing
to answer) in bounded memory and CPU per byte, and after each the server
still answers a correct predict with the right values."""
import json
import os
import socket
import time

import pytest
import tensorflow as tf

import serving_loader
from served import Server

IDLE_S = 3          # the server's --rest_idle_timeout_s here
STRINGS = {"inputs": {"text": ["abc", "hello"], "scale": [[1, 2], [3, 4]]}}


class Strings(tf.Module):
    """A model with a string input and a float input: answers are computable here."""

    def __call__(self, x):
        text, scale = x
        return {"length": tf.strings.length(text), "scaled": scale * 1.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    export = str(tmp / "export")
    serving_loader.export_serving_model(Strings(), export, input_signature=[
        tf.TensorSpec([None], tf.string, name="text"), tf.TensorSpec([None, 2], tf.float32, name="scale")])
    s = Server(str(tmp), export, name="strings", extra=["--rest_idle_timeout_s", str(IDLE_S)])
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(autouse=True)
def still_correct(server):
    """After each hostile input: the server lives and answers a correct predict with the right values."""
    yield
    assert server.proc.poll() is None, "the server exited"
    status, body = server.predict(STRINGS)
    assert status == 200, body
    assert body["outputs"] == {"length": [3, 5], "scaled": [[1.5, 3.0], [4.5, 6.0]]}


# ---- raw HTTP helpers -------------------------------------------------------------------
def _connect(server):
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)


def _read_all(sock):
    got = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


def _answers(data):
    """[(status, {header: value}, body bytes)] of the HTTP/1.1 answers in `data`, in order."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"incomplete answer: {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(headers["content-length"])
        out.append((int(lines[0].split(" ")[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def _exchange(server, data):
    """The answers to `data` sent on one new connection, read until the server closes it."""
    with _connect(server) as s:
        s.sendall(data)
        return _answers(_read_all(s))


def _json_error(answer, status):
    got, headers, body = answer
    assert got == status, (got, body[:300])
    assert headers["content-type"] == "application/json"
    doc = json.loads(body)
    assert list(doc) == ["error"] and isinstance(doc["error"], str) and doc["error"], doc
    return doc["error"]


def _post(path, body, extra=b"", close=True):
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s%s\r\n%s"
            % (path.encode(), len(body), extra, b"Connection: close\r\n" if close else b"", body))


def _chunked_post(path, chunks_wire, close=True):
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n%s\r\n"
            % (path.encode(), b"Connection: close\r\n" if close else b"")) + chunks_wire


def _predict_body(doc):
    return json.dumps(doc).encode()


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def _cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- pipelining and output -------------------------------------------------------------------
def test_a_thousand_pipelined_requests_in_one_send_are_all_answered_in_order(server):
    """A predict (answered when the model has run), 998 status requests (answered
    at once, one after the other) and a last predict closing the connection."""
    status = b"GET /v1/models/strings HTTP/1.1\r\nHost: x\r\n\r\n"
    body = _predict_body(STRINGS)
    data = _post("/v1/models/strings:predict", body, close=False) + status * 998 + _post("/v1/models/strings:predict",
                                                                                       body)
    answers = _exchange(server, data)
    assert len(answers) == 1000
    assert all(a[0] == 200 for a in answers)
    assert [i for i, (_, _, body) in enumerate(answers) if b'"outputs"' in body] == [0, 999]


def test_a_client_that_pipelines_and_never_reads_is_stopped_being_read(server):
    """64 MiB of pipelined predicts from a client that reads no answer: the
    server stops reading once its unsent output or its waiting requests pass
    a bound, so its memory stays put and the client's sends block."""
    one = _post("/v1/models/strings:predict", _predict_body(STRINGS), close=False)
    count = 64 * 2**20 // len(one)
    before = _rss_kb(server.proc.pid)
    data, sent = one * count, 0
    with _connect(server) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        deadline = time.monotonic() + 120
        try:
            while sent < len(data) and time.monotonic() < deadline:
                sent += s.send(data[sent:sent + (1 << 16)])
        except (TimeoutError, ConnectionResetError, BrokenPipeError):   # not read any more / the idle timeout
            pass
        grown_mb = (_rss_kb(server.proc.pid) - before) / 1024
    # what the kernel buffers (this socket's send buffer, the server's receive buffer) is at most ~10 MiB
    assert sent < 16 * 2**20, f"the server read {sent >> 20} MiB from a client that reads nothing"
    assert grown_mb < 32, f"the server's memory grew by {grown_mb:.0f} MB for a client that never reads"


# ---- bodies ----------------------------------------------------------------------------------
def _one_byte_chunks(body):
    return b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"


def test_a_chunked_body_in_one_byte_chunks_costs_cpu_linear_in_its_size(server):
    """CPU for 1 MiB in 1-byte chunks against 256 KiB: about 4x when linear, 16x when quadratic."""
    def cost(size):
        doc = _predict_body(STRINGS)
        body = doc[:-1] + b" " * (size - len(doc)) + doc[-1:]
        wire = _chunked_post("/v1/models/strings:predict", _one_byte_chunks(body))
        t0 = _cpu_s(server.proc.pid)
        answers = _exchange(server, wire)
        assert [a[0] for a in answers] == [200], answers[:1]
        return _cpu_s(server.proc.pid) - t0

    small = min(cost(256 * 1024) for _ in range(2))
    big = cost(1024 * 1024)
    assert big < 8 * max(small, 0.05), (small, big)


def test_a_trailer_line_that_never_ends_is_refused(server):
    with _connect(server) as s:
        s.sendall(_chunked_post("/v1/models/strings:predict", b"2\r\n{}\r\n0\r\nX-Trailer: "))
        for _ in range(32):     # 2 MiB of one trailer line, 64 KiB at a time
            try:
                s.sendall(b"a" * 65536)
            except (ConnectionResetError, BrokenPipeError):
                break
        answers = _answers(_read_all(s))
    assert "trailer" in _json_error(answers[0], 400)


def test_many_trailer_lines_are_bounded_in_total(server):
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(2000))
    answers = _exchange(server, _chunked_post("/v1/models/strings:predict", b"2\r\n{}\r\n0\r\n" + trailers + b"\r\n"))
    assert "trailer" in _json_error(answers[0], 400)


def test_a_header_line_that_never_ends_is_431(server):
    with _connect(server) as s:
        s.sendall(b"GET /v1/models/strings HTTP/1.1\r\nX-Long: ")
        for _ in range(32):
            try:
                s.sendall(b"a" * 65536)
            except (ConnectionResetError, BrokenPipeError):
                break
        answers = _answers(_read_all(s))
    _json_error(answers[0], 431)


def test_too_many_header_bytes_is_431(server):
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(1000))
    _json_error(_exchange(server, b"GET /v1/models/strings HTTP/1.1\r\n" + headers + b"\r\n")[0], 431)


# ---- strict framing --------------------------------------------------------------------------
@pytest.mark.parametrize("wire", [
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \x0bchunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n" + b"{" * 16
    + b"\r\n0\r\n\r\n",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked, identity\r\n\r\n",
    b"GET /v1/models/strings HTTP/1.1\nHost: x\n\n",
    b"GET /v1/models/strings HTTP/1.1\r\nHost : x\r\n\r\n",
    b"GET /v1/models/strings HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
    b"CONNECT 127.0.0.1:80 HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["TE-vertical-tab", "chunk-0x", "chunk-underscore", "chunk-plus", "TE-and-CL", "two-CL", "TE-not-chunked-last",
        "bare-LF", "space-before-colon", "folded-header", "CONNECT"])
def test_lenient_framing_is_refused_400(server, wire):
    answers = _exchange(server, wire)
    assert len(answers) == 1
    _json_error(answers[0], 400)


@pytest.mark.parametrize("line", [b"GET  /v1/models/strings HTTP/1.1", b"GET /v1/models/strings  HTTP/1.1",
                                  b"GET /v1/models/strings HTTP/1.1 ", b" GET /v1/models/strings HTTP/1.1"],
                         ids=["two-spaces-after-method", "two-spaces-before-version", "trailing-space",
                              "leading-space"])
def test_a_request_line_with_other_than_one_space_between_its_parts_is_400(server, line):
    answers = _exchange(server, line + b"\r\nHost: x\r\n\r\n")
    assert len(answers) == 1
    assert "Malformed HTTP request" in _json_error(answers[0], 400)


def test_a_malformed_request_line_pipelined_behind_a_good_request_is_400_after_its_answer(server):
    good = b"GET /v1/models/strings HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = _exchange(server, _post("/v1/models/strings:predict", _predict_body(STRINGS), close=False)
                        + good + b"GET  /v1/models/strings HTTP/1.1\r\nHost: x\r\n\r\n" + good)
    assert [a[0] for a in answers] == [200, 200, 400]   # the request after the refused one is not read
    assert "request line" in _json_error(answers[2], 400)


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"compress , chunked"])
def test_a_transfer_coding_the_server_does_not_implement_is_501(server, coding):
    answers = _exchange(server, b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %s\r\n"
                                b"\r\n2\r\n{}\r\n0\r\n\r\n" % coding)
    assert len(answers) == 1
    assert "not implemented" in _json_error(answers[0], 501)


def test_chunked_applied_twice_is_400(server):
    answers = _exchange(server, b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\n"
                                b"Transfer-Encoding: chunked, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert len(answers) == 1
    _json_error(answers[0], 400)


def test_a_request_smuggled_behind_a_refused_one_is_not_answered(server):
    smuggled = b"GET /v1/models/strings HTTP/1.1\r\nHost: x\r\n\r\n"
    wire = (b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: %d\r\n\r\n0\r\n\r\n" % (5 + len(smuggled))) + smuggled
    answers = _exchange(server, wire)
    assert len(answers) == 1
    _json_error(answers[0], 400)


# ---- JSON that a recursive reader chokes on ------------------------------------------------------
def _deep(depth, leaf):
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize("depth", [300, 1000, 100_000])
@pytest.mark.parametrize("where", ["document", "signature_name", "string input"])
def test_deeply_nested_json_is_400(server, where, depth):
    if where == "document":
        body = _deep(depth, "1")
    elif where == "signature_name":
        body = '{"signature_name": %s, "inputs": {"text": ["a"], "scale": [[1, 2]]}}' % _deep(depth, '"x"')
    else:
        body = '{"inputs": {"text": %s, "scale": [[1, 2]]}}' % _deep(depth, '"a"')
    answers = _exchange(server, _post("/v1/models/strings:predict", body.encode()))
    error = _json_error(answers[0], 400)
    assert len(error) < 5000


@pytest.mark.parametrize("scale", ["[[1, 2]]", "[[NaN, 2]]"], ids=["plain", "with-NaN"])
def test_a_lone_surrogate_in_a_string_input_is_400(server, scale):
    body = b'{"inputs": {"text": ["a\\ud800b"], "scale": %s}}' % scale.encode()
    _json_error(_exchange(server, _post("/v1/models/strings:predict", body))[0], 400)


def test_a_lone_surrogate_in_the_signature_name_is_400(server):
    body = b'{"signature_name": "s\\udc00", "inputs": {"text": ["a"], "scale": [[NaN, 2]]}}'
    _json_error(_exchange(server, _post("/v1/models/strings:predict", body))[0], 400)


def test_a_huge_signature_name_is_answered_with_a_bounded_message(server):
    body = _predict_body({"signature_name": "s" * 1_000_000, "inputs": STRINGS["inputs"]})
    error = _json_error(_exchange(server, _post("/v1/models/strings:predict", body))[0], 400)
    assert len(error) < 5000


# ---- idle connections ----------------------------------------------------------------------------
def test_an_idle_connection_is_closed_after_the_idle_timeout(server):
    with _connect(server) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""            # the server closed it: no bytes, end of stream
        assert time.monotonic() - t0 >= IDLE_S * 0.9


def test_an_idle_keep_alive_connection_is_closed_after_its_answers(server):
    with _connect(server) as s:
        s.sendall(b"GET /v1/models/strings HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = _answers(_read_all(s))
    assert [a[0] for a in answers] == [200]


def test_a_request_stalled_half_way_is_answered_408_and_closed(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        answers = _answers(_read_all(s))
    _json_error(answers[0], 408)


# ---- Expect: 100-continue ---------------------------------------------------------------------
def test_expect_100_continue_is_answered_before_the_body_then_the_request(server):
    body = _predict_body(STRINGS)
    with _connect(server) as s:
        s.sendall(b"POST /v1/models/strings:predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(1024)
        assert got == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        (status, _, answer), = _answers(_read_all(s))
    assert status == 200 and json.loads(answer)["outputs"]["length"] == [3, 5]
