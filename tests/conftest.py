"""Shared pytest setup: quiet TensorFlow's C++ logging before it is imported, make the shared
test helpers importable by name from every test directory, and run the `long` tests first.

`ckpt_model` (tests/checkpoint/ckpt_model.py: the small deterministic training
job of the checkpoint and serving tests, also run as a subprocess script) and
`served` (tests/serving_loader/served.py: serving processes and exports for
the serving tests), `serve_proc` (the `evstore` command and helpers over a
server process), `s3_server` (moto's S3 server with a fresh bucket), `hosts` (every task on
a host of its own: network and mount namespaces) and `host_cluster` (a parameter-server
cluster on those hosts) are registered here, loaded lazily on first use, so `from
ckpt_model import make_model` works in any test module without editing sys.path.
"""
import importlib.util
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS = os.path.dirname(os.path.abspath(__file__))
SHARED = {"ckpt_model": os.path.join(TESTS, "checkpoint", "ckpt_model.py"),
          "served": os.path.join(TESTS, "serving_loader", "served.py"),
          "serve_proc": os.path.join(TESTS, "serving_loader", "serve_proc.py"),
          "s3_server": os.path.join(TESTS, "checkpoint", "s3_server.py"),
          "hosts": os.path.join(TESTS, "hosts.py"),
          "host_cluster": os.path.join(TESTS, "host_cluster.py")}


def _register_lazily(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)   # runs the module's code on first attribute access


for _name, _path in SHARED.items():
    if _name not in sys.modules:
        _register_lazily(_name, _path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Tests marked `long` (minutes by design) run first: under `make test`'s
    workers (pytest-xdist, one file per worker at a time) the rest of the suite
    runs beside them instead of after them."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
