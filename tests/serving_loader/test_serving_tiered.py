"""Serving a model whose EVs stay evstore tables with their rows in a DRAM cache
over a disk tier (`export_serving_model(..., tables="evstore")`,
`ServingModel(..., storage=evstore.TieredStorage(...))`, `evstore serve
--tiered-dram-bytes`): it answers exactly what the stock all-DRAM export
answers, with the apply contract's guarantees. (The predict storm while deltas
apply: tests/serving_loader/test_serving_batching.py.)"""
import os

import numpy as np
import pytest

import checkpoint
import evstore
import serving_loader

from ckpt_model import ev, make_model, train   # tests/checkpoint, registered by tests/conftest.py
from served import Server
from serve_proc import evstore as evstore_cli, last_line

# The "user" table holds a few hundred rows of 8 floats (+ bookkeeping): about 12 fit in the cache.
DRAM_BYTES = 512


def _inputs():
    """Every key the job trains on (users 0..599, items 0..49), some never seen, two per row."""
    users = np.arange(0, 600, dtype=np.int64).reshape(-1, 2)
    items = (np.arange(len(users), dtype=np.int32) % 60).reshape(-1, 1)
    return {"users": users, "items": items}


def _same_answers(tiered, stock):
    got, gv = tiered.predict(_inputs())
    want, wv = stock.predict(_inputs())
    assert gv == wv
    np.testing.assert_array_equal(got["outputs"], want["outputs"])
    assert tiered.rows() == stock.rows()


def _tier_dirs(path):
    return sorted(d for d in os.listdir(path) if d.startswith("evstore-tier-")) if os.path.isdir(path) else []


@pytest.fixture
def job(tmp_path):
    """A trained model, its stock and evstore-table exports, a checkpoint manager, the tier's parent."""
    model = make_model()
    train(model, 0, 3)
    stock, tables = str(tmp_path / "stock"), str(tmp_path / "evstore")
    serving_loader.export_serving_model(model, stock)
    serving_loader.export_serving_model(model, tables, tables="evstore")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    return model, stock, tables, mgr, str(tmp_path / "tier")


def _models(job):
    """(tiered ServingModel, stock ServingModel) on the job's root."""
    _, stock, tables, mgr, tier = job
    tiered = serving_loader.ServingModel(tables, mgr.root,
                                         storage=evstore.TieredStorage(dram_bytes=DRAM_BYTES, path=tier))
    return tiered, serving_loader.ServingModel(stock, mgr.root)


def test_a_tiered_model_answers_what_the_all_dram_export_answers_after_a_full_and_after_deltas_with_deletions(job):
    model, _, _, mgr, _ = job
    mgr.save_full()
    tiered, stock = _models(job)
    _same_answers(tiered, stock)
    for step in range(3, 9, 2):
        train(model, step, step + 2)
        ev(model, "user").remove(np.arange(step, 40, 3, dtype=np.int64))   # deleted keys in the delta
        seq = mgr.save_delta()
        assert tiered.poll() == stock.poll() == seq
        _same_answers(tiered, stock)
    st = tiered.tier_stats()["user"]
    assert st["cache_rows"] * 2 < tiered.rows()["user"] and st["cache_misses"] > 0 and st["disk_bytes"] > 0
    tiered.close()


def test_a_sharded_ev_is_served_as_one_tiered_table(tmp_path):
    model = make_model(user_shards=3)
    train(model, 0, 3)
    stock, tables = str(tmp_path / "stock"), str(tmp_path / "evstore")
    serving_loader.export_serving_model(model, stock)
    serving_loader.export_serving_model(model, tables, tables="evstore")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    tiered, stock = _models((model, stock, tables, mgr, str(tmp_path / "tier")))
    _same_answers(tiered, stock)
    train(model, 3, 5)
    seq = mgr.save_delta()
    assert tiered.poll() == stock.poll() == seq
    _same_answers(tiered, stock)
    tiered.close()


