"""`evstore serve` as a real subprocess for tests: REST, gRPC and the admin
listener on free ports (port 0; the bound ports are read from its first lines)."""
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

STARTUP_S = 240   # TensorFlow import + SavedModel load on a busy machine
APPLY_S = 120     # a delta to be picked up (the server polls every 0.2 s)


class Server:
    """An `evstore serve` subprocess; `call` speaks REST (`admin_call` to the
    admin listener), `channel()` gRPC."""

    def __init__(self, tmp, export, root=None, name="ctr", extra=(), max_body=None):
        cmd = [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--port", "0",
               "--rest_api_port", "0", "--admin_port", "0", "--model_name", name, "--poll-every", "0.2", *extra]
        if max_body is not None:
            cmd += ["--max-request-bytes", str(max_body)]
        if root is not None:
            cmd += ["--checkpoints", root]
        self.name = name
        self.log = open(os.path.join(tmp, f"serve-{name}-{time.monotonic_ns()}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        deadline = time.time() + STARTUP_S
        self.port = self.grpc_port = self.admin_port = None
        while self.port is None or self.grpc_port is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                line = ""
            if line.startswith("serving "):
                self.port = int(line.rsplit(":", 1)[1])
            elif line.startswith("admin "):       # printed before the grpc line
                self.admin_port = int(line.rsplit(":", 1)[1])
            elif line.startswith("grpc "):
                self.grpc_port = int(line.rsplit(":", 1)[1])
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise AssertionError(f"server did not start: {open(self.log.name).read()[-3000:]}")

    def call(self, method, path, body=None, headers=None, port=None):
        """(HTTP status, parsed JSON or text) of one request (to the REST port, or `port`)."""
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port or self.port}{path}", data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("content-type", "")
        return status, (json.loads(raw) if ctype.startswith("application/json") else raw.decode())

    def admin_call(self, method, path, body=None, headers=None):
        """`call` to the admin listener."""
        return self.call(method, path, body, headers, port=self.admin_port)

    def raw(self, data):
        """Sends raw bytes on a new connection; returns (status, headers text, body bytes) of the answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as s:
            s.sendall(data)
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                head, sep, body = got.partition(b"\r\n\r\n")
                if sep:
                    n = [int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                    if n and len(body) >= n[0]:
                        break
        head, _, body = got.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), head.decode("latin-1"), body

    def predict(self, body, name=None):
        return self.call("POST", f"/v1/models/{name or self.name}:predict", body)

    def version(self):
        status, body = self.call("GET", f"/v1/models/{self.name}")
        assert status == 200, body
        return int(body["model_version_status"][0]["version"])

    def wait_version(self, seq):
        deadline = time.time() + APPLY_S
        while self.version() != seq:
            assert time.time() < deadline, f"server still at version {self.version()}, want {seq}"
            time.sleep(0.1)

    def channel(self):
        import grpc

        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def h2_call(self, path, message, headers=(), flag=0):
        """One gRPC call spoken in raw HTTP/2 (the `h2` library), for what a
        gRPC client never sends (another encoding, an expired grpc-timeout):
        `message` framed with compressed-flag `flag`, `headers` after gRPC's
        own. Returns ({response header: value}, {trailer: value}, body bytes)."""
        return self.h2_calls([(path, message, headers, flag)])[0]

    def h2_calls(self, calls):
        """Calls [(path, message, headers, flag)] on one HTTP/2 connection, all
        sent whole before any is ended (so the server holds them at once), then
        ended in order. Returns h2_call's triple for each, in order."""
        import h2.config
        import h2.connection
        import h2.events

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        sids = []
        for path, message, headers, flag in calls:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"),
                                    (":path", path), ("content-type", "application/grpc"), ("te", "trailers"),
                                    *headers])
            conn.send_data(sid, bytes([flag]) + len(message).to_bytes(4, "big") + message)
            sids.append(sid)
        for sid in sids:
            conn.end_stream(sid)
        got = {sid: [{}, {}, b""] for sid in sids}   # response headers, trailers, body
        ended = set()
        with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=60) as sock:
            sock.sendall(conn.data_to_send())
            while len(ended) < len(sids):
                data = sock.recv(65536)
                assert data, "the server closed the connection before every call ended"
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        got[ev.stream_id][0] = dict(ev.headers)
                    elif isinstance(ev, h2.events.TrailersReceived):
                        got[ev.stream_id][1] = dict(ev.headers)
                    elif isinstance(ev, h2.events.DataReceived):
                        got[ev.stream_id][2] += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        ended.add(ev.stream_id)
                sock.sendall(conn.data_to_send())
        out = []
        for sid in sids:
            response, trailers, body = got[sid]
            out.append((response, trailers or (response if "grpc-status" in response else {}), body))   # trailers-only
        return out

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def serve_ctr(tmp, **server_kw):
    """The checkpoint tests' CTR model trained 3 steps, exported with TF
    Serving's classification and regression signatures, a full checkpoint,
    and a server on them (Server's `extra` / `max_body` from `server_kw`)
    once it serves that full: (model, manager, server). The caller stops the
    server."""
    import checkpoint
    import serving_loader
    from ckpt_model import make_model, train   # tests/checkpoint, registered by tests/conftest.py

    model = make_model()
    train(model, 0, 3)
    export = os.path.join(tmp, "export")
    serving_loader.export_serving_model(model, export, example_signatures=["classify", "regress"])
    mgr = checkpoint.CheckpointManager(os.path.join(tmp, "ckpt"), model)
    mgr.save_full()
    server = Server(tmp, export, os.path.join(tmp, "ckpt"), **server_kw)
    try:
        server.wait_version(mgr.last_committed.seq)
    except BaseException:
        server.stop()
        raise
    return model, mgr, server
