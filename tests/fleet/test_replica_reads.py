"""A serving replica reads and verifies only what it serves:
keys, values, deleted keys, the served dense weights. Never an EV's
versions, frequencies, optimizer slots or counted-not-admitted keys, never
the dense optimizer state; a byte changed in what it reads refuses the commit
(counted once), a byte changed in anything else cannot."""
import os

import numpy as np
import pytest
import tensorflow as tf
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import register_implementation

import checkpoint
import evstore
import serving_loader
from checkpoint.fetch import fetch
from checkpoint.index import data_file, parse_index
from ckpt_model import ev, make_model, probe_inputs, train


class RecordingFileSystem(LocalFileSystem):
    """Local disk under its own protocol (a remote store to evstore) that
    records every file opened and every byte range read through it."""

    protocol = ("recording",)
    root_marker = "/"
    opened = []
    ranges = []

    def _open(self, path, mode="rb", **kwargs):
        type(self).opened.append(self._strip_protocol(path))
        return super()._open(path, mode=mode, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        type(self).ranges.append((self._strip_protocol(path), start, end))
        return super().cat_file(path, start=start, end=end, **kwargs)


register_implementation("recording", RecordingFileSystem, clobber=True)


@pytest.fixture
def recording():
    RecordingFileSystem.opened, RecordingFileSystem.ranges = [], []
    yield RecordingFileSystem


def _served(tmp_path, root=None):
    """A trained model, its export, a manager that saved a full and a delta,
    and a ServingModel on `root` (default: the manager's local root)."""
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, root or mgr.root)
    train(model, 3, 6)
    mgr.save_delta()
    return model, mgr, sm


def _entries(ckpt_dir):
    with open(os.path.join(ckpt_dir, "ckpt.index"), "rb") as f:
        return parse_index(f.read(), "index")


def _unserved(name):
    """Tensors of the test model a replica has no use for."""
    return ("/" in name and name.endswith("-values")) or name.startswith("optimizer/") or name.endswith(
        ("-versions", "-freqs", "-keys_filtered", "-freqs_filtered", "-seen_filtered", "-clock")) \
        or name == "global_step"


def _assert_serves(sm, model):
    users, items = probe_inputs()
    out, _ = sm.predict({"users": users, "items": items})
    np.testing.assert_array_equal(out["outputs"], model.predict([users, items], verbose=0))


def test_replica_never_opens_an_optimizer_slot_file_nor_reads_optimizer_bytes(tmp_path, recording):
    model, mgr, sm = _served(tmp_path, root=f"recording://{tmp_path}/ckpt")
    sm.poll()
    assert sm.version == 2 and sm.failures == 0
    _assert_serves(sm, model)
    assert recording.opened, "the replica read through the recording filesystem"
    for m in mgr.chain():
        d = os.path.join(mgr.root, m.dir)
        num_shards, entries = _entries(d)
        by_file = {}
        for e in entries.values():
            if e.size:
                by_file.setdefault(os.path.join(d, data_file("ckpt", e.shard_id, num_shards)), []).append(e)
        for path, held in by_file.items():
            if all(_unserved(e.name) for e in held):   # a file of versions, freqs or a slot
                assert path not in recording.opened, f"{path} ({[e.name for e in held]}) was opened"
        # Shard 0 holds the dense weights next to the optimizer state: only the weights' ranges are read.
        shard0 = os.path.join(d, data_file("ckpt", 0, num_shards))
        read = [(s, e) for p, s, e in recording.ranges if p == shard0]
        assert read, "the dense weights were read"
        for e in entries.values():
            if e.shard_id == 0 and e.size and _unserved(e.name):
                assert not any(s < e.offset + e.size and e.offset < t for s, t in read), f"{e.name} bytes read"


def _evict_and_count_once(model, key):
    """Erases admitted `key` of "user" and counts it once again (CounterFilter(2):
    filtered, no row), as an eviction followed by a new sighting within one delta."""
    table = ev(model, "user")
    assert table.admitted(tf.constant([key], tf.int64)).numpy().all()
    table.remove(tf.constant([key], tf.int64))
    evstore.embedding_lookup(table, tf.constant([key], tf.int64), training=True)
    assert not table.admitted(tf.constant([key], tf.int64)).numpy().any()


def _served_key(model):
    users, _ = probe_inputs()
    table = ev(model, "user")
    return next(int(k) for k in users.reshape(-1) if table.admitted(tf.constant([k], tf.int64)).numpy().all())