def test_string_keys_are_served_from_a_tiered_table_with_deletions(tmp_path):
    import keras
    import tensorflow as tf

    keys = np.array([b"sku:%d" % i for i in range(200)] + [b"", b"\xff\xfe", b"a\x00b"], object)
    ids = keras.Input(shape=(2,), dtype="string", name="skus")
    emb = evstore.keras.Embedding(4, key_dtype="string", name="sku")
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(optimizer=evstore.optimizers.Adagrad(0.2), loss="mse")
    rng = np.random.default_rng(0)
    model.train_on_batch(tf.constant(keys[rng.integers(0, len(keys), (256, 2))]), rng.normal(size=(256, 8)))
    stock, tables = str(tmp_path / "stock"), str(tmp_path / "evstore")
    serving_loader.export_serving_model(model, stock)
    serving_loader.export_serving_model(model, tables, tables="evstore")
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    tiered = serving_loader.ServingModel(tables, mgr.root,
                                         storage=evstore.TieredStorage(dram_bytes=256, path=str(tmp_path / "tier")))
    stock = serving_loader.ServingModel(stock, mgr.root)
    probe = {"skus": np.concatenate([keys, [b"never"]])[:204].reshape(-1, 2)}
    emb.ev.remove(keys[::7])
    mgr.save_delta()
    for _ in range(2):   # after the full, then after the delta
        np.testing.assert_array_equal(tiered.predict(probe)[0]["outputs"], stock.predict(probe)[0]["outputs"])
        assert tiered.poll() == stock.poll() == 2
    np.testing.assert_array_equal(tiered.predict(probe)[0]["outputs"], stock.predict(probe)[0]["outputs"])
    tiered.close()


def test_an_evstore_table_export_holds_no_rows_and_serves_the_default_without_a_root(job):
    model, _, tables, _, _ = job
    sm = serving_loader.ServingModel(tables)
    assert sm.rows() == {"user": 0, "item": 0}
    out, version = sm.predict(_inputs())
    assert version is None
    bias = model.get_layer("out").bias.numpy()
    np.testing.assert_allclose(out["outputs"], np.full_like(out["outputs"], 1 / (1 + np.exp(-bias[0]))), rtol=1e-6)
    sm.close()


def test_two_loads_of_one_evstore_table_export_hold_their_own_tables(job):
    _, _, tables, mgr, _ = job
    mgr.save_full()
    loaded = serving_loader.ServingModel(tables, mgr.root)   # all in DRAM
    empty = serving_loader.ServingModel(tables)
    assert loaded.rows()["user"] > 0 and empty.rows() == {"user": 0, "item": 0}
    empty.close()
    assert loaded.rows()["user"] > 0
    loaded.close()


def test_pin_and_rollback_on_a_tiered_model_serve_what_the_all_dram_export_serves(job):
    model, _, _, mgr, tier = job
    mgr.save_full()
    for step in (3, 5):
        train(model, step, step + 2)
        mgr.save_delta()
    tiered, stock = _models(job)
    for seq in (2, 1, 3):
        assert tiered.rollback(seq) == stock.rollback(seq) == seq
        assert tiered.pinned
        _same_answers(tiered, stock)
        assert len(_tier_dirs(tier)) == 2    # the previous tables' directories went with them
    train(model, 7, 9)
    new = mgr.save_delta()
    assert tiered.poll() == 3                # pinned
    assert tiered.resume() == stock.resume() == new
    _same_answers(tiered, stock)
    tiered.close()
    assert _tier_dirs(tier) == []


def test_the_quality_gate_holds_a_failing_commit_on_a_tiered_model(job):
    model, _, tables, mgr, tier = job

    def q(auc):
        return {"auc": auc, "logloss": 0.5, "examples": 1000, "label_rate": 0.3}

    mgr.save_full(quality=q(0.80))
    tiered = serving_loader.ServingModel(tables, mgr.root, gate="auc >= served - 0.05",
                                         storage=evstore.TieredStorage(dram_bytes=DRAM_BYTES, path=tier))
    stock = serving_loader.ServingModel(job[1], mgr.root)
    train(model, 3, 4)
    bad = mgr.save_delta(quality=q(0.60))
    assert tiered.poll() == 1 and tiered.admin_status()["held_commits"] == [bad]
    train(model, 4, 5)
    good = mgr.save_delta(quality=q(0.79))
    assert tiered.poll() == good and tiered.applied_seqs[-2:] == [bad, good]   # published together
    assert stock.poll() == good
    _same_answers(tiered, stock)
    tiered.close()


