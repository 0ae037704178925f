"""Helpers for tests of the train -> serve path and the admin endpoints: the
`evstore` command as a subprocess, and functions over an `evstore serve`
process (served.Server, re-exported here)."""
import base64
import subprocess
import sys
import time
import urllib.request

import numpy as np

WAIT_S = 120      # an upper bound for a poll to see a commit (a loaded machine is slow)

from served import Server  # noqa: E402,F401 - the serving tests' server process


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


def _json(v):
    """A model input as JSON: numbers as they are, strings as {"b64": ...} (any bytes)."""
    a = np.asarray(v)
    if a.dtype == object or a.dtype.kind == "S":
        return np.vectorize(lambda b: {"b64": base64.b64encode(b).decode()}, otypes=[object])(a).tolist()
    return a.tolist()


def predict_columns(server, columns):
    """The outputs of a columnar predict of `columns` ({input: ndarray})."""
    status, body = server.predict({"inputs": {k: _json(v) for k, v in columns.items()}})
    assert status == 200, body
    return body["outputs"]


def admin(server, action=None, body=None):
    """(status, answer) of GET /v1/models/<name>/admin, or of POST .../admin/<action>, on the admin listener."""
    path = f"/v1/models/{server.name}/admin"
    return server.admin_call("GET", path) if action is None else server.admin_call("POST", f"{path}/{action}",
                                                                                  body or {})


def metrics(server):
    """{sample name: value} of the server's /metrics (unlabelled samples)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
