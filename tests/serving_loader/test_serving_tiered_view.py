"""A tiered server keeps rows in the serving view's precision (bfloat16,
float16, int8) in its DRAM cache and on its tier, answering bit for bit what
the all-DRAM server of the view answers; predictions count in the keys'
frequencies, which the cache policy weighs (docs/guides/tiered-storage.md,
"Rows in the view's precision"; evstore/native/core/serving_rows.h)."""
import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import evstore
import serving_loader
from checkpoint.serving_view import codec
from evstore import ops, schema
from serving_loader.ev_table import _Replacement

from ckpt_model import ev, make_model, train   # tests/checkpoint, registered by tests/conftest.py

VIEWS = ["bfloat16", "float16", "int8"]


def _inputs():
    users = np.arange(0, 600, dtype=np.int64).reshape(-1, 2)
    items = (np.arange(len(users), dtype=np.int32) % 60).reshape(-1, 1)
    return {"users": users, "items": items}


def _stats(table):
    return dict(zip(schema.STATS_FIELDS, (int(x) for x in ops.ev_stats(table.resource_handle,
                                                                        key_dtype=table.key_dtype).numpy())))


@pytest.fixture
def tiered_served(tmp_path):
    """Trains the test model 3 steps, exports its evstore tables, commits a full (with a
    `serving_view`, if given) and serves it from a ServingModel tiered at `dram_bytes`: call it with
    those; returns (model, manager, served model). Closed at teardown."""
    made = []

    def serve(dram_bytes, serving_view=None):
        model = make_model()
        train(model, 0, 3)
        tables = str(tmp_path / "evstore")
        serving_loader.export_serving_model(model, tables, tables="evstore")
        mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model, serving_view=serving_view)
        mgr.save_full()
        made.append(serving_loader.ServingModel(
            tables, mgr.root, storage=evstore.TieredStorage(dram_bytes=dram_bytes, path=str(tmp_path / "t"))))
        return model, mgr, made[-1]

    yield serve
    for sm in made:
        sm.close()


@pytest.mark.parametrize("view", VIEWS)
def test_a_tiered_server_answers_exactly_what_the_all_dram_server_of_the_view_answers(tmp_path, view, tiered_served):
    model, mgr, tiered = tiered_served(256, serving_view=view)
    stock = str(tmp_path / "stock")
    serving_loader.export_serving_model(model, stock)
    dram = serving_loader.ServingModel(stock, mgr.root)   # decodes the view into float32 DenseHashTables
    for step in (3, 5, None):
        got, gv = tiered.predict(_inputs())
        want, wv = dram.predict(_inputs())
        assert gv == wv and tiered.serving_view == dram.serving_view == view
        np.testing.assert_array_equal(got["outputs"], want["outputs"])
        assert tiered.rows() == dram.rows()
        if step is None:
            break
        train(model, step, step + 2)
        ev(model, "user").remove(np.arange(step, 40, 3, dtype=np.int64))   # deleted keys in the delta
        seq = mgr.save_delta()
        assert tiered.poll() == dram.poll() == seq
    st = tiered.tier_stats()["user"]
    assert st["cache_rows"] < tiered.rows()["user"] and st["cache_misses"] > 0 and st["disk_bytes"] > 0, st