def test_key_evicted_and_counted_again_within_a_delta_is_erased_without_reading_filtered_keys(tmp_path, recording):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, f"recording://{tmp_path}/ckpt")
    _evict_and_count_once(model, _served_key(model))
    mgr.save_delta()
    sm.poll()
    assert sm.version == 2 and sm.failures == 0
    _assert_serves(sm, model)   # the key reads the default value again, as in the trainer
    d = os.path.join(mgr.root, mgr.chain()[-1].dir)
    num_shards, entries = _entries(d)
    e = entries["user-keys_filtered"]
    assert e.size and os.path.join(d, data_file("ckpt", e.shard_id, num_shards)) not in recording.opened


def test_delta_without_deleted_complete_has_its_filtered_keys_read_and_erased(tmp_path, recording):
    # A delta of a writer whose deleted keys may miss a key counted again after
    # its eviction (an older evstore, or the synchronous job's merged bundles).
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, f"recording://{tmp_path}/ckpt")
    _evict_and_count_once(model, _served_key(model))
    mgr.save_delta()
    m = mgr.chain()[-1]
    m.deleted_complete = False
    with open(os.path.join(mgr.root, m.dir, "MANIFEST.json"), "w") as f:
        f.write(m.to_json())
    sm.poll()
    assert sm.version == 2 and sm.failures == 0
    _assert_serves(sm, model)
    d = os.path.join(mgr.root, m.dir)
    num_shards, entries = _entries(d)
    e = entries["user-keys_filtered"]
    assert os.path.join(d, data_file("ckpt", e.shard_id, num_shards)) in recording.opened


def _flip(path, offset=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _tensor_file(mgr, seq, name):
    d = os.path.join(mgr.root, mgr.storage.read_manifest(
        next(m.dir for m in mgr.chain() if m.seq == seq)).dir)
    num_shards, entries = _entries(d)
    e = entries[name]
    return os.path.join(d, data_file("ckpt", e.shard_id, num_shards)), e.offset


@pytest.mark.parametrize("tensor", ["user-values", "user-keys", "user-deleted_keys", "out/kernel"])
def test_flipped_byte_in_a_served_tensor_refuses_the_commit_and_counts_once(tmp_path, tensor):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    before = sm.predict(dict(zip(("users", "items"), probe_inputs())))[0]["outputs"]
    train(model, 3, 40)   # enough batches for filtered keys in the delta
    ev(model, "user").remove(tf.constant([1, 2, 3], tf.int64))   # and deleted keys
    mgr.save_delta()
    path, offset = _tensor_file(mgr, 2, tensor)
    _flip(path, offset)
    sm.poll()
    sm.poll()
    assert sm.version == 1 and sm.failures == 1
    assert os.path.basename(path) in sm.last_error and "corrupt" in sm.last_error
    np.testing.assert_array_equal(sm.predict(dict(zip(("users", "items"), probe_inputs())))[0]["outputs"], before)


@pytest.mark.parametrize("tensor", ["user/m-values", "user/v-values", "user-versions", "user-freqs",
                                    "user-keys_filtered", "optimizer/out_kernel_momentum"])
def test_flipped_byte_in_an_unserved_tensor_is_ignored(tmp_path, tensor):
    model, mgr, sm = _served(tmp_path)
    path, offset = _tensor_file(mgr, 2, tensor)
    _flip(path, offset)
    sm.poll()
    assert sm.version == 2 and sm.failures == 0
    _assert_serves(sm, model)


def test_fetch_returns_exactly_what_stock_tensorflow_reads(tmp_path):
    model, mgr, _ = _served(tmp_path)
    for m in mgr.chain():
        reader = tf.train.load_checkpoint(os.path.join(mgr.root, m.dir, "ckpt"))
        names = sorted(reader.get_variable_to_shape_map())
        with fetch(mgr.storage, m, names) as t:
            for n in names:
                want = reader.get_tensor(n)
                assert t[n].dtype == want.dtype and t[n].shape == want.shape, n
                np.testing.assert_array_equal(t[n], want, err_msg=n)
            assert t.bytes_read == m.total_bytes   # everything named: every file once


def test_fetch_names_a_tensor_the_bundle_lacks(tmp_path):
    _, mgr, _ = _served(tmp_path)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="no tensor.*nope-keys"):
        fetch(mgr.storage, mgr.chain()[-1], ["nope-keys"])


def test_a_changed_index_is_refused_before_any_data_is_read(tmp_path, recording):
    model, mgr, _ = _served(tmp_path)
    m = mgr.chain()[-1]
    _flip(os.path.join(mgr.root, m.dir, "ckpt.index"), 10)
    storage = checkpoint.Storage(f"recording://{mgr.root}")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="ckpt.index.*crc32c"):
        fetch(storage, m, ["user-keys"])
    assert all(p.endswith("ckpt.index") for p in recording.opened)