def _corrupt_largest_data_file(d):
    f = max((os.path.join(d, n) for n in os.listdir(d) if ".data-" in n), key=os.path.getsize)
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0x01
    open(f, "wb").write(bytes(b))
    return os.path.basename(f)


def test_a_bad_delta_is_refused_and_counted_and_the_served_version_stays(job):
    model, _, _, mgr, _ = job
    mgr.save_full()
    tiered, stock = _models(job)
    before = tiered.predict(_inputs())[0]["outputs"]
    train(model, 3, 5)
    bad = mgr.save_delta()
    name = _corrupt_largest_data_file(os.path.join(mgr.root, f"delta-{bad:010d}"))
    assert tiered.poll() == 1 and tiered.failures == 1 and name in tiered.last_error
    np.testing.assert_array_equal(tiered.predict(_inputs())[0]["outputs"], before)
    assert tiered.poll() == 1 and tiered.failures == 1     # counted once, not retried
    seq = mgr.save_full()                                    # a new full recovers
    assert tiered.poll() == stock.poll() == seq
    _same_answers(tiered, stock)
    tiered.close()


def test_a_bad_full_is_refused_while_it_streams_and_the_served_tables_stay(job):
    model, _, _, mgr, tier = job
    mgr.save_full()
    tiered, _ = _models(job)
    before = tiered.predict(_inputs())[0]["outputs"]
    train(model, 3, 5)
    bad = mgr.save_full()
    name = _corrupt_largest_data_file(os.path.join(mgr.root, f"full-{bad:010d}"))
    assert tiered.poll() == 1 and tiered.failures == 1 and name in tiered.last_error
    np.testing.assert_array_equal(tiered.predict(_inputs())[0]["outputs"], before)
    assert len(_tier_dirs(tier)) == 2        # the half-loaded tables were dropped with their directories
    tiered.close()


def test_storage_for_a_stock_export_is_refused(job):
    _, stock, _, _, tier = job
    with pytest.raises(ValueError, match='tables="evstore"'):
        serving_loader.ServingModel(stock, storage=evstore.TieredStorage(dram_bytes=DRAM_BYTES, path=tier))


def test_evstore_serve_refuses_tiered_storage_for_a_stock_export(job):
    _, stock, _, _, tier = job
    r = evstore_cli("serve", "--export", stock, "--tiered-dram-bytes", "4096", "--tier-path", tier,
                    "--port", "0", "--rest_api_port", "0")
    assert r.returncode == 1
    assert last_line(r.stderr).startswith("evstore serve: ") and 'tables="evstore"' in last_line(r.stderr)


def test_evstore_serve_tiered_clears_a_stale_tier_directory_and_removes_its_own_on_exit(job, tmp_path):
    model, _, tables, mgr, tier = job
    mgr.save_full()
    stale = os.path.join(tier, "evstore-tier-1-0")   # left by a killed process: its lock file is not held
    os.makedirs(stale)
    open(os.path.join(stale, "lock"), "w").close()
    server = Server(str(tmp_path), tables, mgr.root, name="ctr",
                    extra=["--tiered-dram-bytes", str(DRAM_BYTES), "--tier-path", tier])
    try:
        server.wait_version(1)
        assert len(_tier_dirs(tier)) == 2 and "evstore-tier-1-0" not in _tier_dirs(tier)
        status, body = server.predict({"inputs": {k: v.tolist() for k, v in _inputs().items()}})
        assert status == 200, body
        np.testing.assert_allclose(body["outputs"], model.predict([_inputs()["users"], _inputs()["items"]],
                                                                  verbose=0), rtol=1e-6, atol=1e-7)
    finally:
        assert server.stop() == 0
    assert _tier_dirs(tier) == []
