"""Saves to a root that is not a local filesystem stream every file into it
(checkpoint/object_sink.py): nothing is written on the saving host, a commit
holds no temporary object, a failed save leaves none, and the chain restores
bit for bit. memory:// is the fsspec filesystem here (the same calls as s3://,
which tests/multihost and tests/cluster/test_cluster_s3.py run on moto); the
host's writes are traced with inotify (tests/hosts.py WriteTrace)."""
import os
import tempfile
import uuid

import fsspec
import pytest
import tensorflow as tf

import checkpoint
from hosts import WriteTrace
from test_ckpt_string_keys import _assert_same, _chain, _ev, _step


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """(a WriteTrace of this process's temp directory and working directory, nothing in them yet)."""
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    trace = WriteTrace()
    trace.watch("tmp", str(tmp))
    trace.watch("cwd", str(cwd))
    yield trace
    trace.close()


def _written(trace):
    trace.sync()
    return {h: sorted(files) for h, files in trace.written.items() if files}


def _admit(ev):
    _step(ev, [1, 2, 3], 1, 1)   # admitted, one Adam step


def _objects(root):
    fs, path = fsspec.core.url_to_fs(root)
    return [p[len(path.lstrip("/")) + 1:].lstrip("/") for p in fs.find(path)]


def test_a_string_keyed_chain_streams_into_a_remote_root_writes_nothing_locally_and_restores_bit_for_bit(traced):
    root = f"memory://sink-{uuid.uuid4().hex}"
    ev = _ev()
    _chain(root, ev)   # a full and two deltas: string key columns, filtered and deleted keys
    assert _written(traced) == {}
    objects = _objects(root)
    assert not [o for o in objects if ".sink-" in o], objects   # every temporary key was renamed
    assert sum(o.endswith("MANIFEST.json") for o in objects) == 3
    back = _ev()
    checkpoint.CheckpointManager(root, back).restore()
    _assert_same(ev, back)


def test_a_serving_view_is_streamed_with_the_bundle(traced):
    root = f"memory://sink-{uuid.uuid4().hex}"
    ev = _ev(key_dtype=tf.int64)
    mgr = checkpoint.CheckpointManager(root, ev, serving_view="int8")
    _admit(ev)
    seq = mgr.save_full()
    assert _written(traced) == {}
    m = mgr.storage.read_manifest(f"full-{seq:010d}")
    assert any(n.startswith("serving.") for n in m.files) and m.serving_view == {"dtype": "int8"}
    assert sorted(o.split("/")[-1] for o in _objects(root) if "/full-" in "/" + o) == sorted([*m.files, "MANIFEST.json"])


def test_a_save_failing_after_its_bundle_streamed_leaves_no_object_and_loses_nothing(traced, monkeypatch):
    root = f"memory://sink-{uuid.uuid4().hex}"
    ev = _ev(key_dtype=tf.int64)
    mgr = checkpoint.CheckpointManager(root, ev)
    _admit(ev)
    monkeypatch.setenv("EVSTORE_FAILPOINT", "before-manifest:raise")
    with pytest.raises(OSError, match="simulated"):
        mgr.save_full()
    assert not [o for o in _objects(root) if "full-" in o], _objects(root)
    monkeypatch.delenv("EVSTORE_FAILPOINT")
    mgr.save_full()   # the failed save's changes are in this one
    assert _written(traced) == {}
    back = _ev(key_dtype=tf.int64)
    checkpoint.CheckpointManager(root, back).restore()
    _assert_same(ev, back)
