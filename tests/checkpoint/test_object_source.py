"""Restores from a root that is not a local filesystem read every file through
an object source (checkpoint/object_source.py): ranged reads of the object
store straight into the native loader, nothing written on the restoring host
(an inotify trace of its temp and working directories, tests/hosts.py
WriteTrace), exact as from a local root, and a damaged part refused before the
model changes. The root is S3 on moto's server (a process on 127.0.0.1)."""
import zlib

import fsspec
import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import evstore
import serving_loader
from checkpoint import object_source
from checkpoint.errors import CorruptCheckpointError
from checkpoint.bundle import GLOBAL_STEP
from checkpoint.collect import collect
from checkpoint.fetch import bundle_files, fetch
from checkpoint.index import parse_index
from checkpoint.remote_parts import entry_tensors
from checkpoint.tensor_read import read_index
from checkpoint.storage import Storage
from ckpt_model import assert_same_state, make_model, probe_inputs, state, train
from s3_server import moto_bucket
from test_ckpt_sharded import _saved_chain
from test_ckpt_string_keys import _assert_same, _chain, _ev
from test_object_sink import _written, traced  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    """A bucket on a moto S3 server process; AWS_* variables point at it."""
    with moto_bucket(tmp_path_factory.mktemp("moto") / "moto.log", before_stop=checkpoint.lease._release_all) as b:
        yield b


@pytest.fixture
def root(s3_bucket, request):
    """A root of this test's own (parametrized variants differ in the hash)."""
    return f"s3://{s3_bucket}/{request.node.name[:50]}-{zlib.crc32(request.node.name.encode()):08x}"


@pytest.fixture(scope="module")
def two_shards(s3_bucket):
    """(root, model): a chain saved from a 2-shard user table."""
    root = f"s3://{s3_bucket}/two-shards"
    return root, _saved_chain(root, 2)[0]


@pytest.fixture(scope="module")
def unsharded(s3_bucket):
    """(root, CheckpointManager): a chain saved from unsharded tables, never changed by a test."""
    root = f"s3://{s3_bucket}/unsharded"
    return root, _saved_chain(root, None)[1]


@pytest.mark.parametrize("into", [3, None])
def test_a_two_shard_chain_on_s3_restores_into_m_shards_exactly_writing_nothing_locally(two_shards, traced, into):
    root, model = two_shards
    got = make_model(user_shards=into)
    mgr = checkpoint.CheckpointManager(root, got)
    mgr.restore()
    assert_same_state(state(got, logical=True), state(model, logical=True))
    assert _written(traced) == {}
    # within the memory budget every byte was read once: checked, then loaded from memory
    assert 0 < mgr.last_restore_stats["bytes_read"] <= sum(m.total_bytes for m in mgr.chain())


def test_a_string_keyed_chain_restores_from_s3_bit_for_bit_writing_nothing_locally(root, traced):
    ev = _ev()
    _chain(root, ev)   # a full and two deltas: string key columns, filtered and deleted keys
    back = _ev()
    checkpoint.CheckpointManager(root, back).restore()
    _assert_same(ev, back)
    assert _written(traced) == {}


