"""Exact resume with admission filters and eviction: a real
training process killed with SIGKILL mid-run and resumed from its checkpoints
ends in exactly the state of the same job never stopped, bit for bit.
Everything that decides a future admission or eviction is in the checkpoint:
filtered keys' last-seen steps, the table's clock, Bloom counters."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import checkpoint
import evstore
import keras
import tensorflow as tf
from checkpoint import fileio
from checkpoint.manifest import canonical_checksum
from evstore import schema

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "resume_job.py")
STOP = 16


def _job(root, out, kind, env=None):
    return subprocess.Popen([sys.executable, JOB, str(root), str(out), kind, str(STOP)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _finish(p):
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return out


@pytest.mark.parametrize("kind", ["counter", "bloom", "string"])
def test_killed_and_resumed_job_equals_the_uninterrupted_one_bit_for_bit(tmp_path, kind):
    _finish(_job(tmp_path / "straight", tmp_path / "straight.npz", kind))
    # The same job, killed (SIGKILL) while it trains after its third save...
    p = _job(tmp_path / "killed", tmp_path / "never.npz", kind, env={"RESUME_JOB_SLOW": "0.5"})
    saves = 0
    for line in p.stdout:
        saves += line.startswith("saved")
        if saves == 3:
            p.send_signal(signal.SIGKILL)
            break
    p.wait()
    assert p.returncode == -signal.SIGKILL and not (tmp_path / "never.npz").exists()
    # ...and restarted: it restores, goes on from the saved input position.
    _finish(_job(tmp_path / "killed", tmp_path / "resumed.npz", kind))
    with np.load(tmp_path / "straight.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        assert len(a["filtered_keys"]) > 0 or kind == "bloom"
        for k in a.files:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def _train(model, start, stop):
    from resume_job import batch
    for i in range(start, stop):
        model.train_on_batch(*batch(i, "counter"))


def _state(model, ev):
    from resume_job import final_state
    x = final_state(ev)
    x.update({f"dense:{v.path}": np.asarray(v) for v in model.variables})
    x.update({f"optimizer:{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
    return x


# Optimizers whose slots start at a non-zero value: keys admitted by the
# first batch after a restore must start from it too.
OPTIMIZERS = {"adagrad": lambda: evstore.optimizers.Adagrad(0.05, initial_accumulator_value=0.1),
              "ftrl": lambda: evstore.optimizers.Ftrl(0.05, initial_accumulator_value=0.1),
              "group_adagrad": lambda: evstore.optimizers.GroupAdagrad(0.05, initial_accumulator_value=0.1)}


def _written_before_slot_initial_values(ckpt_dir):
    """Rewrites the checkpoint in `ckpt_dir` as evstore wrote it before slots'
    initial values were saved: the same bundle without `<ev>/<slot>-initial_value`
    (TensorFlow's own writer), its manifest listing the new files."""
    prefix = str(ckpt_dir / "ckpt")
    reader = tf.train.load_checkpoint(prefix)
    names = sorted(n for n in reader.get_variable_to_shape_map() if not n.endswith(schema.SLOT_INITIAL_VALUE))
    assert len(names) < len(reader.get_variable_to_shape_map())
    tensors = [reader.get_tensor(n) for n in names]
    for f in ckpt_dir.glob("ckpt.*"):
        f.unlink()
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
    path = ckpt_dir / "MANIFEST.json"
    m = json.loads(path.read_text())
    m["files"] = {f.name: {"size": f.stat().st_size, "crc32c": fileio.crc32c(f.read_bytes())}
                  for f in ckpt_dir.glob("ckpt.*")}
    m.pop("checksum")
    m["checksum"] = canonical_checksum(m)
    path.write_text(json.dumps(m))


def _assert_resume_is_exact(root, make_optimizer, build=False, old_checkpoint=False):
    """Trains 8 batches straight, and 4 + save + restore into a new model
    (new tables, as in a new process) + 4; both end in the same state.
    `build`: the resumed model's optimizer is built before the restore (as
    `evstore train` does), else at its first step. `old_checkpoint`: the saved
    checkpoint is rewritten as one written before slots' initial values were
    saved (the restore takes them from the model's optimizer)."""
    from resume_job import make_model
    straight, straight_ev = make_model("counter", make_optimizer())
    _train(straight, 0, 4)
    checkpoint.CheckpointManager(root / "straight", straight).save_full()   # a save evicts: both save
    _train(straight, 4, 8)
    first, _ = make_model("counter", make_optimizer())
    _train(first, 0, 4)
    checkpoint.CheckpointManager(root / "resumed", first).save_full()
    if old_checkpoint:
        _written_before_slot_initial_values(root / "resumed" / "full-0000000001")
    resumed, resumed_ev = make_model("counter", make_optimizer())
    if build:
        resumed.optimizer.build(resumed.trainable_variables)
    checkpoint.CheckpointManager(root / "resumed", resumed).restore()
    _train(resumed, 4, 8)
    a, b = _state(straight, straight_ev), _state(resumed, resumed_ev)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resumed_training_with_a_nonzero_initial_slot_equals_the_uninterrupted_run_bit_for_bit(tmp_path, name):
    _assert_resume_is_exact(tmp_path, OPTIMIZERS[name])


def test_resumed_training_with_a_keras_optimizers_nonzero_initial_slot_equals_the_uninterrupted_run(tmp_path):
    # keras.optimizers.Adagrad trains the EV through the generic row path (slot "adagrad_accumulator").
    _assert_resume_is_exact(tmp_path, lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.1),
                            build=True)


def test_a_checkpoint_written_before_slot_initial_values_were_saved_resumes_exactly_with_the_models_optimizer(
        tmp_path):
    _assert_resume_is_exact(tmp_path, OPTIMIZERS["adagrad"], old_checkpoint=True)