def test_an_int8_table_holds_more_than_3x_the_rows_of_a_float32_one_in_the_same_dram(tmp_path):
    storage = evstore.TieredStorage(dram_bytes=1 << 20, path=str(tmp_path))
    capacity = {}
    for precision in ("float32", "bfloat16", "int8"):
        t = _Replacement(tf.int64, 64, np.zeros([64], np.float32), storage, precision)
        capacity[precision] = _stats(t)["cache_capacity"]
        t.close()
    # per row at dim 64: 256 + 8 bytes (float32), 128 + 8 (bfloat16), 4 + 64 + 8 (int8)
    assert capacity == {p: (1 << 20) // b for p, b in (("float32", 264), ("bfloat16", 136), ("int8", 76))}
    assert capacity["int8"] >= 3 * capacity["float32"]


@pytest.mark.parametrize("view", VIEWS)
def test_float32_rows_upserted_into_a_view_precision_table_read_back_as_the_views_encoding(tmp_path, view):
    dim = 7   # odd: the packed row ends with padding
    rows = np.random.default_rng(0).normal(0, 0.3, size=(300, dim)).astype(np.float32)
    rows[5] = 0   # a zero row: int8 scale 0
    keys = np.arange(300, dtype=np.int64)
    t = _Replacement(tf.int64, dim, np.full([dim], 0.5, np.float32),
                     evstore.TieredStorage(dram_bytes=2048, path=str(tmp_path)), view)
    t.insert(keys, rows)
    c = codec(view)
    want = c.decode(c.encode(rows), dim)
    got = ops.ev_find(t.resource_handle, tf.constant(np.append(keys, 999)), dim=dim).numpy()
    np.testing.assert_array_equal(got[:-1], want)
    np.testing.assert_array_equal(got[-1], np.full([dim], 0.5, np.float32))   # a key without a row: the default
    t.close()


def test_each_prediction_adds_one_to_the_keys_frequency(tiered_served):
    _, _, sm = tiered_served(256)
    user = sm.publisher.tables["user"]
    keys = tf.constant([2, 3], tf.int64)
    before = ops.ev_key_info(user._h, keys)[0].numpy()
    for _ in range(5):
        sm.predict({"users": np.array([[2, 3], [2, 2]], np.int64), "items": np.array([[1], [1]], np.int32)})
    after = ops.ev_key_info(user._h, keys)[0].numpy()
    np.testing.assert_array_equal(after - before, [15, 5])   # key 2 three times a request, key 3 once


def test_rows_that_predictions_read_often_stay_in_the_dram_cache_while_cold_rows_stream_through(tmp_path):
    dim, n = 16, 6000
    t = _filled(tmp_path, 200, n, dim)   # every key trained once (frequency 1)
    hot = tf.constant(np.arange(0, 50, dtype=np.int64))
    for _ in range(300):   # predictions: each read counts as a training access would
        ops.ev_find(t.resource_handle, hot, dim=dim)
    hot_misses = []
    for lo in range(50, n, 100):   # then traffic: the hot keys, and 100 keys read once (half the cache)
        before = _stats(t)["cache_misses"]
        ops.ev_find(t.resource_handle, hot, dim=dim)
        hot_misses.append(_stats(t)["cache_misses"] - before)
        ops.ev_find(t.resource_handle, tf.constant(np.arange(lo, lo + 100, dtype=np.int64)), dim=dim)
    # With its frequency at 1 a hot row would weigh as little as a cold one and be evicted by each
    # round's stream; counted, it stays: no hot read misses after the first round.
    assert sum(hot_misses[1:]) == 0, hot_misses
    t.close()


def _filled(tmp_path, budget_rows, n, dim=16):
    """A tiered float32 serving table of `budget_rows` rows of DRAM holding keys 0..n-1."""
    t = _Replacement(tf.int64, dim, np.zeros([dim], np.float32),
                     evstore.TieredStorage(dram_bytes=budget_rows * (dim * 4 + 8), path=str(tmp_path)), "float32")
    t.insert(np.arange(n, dtype=np.int64), np.ones([n, dim], np.float32))
    return t


def test_warming_a_delta_leaves_its_upserts_no_disk_to_read_or_write(tmp_path):
    t = _filled(tmp_path, 100, 1000)
    keys = np.concatenate([np.arange(0, 40, dtype=np.int64), np.arange(5000, 5040, dtype=np.int64)])  # held, new
    ops.ev_serve_warm(t.resource_handle, tf.constant(keys))
    before = _stats(t)
    t.insert(keys, np.full([len(keys), 16], 2, np.float32))   # what the publish runs under the write lock
    after = _stats(t)
    # the 40 held rows were in DRAM; the 40 new ones take a slot each (counted as a miss, nothing read)
    assert after["cache_misses"] - before["cache_misses"] == 40 and after["disk_bytes"] == before["disk_bytes"]
    assert after["cache_rows"] <= after["cache_capacity"], after
    t.close()


def test_a_reload_fills_its_new_table_with_an_eighth_of_the_budget_and_serves_it_with_the_whole(tiered_served):
    from serving_loader.ev_table import loading_dram_bytes

    budget = 1 << 30   # the cache is allocated as rows arrive: nothing of it here
    _, _, sm = tiered_served(budget)
    user = sm.publisher.tables["user"]
    row = 8 * 4 + 8   # the user table's float32 rows and their slot bookkeeping
    fresh = user.replacement()   # what a reload fills outside the lock
    assert _stats(fresh)["cache_capacity"] == loading_dram_bytes(budget) // row == budget // 8 // row
    with sm.publisher.writing():
        user.adopt(fresh)
    assert user.stats()["cache_capacity"] == budget // row
