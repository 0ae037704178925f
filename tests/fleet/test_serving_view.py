"""The serving view: the trainer writes the served rows in
bfloat16, float16 or int8 (per-row scale) into the same commit; stock
TensorFlow reads it; a replica serves from it and says so; the trainer's own
state stays float32; a commit whose view is missing or corrupt is refused
whole and the chain stays consistent."""
import os

import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import checkpoint.tools
import evstore
import serving_loader
from checkpoint.serving_view import codec
from ckpt_model import assert_same_state, make_model, probe_inputs, state, train

VIEWS = ["bfloat16", "float16", "int8"]
# Largest |prediction difference| against float32 serving allowed on the test
# model (sigmoid outputs); docs/guides/serving-fleet.md states the same bounds.
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-3, "int8": 1e-2}


def _job(tmp_path, view):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model, serving_view=view)
    mgr.save_full()
    train(model, 3, 8)
    mgr.save_delta()
    return model, export, mgr


def _outputs(sm):
    users, items = probe_inputs()
    return sm.predict({"users": users, "items": items})[0]["outputs"]


@pytest.mark.parametrize("view", VIEWS)
def test_view_round_trips_and_stock_tensorflow_reads_it(tmp_path, view):
    _, _, mgr = _job(tmp_path, view)
    for m in mgr.chain():
        assert m.serving_view == {"dtype": view}
        # one data file beside its index: the EVs' view tensors follow one another in it
        assert sorted(n for n in m.files if n.startswith("serving.")) == ["serving.data-00000-of-00001",
                                                                         "serving.index"]
        main = tf.train.load_checkpoint(os.path.join(mgr.root, m.dir, "ckpt"))
        stock = tf.train.load_checkpoint(os.path.join(mgr.root, m.dir, "serving"))
        for ev in ("user", "item"):
            x = main.get_tensor(f"{ev}-values")
            assert x.dtype == np.float32    # the trainer's state stays float32
            stored = stock.get_tensor(f"{ev}-values")
            assert stored.dtype == tf.as_dtype(view).as_numpy_dtype and stored.shape == x.shape
            tensors = {"-values": stored}
            if view == "int8":
                tensors["-values_scale"] = stock.get_tensor(f"{ev}-values_scale")
            got = codec(view).decode(tensors, x.shape[1])
            err = np.abs(got - x)
            if view == "bfloat16":
                assert np.all(err <= np.abs(x) * 2.0 ** -8)
            elif view == "float16":
                assert np.all(err <= np.abs(x) * 2.0 ** -11 + 2.0 ** -25)
            else:
                scale = np.abs(x).max(axis=1, keepdims=True) / 127
                assert np.all(err <= scale * (0.5 + 1e-5))


# Rows at the encodings' edges: ties (bfloat16: 1 + 2^-8 and 1 + 3 * 2^-8;
# float16: 1 + 2^-11), float16's overflow to inf (65520) and largest value
# (65504), its subnormals (2^-24, 3 * 2^-26) and underflow to zero (2^-25),
# signed zeros, int8's half steps (a row of scale 1: 0.5, 1.5, 2.5, -0.5) and a
# row of zeros (scale 0).
EDGE_ROWS = np.array([[1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 65520.0, 65504.0, -0.0],
                      [2.0 ** -24, 3 * 2.0 ** -26, 2.0 ** -25, -2.0 ** -25, 1e-8, 0.1],
                      [127.0, 0.5, 1.5, 2.5, -0.5, -127.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [-3.3, 2.2, 1e-3, -7.5, 0.0123, 33.0]], np.float32)


@pytest.mark.parametrize("view", VIEWS)
def test_view_streamed_with_the_rows_equals_the_codec_encoding_bit_for_bit(tmp_path, view):
    table = evstore.EmbeddingVariable(f"edge_{view}", dim=EDGE_ROWS.shape[1])
    table.load(np.arange(len(EDGE_ROWS), dtype=np.int64), EDGE_ROWS)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), {"edge": table}, serving_view=view)
    mgr.save_full()
    d = os.path.join(mgr.root, mgr.chain()[-1].dir)
    rows = tf.train.load_checkpoint(os.path.join(d, "ckpt")).get_tensor("edge-values")
    stock = tf.train.load_checkpoint(os.path.join(d, "serving"))
    with np.errstate(over="ignore"):   # 65520 becomes float16 inf, as it should
        want_all = codec(view).encode(rows)
    for suffix, want in want_all.items():
        got = stock.get_tensor("edge" + suffix)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("view", VIEWS)
