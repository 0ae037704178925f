"""Helpers for tests of the train -> serve path and the admin endpoints: the
`evstore` command as a subprocess, and an `evstore serve` process (`Server`,
started on a free port read back from its ready line). Server's interface
(constructor, call, predict, version, stop) is the one the serving tests'
server helper has, so either can drive these tests."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

STARTUP_S = 240   # TensorFlow import + SavedModel load on a busy machine
WAIT_S = 120      # an upper bound for a poll to see a commit (a loaded machine is slow)


def evstore(*args, timeout=600):
    """`python -m evstore_app.cli ARGS` to completion: the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "evstore_app.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def last_line(text):
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def wait_until(cond, what):
    deadline = time.time() + WAIT_S
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def predict_columns(server, columns):
    """The outputs of a columnar predict of `columns` ({input: ndarray})."""
    status, body = server.predict({"inputs": {k: v.tolist() for k, v in columns.items()}})
    assert status == 200, body
    return body["outputs"]


def admin(server, action=None, body=None):
    """(status, answer) of GET /v1/models/<name>/admin, or of POST .../admin/<action>."""
    path = f"/v1/models/{server.name}/admin"
    return server.call("GET", path) if action is None else server.call("POST", f"{path}/{action}", body or {})


def metrics(server):
    """{sample name: value} of the server's /metrics (unlabelled samples)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


class Server:
    """`evstore serve --export EXPORT [--checkpoints ROOT] [EXTRA]` on a free port."""

    def __init__(self, tmp, export, root=None, name="ctr", extra=()):
        cmd = [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--port", "0",
               "--model-name", name, "--poll-every", "0.2", *extra]
        if root is not None:
            cmd += ["--checkpoints", root]
        self.name = name
        self.log = open(os.path.join(tmp, f"serve-{name}-{time.monotonic_ns()}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        deadline = time.time() + STARTUP_S
        while True:
            try:
                found = re.search(r"^serving .* on http://\S+:(\d+)", lines.get(timeout=1))
            except queue.Empty:
                found = None
            if found:
                self.port = int(found[1])
                return
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise AssertionError(f"server did not start: {open(self.log.name).read()[-3000:]}")

    def call(self, method, path, body=None):
        """(HTTP status, parsed JSON answer) of one request."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def predict(self, body):
        return self.call("POST", f"/v1/models/{self.name}:predict", body)

    def version(self):
        status, body = self.call("GET", f"/v1/models/{self.name}")
        assert status == 200, body
        return int(body["model_version_status"][0]["version"])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