def _damage(path, how):
    fs = fsspec.filesystem("s3")
    data = fs.cat_file(path)
    if how == "missing":
        fs.rm_file(path)
    elif how == "truncated":
        fs.pipe_file(path, data[:len(data) // 2])
    else:   # one byte changed, same size
        fs.pipe_file(path, data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])


def _tensor_bytes(root, mgr, dense):
    """Bytes of the chain's indexes and of every tensor a restore of it needs: each EV entry's, and the
    dense tensors and global step of the newest commit."""
    total = 0
    for m in mgr.chain():
        idx = read_index(Storage(root), m)
        _, entries = parse_index(idx, m.dir)
        last = set(dense) | {GLOBAL_STEP} if m == mgr.chain()[-1] else set()
        needed = set(entry_tensors(m, idx, list(m.evs))) | last
        total += len(idx) + sum(e.size for n, e in entries.items() if n in needed)
    return total


def test_a_restore_reads_each_byte_it_needs_once_with_no_memory_budget(unsharded, traced, monkeypatch):
    root, mgr = unsharded
    monkeypatch.setattr(object_source, "RETAIN_BYTES", 0)   # nothing kept in memory for the loader
    monkeypatch.setattr(object_source, "BLOCK", 256)       # columns of several blocks: one streamed GET each
    got = make_model()
    train(got, 20, 22)   # rows of keys the chain lacks: the restored tables replace them all
    back = checkpoint.CheckpointManager(root, got)
    back.restore()
    assert_same_state(state(got), state(mgr.model))
    needed = _tensor_bytes(root, back, list(collect(got).dense))
    assert back.last_restore_stats["bytes_read"] == needed
    assert needed <= sum(m.total_bytes for m in back.chain())
    assert _written(traced) == {}


@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_a_damaged_remote_part_is_refused_naming_it_before_the_model_changes(unsharded, root, traced, how, monkeypatch):
    monkeypatch.setattr(object_source, "RETAIN_BYTES", 0)   # no file kept in memory: each read once, as it loads
    monkeypatch.setattr(object_source, "BLOCK", 256)       # the damage lies in a column streamed block by block
    fs = fsspec.filesystem("s3")
    fs.copy(Storage(unsharded[0]).path, Storage(root).path, recursive=True)   # a copy of the chain to damage
    full = unsharded[1].chain()[0]
    values = next(n for n in full.files if full.files[n]["size"] > 1000 and ".data-" in n)
    _damage(f"{Storage(root).path}/{full.dir}/{values}", how)
    other = make_model()
    train(other, 0, 2)
    before = state(other)
    with pytest.raises(CorruptCheckpointError, match=values):
        checkpoint.CheckpointManager(root, other).restore()
    assert_same_state(state(other), before)
    assert _written(traced) == {}


def test_a_verified_fetch_reads_each_byte_once_within_the_memory_budget_and_again_beyond_it(unsharded, monkeypatch):
    root, mgr = unsharded
    full = mgr.chain()[0]
    total = sum(full.files[n]["size"] for n in bundle_files(full))
    read = {}
    for budget in (1 << 30, 0):
        monkeypatch.setattr(object_source, "RETAIN_BYTES", budget)
        table = evstore.EmbeddingVariable(f"t{budget}", 8, key_dtype=tf.int64)
        with fetch(Storage(root), full) as f:   # every file checked, then the loader reads the user table
            checkpoint.bundle.load_ev(f.dir, table, "user", full.evs["user"]["slots"], clear=True)
        read[budget] = f.bytes_read
        assert len(table.export()["keys"]) == full.evs["user"]["rows"]
    assert read[1 << 30] == total          # kept in memory when checked: the loader read none again
    assert total < read[0] <= 2 * total    # beyond the budget: what the loader reads, read again


def test_an_evstore_table_server_loads_an_int8_view_from_s3_as_the_stock_server_decodes_it(root, tmp_path, traced):
    model = make_model()
    train(model, 0, 3)
    stock, tables = str(tmp_path / "stock"), str(tmp_path / "evstore")
    serving_loader.export_serving_model(model, stock)
    serving_loader.export_serving_model(model, tables, tables="evstore")
    mgr = checkpoint.CheckpointManager(root, model, serving_view="int8")
    mgr.save_full()
    streamed = serving_loader.ServingModel(tables, root)   # the full streamed from S3 into its tables
    decoded = serving_loader.ServingModel(stock, root)     # named tensors read into memory, decoded
    users, items = probe_inputs()
    got, gv = streamed.predict({"users": users, "items": items})
    want, wv = decoded.predict({"users": users, "items": items})
    assert gv == wv and streamed.serving_view == "int8"
    np.testing.assert_array_equal(got["outputs"], want["outputs"])
    assert traced.checkpoint_writes() == {}   # (TensorFlow's autograph writes its own files)
