"""Checkpoints of string-keyed EVs (key_dtype=tf.string): keys, filtered keys
and deleted keys are DT_STRING tensors of the bundle (TF's string encoding,
readable by `tf.train.load_checkpoint`); full, delta with deletions, sharded,
compaction and Parquet behave as for int64 keys; any byte string is a key;
damaged key bytes are refused naming the file."""
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import checkpoint
import evstore
from checkpoint import tools

DIM = 4
# Any byte string: empty, non-UTF-8, a NUL inside, the maximum length.
ODD = [b"", b"\xff\xfe\x80", b"a\x00b", "caf\u00e9".encode(), b"m" * evstore.MAX_STRING_KEY_BYTES]
MARK = b"MARKER-KEY-0123456789"


def _ev(name="q", key_dtype=tf.string, shards=None):
    return evstore.EmbeddingVariable(name, DIM, key_dtype=key_dtype, filter=evstore.CounterFilter(2),
                                     initializer=tf.constant_initializer(0.25), shards=shards)


def _keys(lo, hi, as_str=True):
    k = np.arange(lo, hi, dtype=np.int64) * 7919
    return [b"k%d" % x for x in k] if as_str else k.tolist()


def _step(ev, keys, step, seed):
    """Looks `keys` up twice (admitting them) and applies one Adam step."""
    t = tf.constant(keys, ev.key_dtype)
    evstore.embedding_lookup(ev, t)
    g = tf.constant(np.random.default_rng(seed).normal(size=(len(keys), DIM)), tf.float32)
    tv = ev.trainable_variables if ev.sharded else [ev]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, t) * g)
    evstore.optimizers.Adam(0.01).apply_gradients(zip(tape.gradient(loss, tv), tv), global_step=step)


def _chain(root, ev, as_str=True):
    """full (keys 0..40 and the odd keys), delta (40..60, 5 removed), delta (60..70, a key seen once)."""
    mgr = checkpoint.CheckpointManager(str(root), ev)
    odd = ODD if as_str else list(range(10**9, 10**9 + len(ODD)))
    _step(ev, _keys(0, 40, as_str) + odd, 1, 1)
    mgr.save_full()
    _step(ev, _keys(40, 60, as_str), 2, 2)
    ev.remove(tf.constant(_keys(0, 5, as_str), ev.key_dtype))
    mgr.save_delta()
    _step(ev, _keys(60, 70, as_str), 3, 3)
    evstore.embedding_lookup(ev, tf.constant([b"seen-once" if as_str else 77], ev.key_dtype))
    mgr.save_delta()
    return mgr


def _table(ev):
    """{key: (value, version, freq, m, v)} and {filtered key: freq} from the export."""
    x = ev.export()
    rows = {k: (x["values"].numpy()[i], x["versions"].numpy()[i], x["freqs"].numpy()[i],
                x["slots"]["m"].numpy()[i], x["slots"]["v"].numpy()[i])
            for i, k in enumerate(x["keys"].numpy().tolist())}
    return rows, dict(zip(x["filtered_keys"].numpy().tolist(), x["filtered_freqs"].numpy().tolist()))


def _assert_same(a, b, key_map=lambda k: k):
    (ra, fa), (rb, fb) = _table(a), _table(b)
    assert {key_map(k) for k in ra} == set(rb) and {key_map(k): f for k, f in fa.items()} == fb
    for k, row in ra.items():
        for x, y in zip(row, rb[key_map(k)]):
            np.testing.assert_array_equal(x, y)


def test_a_string_chain_with_deletions_restores_bit_for_bit(tmp_path):
    ev = _ev()
    _chain(tmp_path, ev)
    back = _ev()
    checkpoint.CheckpointManager(str(tmp_path), back).restore()
    _assert_same(ev, back)
    rows, filtered = _table(back)
    assert not {b"k0", b"k7919"} & set(rows) and set(ODD) <= set(rows) and filtered == {b"seen-once": 1}


def test_a_string_chain_restores_to_the_rows_of_the_same_chain_with_int64_keys(tmp_path):
    s, i = _ev("s"), _ev("i", key_dtype=tf.int64)
    _chain(tmp_path / "s", s)
    _chain(tmp_path / "i", i, as_str=False)
    s2, i2 = _ev("s"), _ev("i", key_dtype=tf.int64)
    checkpoint.CheckpointManager(str(tmp_path / "s"), s2).restore()
    checkpoint.CheckpointManager(str(tmp_path / "i"), i2).restore()
    to_str = dict(zip(list(range(10**9, 10**9 + len(ODD))) + [77], ODD + [b"seen-once"]))
    _assert_same(i2, s2, key_map=lambda k: to_str.get(k, b"k%d" % k))


