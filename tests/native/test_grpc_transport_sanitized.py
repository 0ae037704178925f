"""The gRPC transport (serving_loader/native/grpc_transport.h) built with
AddressSanitizer + UndefinedBehaviorSanitizer, as a process of its own
(tests/native/grpc_transport_driver.cc: no Python, no model), driven with
hostile HTTP/2 and gRPC input on real sockets. Each class of input is
followed by an echo call that must come back whole; the test fails on any
sanitizer report, a crash or a non-zero exit."""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRANSPORT = REPO / "serving_loader" / "native"
DRIVER = Path(__file__).resolve().parent / "grpc_transport_driver.cc"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None or not Path("/usr/include/nghttp2/nghttp2.h").exists(),
                                reason="g++ or libnghttp2-dev not found")

SANITIZED = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"]
IDLE_S = 0.5   # the driver's idle timeout


def _h2():
    import h2.config
    import h2.connection

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    return conn


def _headers(path, *extra):
    return [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"), (":path", path),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra]


def _framed(message, flag=0):
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


def _feed(conn, bodies):
    """Queues on `conn` as much of `bodies` ({stream: [bytes, end_stream]}) as
    its flow-control windows allow (the rest stays in `bodies`)."""
    for sid, body in list(bodies.items()):
        data, end = body
        n = min(len(data), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
        while n > 0 or (not data and end):
            conn.send_data(sid, data[:n], end_stream=end and n == len(data))
            data = data[n:]
            if not data:
                break
            n = min(len(data), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
        body[0] = data
        if not data:
            del bodies[sid]


def _exchange(port, conn, want_ended=(), until_closed=False, bodies=None):
    """Sends what `conn` has queued and then `bodies` ({stream: [bytes,
    end_stream]}) as windows open; reads until the streams `want_ended` have
    ended (or the server closes). Returns {stream: [headers, body]}."""
    import h2.events

    got, ended, bodies = {}, set(), bodies or {}
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        _feed(conn, bodies)
        sock.sendall(conn.data_to_send())
        while until_closed or not set(want_ended) <= ended:
            data = sock.recv(65536)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.setdefault(ev.stream_id, [{}, b""])[0].update(dict(ev.headers))
                elif isinstance(ev, h2.events.DataReceived):
                    got.setdefault(ev.stream_id, [{}, b""])[1] += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended.add(ev.stream_id)
            _feed(conn, bodies)
            sock.sendall(conn.data_to_send())
    return got


def _call(port, path, message=b"", extra=(), flag=0):
    conn = _h2()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, _headers(path, *extra))
    return _exchange(port, conn, [sid], bodies={sid: [_framed(message, flag), True]}).get(sid, [{}, b""])


def _echo_is_whole(port):
    headers, body = _call(port, "/t.S/Echo", b"alive" * 1000)
    assert headers.get("grpc-status") == "0", headers
    assert body == _framed(b"alive" * 1000)


def _raw(port, data, read=True):
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        if read:
            while s.recv(65536):
                pass


# ---- the hostile classes: each takes the driver's port -------------------------------------------
def long_error_message(port):
    headers, _ = _call(port, "/t.S/Fail", b"m" * 200000)
    assert headers["grpc-status"] == "3"
    assert 0 < len(headers["grpc-message"]) <= 3 * 1024


def long_path(port):
    headers, _ = _call(port, "/t.S/" + "p" * 30000)
    assert headers["grpc-status"] == "3" and len(headers["grpc-message"]) <= 3 * 1024


def long_unknown_encoding(port):
    headers, _ = _call(port, "/t.S/Echo", b"x", extra=[("grpc-encoding", "z" * 30000)], flag=1)
    assert headers["grpc-status"] == "12" and len(headers["grpc-message"]) <= 3 * 1024


def bad_length_prefixes(port):
    for body in (b"", b"\0\0", b"\0\0\0\0\x64abc", b"\0\xff\xff\xff\xffabc", b"\1\0\0\0\1x"):
        conn = _h2()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers("/t.S/Echo"))
        conn.send_data(sid, body, end_stream=True)
        headers, _ = _exchange(port, conn, [sid])[sid]
        assert headers["grpc-status"] != "0", (body, headers)


def over_the_message_cap(port):
    headers, _ = _call(port, "/t.S/Echo", b"x" * ((1 << 20) + 10))
    assert headers["grpc-status"] == "8"


def garbage_and_cut_connections(port):
    _raw(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _raw(port, b"\0" * 5000)
    preface = _h2().data_to_send()
    for cut in (3, 24, len(preface) - 1):
        _raw(port, preface[:cut], read=False)
    conn = _h2()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, _headers("/t.S/Echo"))
    conn.send_data(sid, _framed(b"y" * 16000))   # no end: the connection closes mid-request
    _raw(port, conn.data_to_send(), read=False)


def rapid_reset(port):
    import h2.errors

    conn = _h2()
    for _ in range(500):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers("/t.S/Slow"))
        conn.send_data(sid, _framed(b"z" * 100), end_stream=True)
        conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    _raw(port, conn.data_to_send(), read=False)


def closed_while_at_the_responder(port):
    conn = _h2()
    for _ in range(20):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers("/t.S/Slow"))
        conn.send_data(sid, _framed(b"w" * 100), end_stream=True)
    _raw(port, conn.data_to_send(), read=False)
    time.sleep(0.5)   # answers come for streams and a connection that have gone


def reader_that_never_reads(port):
    conn = _h2()
    for _ in range(10):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers("/t.S/Echo"))
        conn.send_data(sid, _framed(b"r" * 6000), end_stream=True)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(conn.data_to_send())
        time.sleep(4 * IDLE_S)   # answers pile up unread; the idle timeout closes it


def idle_connections(port):
    socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(20)]
    try:
        for s in socks[:10]:
            s.sendall(_h2().data_to_send())
        for s in socks:   # each is closed by the server (recv returns b"" at its end)
            while s.recv(65536):
                pass
    finally:
        for s in socks:
            s.close()


HOSTILE = [long_error_message, long_path, long_unknown_encoding, bad_length_prefixes, over_the_message_cap,
           garbage_and_cut_connections, rapid_reset, closed_while_at_the_responder, reader_that_never_reads,
           idle_connections]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    exe = tmp_path_factory.mktemp("grpc_asan") / "grpc_transport_driver"
    cmd = [GXX, "-std=c++17", *SANITIZED, "-pthread", "-I", str(TRANSPORT), str(DRIVER), "-lnghttp2", "-o", str(exe)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"build failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return exe


def test_the_transport_under_asan_and_ubsan_survives_hostile_input(driver, tmp_path):
    env = dict(os.environ)
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                            env=env)
    try:
        port = int(proc.stdout.readline().split()[1])
        _echo_is_whole(port)
        for hostile in HOSTILE:
            hostile(port)
            assert proc.poll() is None, f"died after {hostile.__name__}"
            _echo_is_whole(port)
        proc.stdin.close()
        out = proc.stdout.read()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    report = err.read()
    assert rc == 0, f"exit {rc}\n{report[-5000:]}"
    assert "Sanitizer" not in report and "runtime error" not in report, report[-5000:]
    cancelled, skipped = int(out.split()[1]), int(out.split()[3])
    assert cancelled + skipped > 0, out   # the reset calls were dropped, not answered