def test_replica_serves_the_view_and_says_so_within_tolerance(tmp_path, view):
    model, export, mgr = _job(tmp_path, view)
    full = serving_loader.ServingModel(export, mgr.root, use_serving_view=False)
    viewed = serving_loader.ServingModel(export, mgr.root)
    assert viewed.version == full.version == 2
    assert viewed.admin_status()["serving_view"] == viewed.metrics()["serving_view"] == view
    assert full.admin_status()["serving_view"] == "float32"
    want = model.predict(list(probe_inputs()), verbose=0)
    np.testing.assert_array_equal(_outputs(full), want)
    diff = np.abs(_outputs(viewed) - want).max()
    assert diff <= TOLERANCE[view]
    assert viewed.last_fetched_bytes < full.last_fetched_bytes


def test_trainer_restores_float32_state_bit_for_bit_from_a_chain_with_a_view(tmp_path):
    model, _, mgr = _job(tmp_path, "int8")
    want = state(model)
    other = make_model()
    checkpoint.CheckpointManager(mgr.root, other, lease=False).restore()
    assert_same_state(state(other), want)


def _break_view(mgr, how):
    m = mgr.chain()[-1]
    d = os.path.join(mgr.root, m.dir)
    data = max((f for f in m.files if f.startswith("serving.data-")), key=lambda f: m.files[f]["size"])
    if how == "missing":
        os.remove(os.path.join(d, data))
    else:
        with open(os.path.join(d, data), "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x01]))
    return data


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_commit_with_missing_or_corrupt_view_is_refused_whole_and_the_chain_stays_consistent(tmp_path, how):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model, serving_view="bfloat16")
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    before = _outputs(sm)
    train(model, 3, 6)
    mgr.save_delta()
    data = _break_view(mgr, how)
    sm.poll()
    assert sm.version == 1 and sm.failures == 1 and data in sm.last_error
    np.testing.assert_array_equal(_outputs(sm), before)   # nothing of delta 2 (its keys, dense weights) served
    train(model, 6, 8)
    mgr.save_delta()     # follows 2, which this replica refused: not applied either
    sm.poll()
    assert sm.version == 1
    train(model, 8, 9)
    mgr.save_full()      # a new full repairs it
    sm.poll()
    assert sm.version == 4 and sm.serving_view == "bfloat16"


def test_a_serving_view_other_than_the_three_is_refused(tmp_path):
    with pytest.raises(ValueError, match="serving_view must be one of"):
        checkpoint.CheckpointManager(str(tmp_path / "ckpt"), make_model(), serving_view="float8")


def test_compacted_chain_with_a_view_holds_the_view_and_serves_like_the_chain(tmp_path):
    model, export, mgr = _job(tmp_path, "int8")
    chain = serving_loader.ServingModel(export, mgr.root)
    assert chain.version == 2
    _, m = checkpoint.tools.compact(mgr.root)
    assert m.kind == "full" and m.serving_view == {"dtype": "int8"} and "serving.index" in m.files
    compacted = serving_loader.ServingModel(export, mgr.root)
    assert compacted.version == m.seq and compacted.serving_view == "int8"
    np.testing.assert_array_equal(_outputs(compacted), _outputs(chain))


def test_compacted_chain_without_one_view_dtype_holds_no_view(tmp_path):
    model, export, mgr = _job(tmp_path, "int8")
    mgr.serving_view = "bfloat16"
    train(model, 8, 10)
    mgr.save_delta()
    _, m = checkpoint.tools.compact(mgr.root)
    assert m.serving_view is None and not any(n.startswith("serving.") for n in m.files)
    compacted = serving_loader.ServingModel(export, mgr.root)
    assert compacted.version == m.seq and compacted.serving_view == "float32"