def test_keys_are_dt_string_tensors_tf_load_checkpoint_reads(tmp_path):
    mgr = _chain(tmp_path, _ev())
    full, delta1, _ = mgr.chain()
    r = tf.train.load_checkpoint(os.path.join(str(tmp_path), full.dir, "ckpt"))
    dtypes = r.get_variable_to_dtype_map()
    assert dtypes["q-keys"] == tf.string and dtypes["q-keys_filtered"] == tf.string
    assert set(ODD) <= set(r.get_tensor("q-keys").tolist())
    assert len(r.get_tensor("q-keys")) == r.get_tensor("q-values").shape[0] == 40 + len(ODD)
    d = tf.train.load_checkpoint(os.path.join(str(tmp_path), delta1.dir, "ckpt"))
    assert d.get_variable_to_dtype_map()["q-deleted_keys"] == tf.string
    assert sorted(d.get_tensor("q-deleted_keys").tolist()) == sorted(_keys(0, 5))
    assert sorted(d.get_tensor("q-keys").tolist()) == sorted(_keys(40, 60))


def test_an_empty_string_key_column_is_a_valid_tensor(tmp_path):
    ev = _ev()
    mgr = checkpoint.CheckpointManager(str(tmp_path), ev)
    mgr.save_full()
    r = tf.train.load_checkpoint(os.path.join(str(tmp_path), mgr.latest().dir, "ckpt"))
    assert r.get_tensor("q-keys").shape == (0,) and r.get_variable_to_dtype_map()["q-keys"] == tf.string
    checkpoint.CheckpointManager(str(tmp_path), _ev()).restore()


def _corrupt_marker(root):
    """Flips one byte of MARK's bytes in the full's data file; returns the file."""
    d = next(p for p in root.iterdir() if p.name.startswith("full-"))
    f = next(p for p in d.iterdir() if ".data-" in p.name and MARK in p.read_bytes())
    b = bytearray(f.read_bytes())
    at = b.find(MARK)
    b[at + 3] ^= 0x01
    f.write_bytes(bytes(b))
    return f


def test_a_damaged_key_byte_is_refused_naming_the_file_and_changes_nothing(tmp_path):
    ev = _ev()
    _step(ev, [MARK, b"other"], 1, 1)
    checkpoint.CheckpointManager(str(tmp_path), ev).save_full()
    f = _corrupt_marker(tmp_path)
    back = _ev()
    with pytest.raises(checkpoint.CorruptCheckpointError, match=f.name + r".*tensor '[^']+'.*corrupt"):
        checkpoint.CheckpointManager(str(tmp_path), back).restore()
    assert _table(back) == ({}, {})


def test_a_damaged_key_byte_is_caught_by_the_native_reader_without_verification(tmp_path):
    ev = _ev()
    _step(ev, [MARK, b"other"], 1, 1)
    checkpoint.CheckpointManager(str(tmp_path), ev).save_full()
    f = _corrupt_marker(tmp_path)
    with pytest.raises(Exception, match="checksum mismatch.*" + f.name):
        checkpoint.CheckpointManager(str(tmp_path), _ev()).restore(verify=False)


@pytest.mark.parametrize("saved, restored", [(2, 3), (3, None), (None, 2)])
def test_a_sharded_string_chain_restores_into_another_shard_count(tmp_path, saved, restored):
    ev = _ev(shards=saved)
    _chain(tmp_path, ev)
    back = _ev(shards=restored)
    checkpoint.CheckpointManager(str(tmp_path), back).restore()
    _assert_same(ev, back)
    if restored:
        routes = evstore.shard_index(tf.constant(_keys(5, 70)), restored).numpy()
        for s, shard in enumerate(back.shards):
            held = set(shard.export()["keys"].numpy().tolist())
            assert {k for k, r in zip(_keys(5, 70), routes) if r == s} <= held


def test_compacting_a_string_chain_restores_like_the_chain(tmp_path):
    ev = _ev()
    _chain(tmp_path, ev)
    tools.compact(str(tmp_path))
    mgr = checkpoint.CheckpointManager(str(tmp_path), _ev())
    assert mgr.latest().kind == "full" and len(mgr.chain()) == 1
    back = _ev()
    checkpoint.CheckpointManager(str(tmp_path), back).restore()
    _assert_same(ev, back)


def test_to_parquet_writes_string_keys_as_a_binary_column(tmp_path):
    ev = _ev()
    _chain(tmp_path / "root", ev)
    out = tools.to_parquet(str(tmp_path / "root"), str(tmp_path / "pq"))
    t = pq.read_table(out["files"]["q"]["rows"])
    assert str(t.schema.field("key").type) == "binary"
    rows, filtered = _table(ev)
    assert dict(zip(t.column("key").to_pylist(), t.column("freq").to_pylist())) == {k: r[2] for k, r in rows.items()}
    f = pq.read_table(out["files"]["q"]["filtered"])
    assert f.column("key").to_pylist() == list(filtered)
