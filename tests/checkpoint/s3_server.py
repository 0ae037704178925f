"""moto's standalone S3 server as a real process on 127.0.0.1, with a fresh
bucket, for the tests whose checkpoint root is on S3. The AWS_* variables
point at it while it runs (children inherit them: serving replicas reach the
same server), and are restored after."""
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log):
    """Starts moto's server with its output to the open file `log`; returns
    (process, endpoint URL) once it answers. RuntimeError if it does not
    within 60 s (the process is killed)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start (exit {proc.poll()})")
            time.sleep(0.2)


@contextlib.contextmanager
def moto_bucket(log_path, before_stop=None):
    """Starts the server (its output to `log_path`), creates a bucket and
    yields its name; `before_stop()` runs while the server still answers."""
    import fsspec

    log = open(log_path, "w")
    proc, endpoint = start_server(log)
    env = dict(ENV, AWS_ENDPOINT_URL=endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.filesystem("s3").clear_instance_cache()
    bucket = f"evstore-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    try:
        yield bucket
    finally:
        if before_stop is not None:
            before_stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fsspec.filesystem("s3").clear_instance_cache()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
