"""Restores under concurrent change and mismatched optimizers:
a restore racing a writer's retention never half-loads, and an Adam checkpoint
restored into an SGD model is a clear error (or, asked for, drops the slots)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import checkpoint
import evstore
from ckpt_model import assert_same_state, ev, load_state, make_model, state, train

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_model.py")


def test_restore_racing_a_writers_retention_loads_one_whole_checkpoint_or_changes_nothing(tmp_path):
    root, dump = tmp_path / "root", tmp_path / "dump"
    dump.mkdir()
    steps = [s for i in range(14) for s in (["train", i, i + 1], ["full", i + 1])]   # keep_chains=3: each full
    writer = subprocess.Popen([sys.executable, WORKER, str(root), str(dump), json.dumps(steps)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)      # deletes the oldest chain
    assert writer.stdout.readline().startswith("saved"), writer.stderr.read()[-3000:]
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(root), model, lease=False)
    restored = 0
    while writer.poll() is None:
        before = state(model)
        try:
            meta = mgr.restore()
        except checkpoint.CheckpointError:
            assert_same_state(state(model), before)   # refused: nothing changed
            continue
        seq = mgr.last_committed.seq
        assert meta == {"pos": seq}
        assert_same_state(state(model), load_state(dump / f"live-{seq}.npz"))
        restored += 1
    out, err = writer.communicate()
    assert writer.returncode == 0, err[-3000:]
    assert restored >= 2


def test_adam_checkpoint_into_an_sgd_model_is_refused_or_drops_the_slots_when_asked(tmp_path):
    model = make_model()
    train(model, 0, 3)
    checkpoint.CheckpointManager(str(tmp_path), model).save_full()
    sgd = make_model()
    sgd.compile(optimizer=evstore.optimizers.SGD(0.1), loss="binary_crossentropy")
    train(sgd, 0, 1)
    before = state(sgd)
    with pytest.raises(ValueError, match=r"slots .*'user': \['m', 'v'\].*SGD.*drop_unused_slots=True"):
        checkpoint.CheckpointManager(str(tmp_path), sgd).restore()
    assert_same_state(state(sgd), before)
    checkpoint.CheckpointManager(str(tmp_path), sgd).restore(drop_unused_slots=True)
    x = ev(sgd, "user").export()
    assert x["slots"] == {}
    np.testing.assert_array_equal(np.sort(x["keys"].numpy()), np.sort(ev(model, "user").export()["keys"].numpy()))


def test_an_ev_built_in_a_graph_is_refused_by_restore_naming_it(tmp_path):
    import tensorflow as tf
    saved = evstore.EmbeddingVariable("g", 4)
    saved.load(np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32))
    checkpoint.CheckpointManager(str(tmp_path), {"g": saved}, lease=False).save_full()
    with tf.Graph().as_default():
        built = evstore.EmbeddingVariable("g", 4)
        with pytest.raises(ValueError, match="'g' was built in a graph.*tf.compat.v1.train.Saver"):
            checkpoint.CheckpointManager(str(tmp_path), {"g": built}, lease=False).restore()
