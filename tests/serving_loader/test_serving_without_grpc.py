"""`evstore serve` from a build without the gRPC front end (libnghttp2 missing
when it was built): REST is served and the log says gRPC is not; asking for
gRPC alone is refused with a message saying what to install.

The build is a real copy of the source tree without
serving_loader/native/_grpc_frontend*.so, served as a real process.
"""
import glob
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_S = 240   # TensorFlow import + SavedModel load on a busy machine


@pytest.fixture(scope="module")
def tree_without_grpc(tmp_path_factory):
    """(copy of the packages without the gRPC front end's library, a serving export)."""
    import serving_loader
    from ckpt_model import make_model, train   # tests/checkpoint, registered by tests/conftest.py

    tree = tmp_path_factory.mktemp("no_grpc")
    for pkg in ("evstore", "checkpoint", "serving_loader", "evstore_app"):
        shutil.copytree(os.path.join(ROOT, pkg), tree / pkg,
                        ignore=shutil.ignore_patterns("_grpc_frontend*", "__pycache__", "*.cc", "*.h"))
    assert not glob.glob(str(tree / "serving_loader" / "native" / "_grpc_frontend*"))
    model = make_model()
    train(model, 0, 2)
    export = str(tree / "export")
    serving_loader.export_serving_model(model, export)
    return tree, export


def _serve(tree, export, *ports):
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen([sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, *ports],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serves_rest_and_says_grpc_is_not_served(tree_without_grpc):
    tree, export = tree_without_grpc
    proc = _serve(tree, export, "--port", "0", "--rest_api_port", "0", "--model_name", "ctr")
    try:
        line = proc.stdout.readline()   # "serving ctr version 0 on http://127.0.0.1:<port>"
        assert line.startswith("serving ctr"), line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models/ctr", timeout=60) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "grpc " not in out
    assert "gRPC port 0 not served, REST only" in err
    assert "libnghttp2-dev" in err


def test_grpc_alone_is_refused_with_what_to_install(tree_without_grpc):
    tree, export = tree_without_grpc
    proc = _serve(tree, export, "--port", "0", "--rest_api_port", "-1")
    out, err = proc.communicate(timeout=STARTUP_S)
    assert proc.returncode == 1
    assert "cannot serve gRPC on port 0" in err
    assert "libnghttp2-dev" in err
