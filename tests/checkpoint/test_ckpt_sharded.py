"""Checkpoints of sharded EVs (in one process; tests/cluster/ has the
parameter-server ones): per-shard parts with their routing in the manifest,
bit-exact restore, and a chain saved with N shards restoring into M."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import checkpoint
from checkpoint import tools
from ckpt_model import assert_same_state, make_model, probe_inputs, state, train


def _saved_chain(root, shards):
    """A model with a `shards`-shard user table, trained, saved as full + delta (with deletions)."""
    model = make_model(user_shards=shards)
    train(model, 0, 4)
    mgr = checkpoint.CheckpointManager(root, model)
    mgr.save_full()
    train(model, 4, 8)
    model.get_layer("user").ev.remove(np.arange(1, 6, dtype=np.int64))
    mgr.save_delta(metadata={"pos": 8})
    return model, mgr


def _restored(root, shards):
    model = make_model(user_shards=shards)
    meta = checkpoint.CheckpointManager(root, model).restore()
    return model, meta


def test_manifest_records_each_shard_as_a_part_with_its_route(tmp_path):
    _, mgr = _saved_chain(str(tmp_path), 2)
    with open(os.path.join(str(tmp_path), mgr.latest().dir, "MANIFEST.json")) as f:
        evs = json.load(f)["evs"]
    assert evs["user/part_0"]["shard"] == {"ev": "user", "index": 0, "count": 2, "route": "mix64-v1"}
    assert evs["user/part_1"]["shard"]["index"] == 1
    assert "shard" not in evs["item"]
    assert evs["user/part_0"]["deleted"] + evs["user/part_1"]["deleted"] == 5


def test_tf_load_checkpoint_reads_every_part(tmp_path):
    model, mgr = _saved_chain(str(tmp_path), 2)
    reader = tf.train.load_checkpoint(os.path.join(str(tmp_path), mgr.chain()[0].dir, "ckpt"))
    keys = np.concatenate([reader.get_tensor(f"user/part_{i}-keys") for i in range(2)])
    assert len(keys) == mgr.chain()[0].evs["user/part_0"]["rows"] + mgr.chain()[0].evs["user/part_1"]["rows"]
    assert reader.get_tensor("user/part_0/m-values").shape[1] == 8


def test_same_shard_count_restores_bit_exact(tmp_path):
    model, _ = _saved_chain(str(tmp_path), 2)
    restored, meta = _restored(str(tmp_path), 2)
    assert meta == {"pos": 8}
    assert_same_state(state(restored), state(model))


@pytest.mark.parametrize("saved, restored", [(2, 3), (3, 2), (2, None), (None, 3), (4, 1)])
def test_chain_saved_with_n_shards_restores_into_m(tmp_path, saved, restored):
    model, _ = _saved_chain(str(tmp_path), saved)
    got, _ = _restored(str(tmp_path), restored)
    assert_same_state(state(got, logical=True), state(model, logical=True))
    sev = got.get_layer("user").ev
    if restored:   # every key sits in the shard its route names
        for i, shard in enumerate(sev.shards):
            keys = shard.export()["keys"].numpy()
            assert (sev.shard_index(keys).numpy() == i).all()


def test_restored_resharded_model_trains_on_like_the_original(tmp_path):
    model, mgr = _saved_chain(str(tmp_path), 2)
    got, _ = _restored(str(tmp_path), 3)
    train(model, 8, 11)
    train(got, 8, 11)
    np.testing.assert_allclose(got.predict(list(probe_inputs()), verbose=0),
                               model.predict(list(probe_inputs()), verbose=0), rtol=1e-5, atol=1e-6)


def test_delta_of_a_resharded_restore_extends_the_chain(tmp_path):
    _saved_chain(str(tmp_path), 2)
    model = make_model(user_shards=3)
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    mgr.restore()
    train(model, 8, 10)
    mgr.save_delta()
    got, _ = _restored(str(tmp_path), 2)
    assert_same_state(state(got, logical=True), state(model, logical=True))


def test_compact_keeps_the_shard_layout(tmp_path):
    model, _ = _saved_chain(str(tmp_path), 2)
    _, manifest = tools.compact(str(tmp_path))
    assert manifest.evs["user/part_1"]["shard"]["count"] == 2
    got, _ = _restored(str(tmp_path), 3)
    assert_same_state(state(got, logical=True), state(model, logical=True))


def _bytes_this_process_read():
    """Bytes this process's read calls returned so far (every thread's: /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _logical(ev):
    """{tensor: array} of a (sharded) EV's export as one table, keys sorted."""
    x = ev.export()
    order = np.argsort(x["keys"].numpy())
    return {n: x[n].numpy()[order] for n in ("keys", "values", "versions", "freqs")}


def test_a_restore_into_another_shard_count_in_one_process_reads_each_part_once(tmp_path):
    import evstore
    keys = np.arange(60_000, dtype=np.int64) * 7
    rows = np.random.default_rng(0).normal(size=(len(keys), 16)).astype(np.float32)
    saved = evstore.EmbeddingVariable("t", 16, shards=2)
    saved.load(keys, rows)
    mgr = checkpoint.CheckpointManager(str(tmp_path), {"t": saved}, lease=False)
    mgr.save_full()
    saved.load(keys[:10_000], rows[:10_000] * 2)
    saved.remove(keys[-5:])
    mgr.save_delta()
    chain_bytes = sum(m.total_bytes for m in mgr.chain())
    got = evstore.EmbeddingVariable("t", 16, shards=4)
    before = _bytes_this_process_read()
    checkpoint.CheckpointManager(str(tmp_path), {"t": got}, lease=False).restore()
    read = _bytes_this_process_read() - before
    want, have = _logical(saved), _logical(got)
    for n in want:
        np.testing.assert_array_equal(have[n], want[n], err_msg=n)
    for i, shard in enumerate(got.shards):   # every key sits in the shard its route names
        assert (got.shard_index(shard.export()["keys"].numpy()).numpy() == i).all()
    # Each of the 4 shards takes its keys from both saved parts: one load per part routes each key to its
    # shard, so the chain is read once; a load per shard would read every part 4 times.
    assert chain_bytes <= read < 1.5 * chain_bytes, (read, chain_bytes)
