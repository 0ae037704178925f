"""Serving export and ServingModel: stock-TF export, hot application of
checkpoints, failure handling, and no prediction ever seeing half a delta."""
import json
import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import checkpoint
import evstore
import serving_loader

from ckpt_model import make_model, probe_inputs, train  # tests/checkpoint, registered by tests/conftest.py

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "checkpoint", "ckpt_model.py")


def _predict(sm):
    users, items = probe_inputs()
    out, version = sm.predict({"users": users, "items": items})
    return out["outputs"], version


def _want(model):
    return model.predict(list(probe_inputs()), verbose=0)


@pytest.fixture
def job(tmp_path):
    """A trained model, its serving export, and a checkpoint manager on a root."""
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    return model, export, mgr


LOADER = r'''
import sys, numpy as np, tensorflow as tf
m = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
out = m.signatures["serving_default"](users=tf.constant(x["users"]), items=tf.constant(x["items"]))
np.save(sys.argv[3], out["outputs"].numpy())
assert not any(k == "evstore" or k.startswith("evstore.") for k in sys.modules), "evstore was imported"
with open("/proc/self/maps") as f:
    assert "_evstore_ops" not in f.read(), "the evstore op library was loaded"
print("stock-ok")
'''


def test_export_runs_in_a_fresh_interpreter_without_evstore(tmp_path, job):
    model, export, _ = job
    users, items = probe_inputs()
    np.savez(tmp_path / "x.npz", users=users, items=items)
    (tmp_path / "load.py").write_text(LOADER)
    p = subprocess.run([sys.executable, str(tmp_path / "load.py"), export, str(tmp_path / "x.npz"),
                        str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0 and "stock-ok" in p.stdout, p.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), _want(model))


def test_serving_model_starts_from_the_newest_chain(job):
    model, export, mgr = job
    train(model, 3, 5)
    seq = mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    out, version = _predict(sm)
    assert version == seq
    np.testing.assert_array_equal(out, _want(model))


def test_each_delta_is_applied_in_order_and_deleted_keys_read_the_default(job):
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    for i in range(3):
        train(model, 3 + i, 4 + i)
        seq = mgr.save_delta()
        assert sm.poll() == seq
        out, _ = _predict(sm)
        np.testing.assert_array_equal(out, _want(model))
    ev = model.get_layer("user").ev
    ev.remove(tf.constant([1, 2, 3, 4, 5, 6, 7, 8], tf.int64))
    seq = mgr.save_delta()
    assert sm.poll() == seq and sm.applied == 5   # the start (full) and four deltas
    np.testing.assert_array_equal(_predict(sm)[0], _want(model))


def test_each_applied_commit_logs_its_seq_apply_time_and_rows(job, caplog):
    import re

    model, export, mgr = job
    full = mgr.save_full()
    with caplog.at_level("INFO", logger="evstore.serving"):
        sm = serving_loader.ServingModel(export, mgr.root)
        train(model, 3, 4)
        ev = model.get_layer("user").ev
        ev.remove(tf.constant([1, 2], tf.int64))
        seq = mgr.save_delta()
        assert sm.poll() == seq
    lines = [r.getMessage() for r in caplog.records if r.name == "evstore.serving"]
    assert any(re.fullmatch(rf"serving {full}: loaded the chain of full {full} \(1 checkpoint\) in \d+\.\d{{3}} s: "
                            r"[\d,]+ rows served", x) for x in lines), lines
    (line,) = [x for x in lines if x.startswith(f"applied delta {seq} ")]
    m = re.fullmatch(rf"applied delta {seq} \(chain of full {full}\) in \d+\.\d{{3}} s: ([\d,]+) rows upserted, "
                     r"([\d,]+) deleted; served \d+\.\d s after its commit", line)
    assert m is not None, line
    assert int(m[1].replace(",", "")) > 0 and int(m[2]) == 2


def _served_then_a_delta(job):
    """Serves a full of `job`, then trains and commits a delta, unread; returns (the ServingModel, the
    served predictions, the delta's directory)."""
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    good = _want(model)
    train(model, 3, 5)
    return sm, good, os.path.join(mgr.root, f"delta-{mgr.save_delta():010d}")


def test_corrupt_delta_keeps_the_last_good_state_and_a_new_full_recovers(job):
    model, export, mgr = job
    sm, good, d = _served_then_a_delta(job)
    f = max((os.path.join(d, n) for n in os.listdir(d) if ".data-" in n), key=os.path.getsize)
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0x01
    open(f, "wb").write(bytes(b))
    assert sm.poll() == 1 and sm.failures >= 1 and os.path.basename(f) in sm.last_error
    np.testing.assert_array_equal(_predict(sm)[0], good)
    seq = mgr.save_full()
    assert sm.poll() == seq
    np.testing.assert_array_equal(_predict(sm)[0], _want(model))


def _bytes_this_process_read():
    """Bytes this process's read calls returned so far (every thread's: /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _staged_bytes(staged):
    """The bytes of every array a Staged commit holds: keys, rows, keys to erase, dense weights."""
    arrays = [a for erase, keys, values, _, freqs in staged.evs.values() for a in (erase, keys, values, freqs)
              if a is not None]
    return sum(a.nbytes for a in arrays) + sum(v.nbytes for v in staged.dense.values())


def test_staging_a_commit_on_a_local_root_reads_each_byte_it_serves_once(job):
    model, export, mgr = job
    user = model.get_layer("user").ev
    keys = np.arange(20_000, dtype=np.int64) * 7 + 1000
    rows = np.random.default_rng(0).normal(size=(len(keys), 8)).astype(np.float32)
    user.load(keys, rows)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    user.load(keys[:10_000], rows[:10_000] * 2)
    user.remove(tf.constant(keys[-5:]))
    mgr.save_delta()
    for m in mgr.chain():
        index = m.files["ckpt.index"]["size"]
        before = _bytes_this_process_read()
        staged = sm.stager.stage(m)
        read = _bytes_this_process_read() - before
        served = index + _staged_bytes(staged)
        # Each served byte is read once, into memory, and checked there (a data file of served tensors
        # whole against the manifest, a tensor beside others against the index) before any table changes;
        # reading the files again to check them would read about twice. Optimizer slots and versions are
        # not read at all.
        assert served <= read < 1.5 * served, (m.kind, read, served)
        assert read < m.total_bytes / 2, (m.kind, read, m.total_bytes)


def test_a_changed_byte_in_a_served_tensor_beside_unserved_ones_is_refused_naming_it(job):
    from checkpoint.index import data_file, parse_index

    sm, good, d = _served_then_a_delta(job)
    with open(os.path.join(d, "ckpt.index"), "rb") as f:
        num_shards, entries = parse_index(f.read(), "ckpt.index")
    name = sm.stager.dense_names[0]
    e = entries[name]
    shared = [n for n, x in entries.items() if x.shard_id == e.shard_id and x.size and n != name]
    assert shared, "the served dense weight shares its data file with tensors serving does not read"
    f = os.path.join(d, data_file("ckpt", e.shard_id, num_shards))
    with open(f, "r+b") as fh:
        fh.seek(e.offset)
        b = fh.read(1)
        fh.seek(e.offset)
        fh.write(bytes([b[0] ^ 0x01]))
    assert sm.poll() == 1 and sm.failures >= 1
    assert os.path.basename(f) in sm.last_error and repr(name) in sm.last_error and "corrupt" in sm.last_error
    np.testing.assert_array_equal(_predict(sm)[0], good)


def test_missing_delta_is_a_reported_gap_until_a_new_full(job):
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    train(model, 3, 4)
    gone = mgr.save_delta()
    train(model, 4, 5)
    mgr.save_delta()
    os.remove(os.path.join(mgr.root, f"delta-{gone:010d}", "MANIFEST.json"))
    assert sm.poll() == 1 and "gap" in sm.last_error
    seq = mgr.save_full()
    assert sm.poll() == seq
    np.testing.assert_array_equal(_predict(sm)[0], _want(model))


def test_restarted_trainer_with_a_new_full_is_followed(job, tmp_path):
    model, export, mgr = job
    mgr.save_full()
    train(model, 3, 4)
    mgr.save_delta()
    sm = serving_loader.ServingModel(export, mgr.root)
    restarted = make_model()
    mgr2 = checkpoint.CheckpointManager(mgr.root, restarted)
    mgr2.restore()
    train(restarted, 4, 6)
    full = mgr2.save_full()
    train(restarted, 6, 7)
    seq = mgr2.save_delta()
    assert sm.poll() == seq and sm.base == full
    np.testing.assert_array_equal(_predict(sm)[0], _want(restarted))


def test_server_restarted_mid_chain_serves_the_newest_state(job):
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    train(model, 3, 4)
    mgr.save_delta()
    sm.poll()
    train(model, 4, 6)
    seq = mgr.save_delta()
    restarted = serving_loader.ServingModel(export, mgr.root)   # a new server process would do the same
    assert restarted.version == seq
    np.testing.assert_array_equal(_predict(restarted)[0], _want(model))


def test_run_answers_as_the_trained_model_after_each_applied_delta(job):
    # run() calls the signature on its flat inputs (bound once, variables captured at load):
    # every in-place apply must still be what it reads.
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    users, items = probe_inputs()
    for step in range(3):
        train(model, 3 + step, 4 + step)
        seq = mgr.save_delta()
        assert sm.poll() == seq
        out, version = sm.run("serving_default", {"users": users, "items": items})
        assert version == seq
        np.testing.assert_array_equal(out["outputs"], _want(model))


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing"])
def test_run_refuses_inputs_the_signature_refuses_with_its_own_error(job, bad):
    model, export, mgr = job
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    users, items = probe_inputs()
    inputs = {"shape": {"users": users.reshape(-1, 1, 1), "items": items},
              "dtype": {"users": np.full(users.shape, b"x", dtype=object), "items": items},
              "missing": {"users": users}}[bad]
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)):
        sm.run("serving_default", inputs)


def test_no_prediction_mixes_two_checkpoints_during_a_predict_storm(tmp_path):
    inp = keras.Input(shape=(1,), dtype="int64", name="ids")
    x = keras.layers.Flatten()(evstore.keras.Embedding(4, name="flip")(inp))
    model = keras.Model(inp, keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="sum")(x))
    ev = model.get_layer("flip").ev
    keys = np.arange(20000, dtype=np.int64)
    ev.load(keys, np.full((len(keys), 4), 1.0, np.float32))
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    stop, seen, errors = threading.Event(), set(), []

    def storm():
        try:
            while not stop.is_set():
                out, _ = sm.predict({"ids": keys[:, None]})
                vals = set(np.unique(out["outputs"]).tolist())
                seen.update(vals)
                if len(vals) != 1:
                    errors.append(vals)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=storm) for _ in range(3)]
    for t in threads:
        t.start()
    for flip in range(2, 8):   # each delta rewrites every row and the kernel: old state 4*a*k, new 4*b*k'
        ev.load(keys, np.full((len(keys), 4), float(flip), np.float32))
        model.get_layer("sum").kernel.assign(np.full((4, 1), float(flip), np.float32))
        mgr.save_delta()
        sm.poll()
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert seen <= {4.0} | {4.0 * f * f for f in range(2, 8)}, seen
    assert len(seen) >= 2


def test_end_to_end_trainer_process_and_polling_server_agree_at_every_reported_sequence(tmp_path):
    root, dump = tmp_path / "ckpt", tmp_path / "dump"
    dump.mkdir()
    model = make_model()
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    # The trainer goes on after the server has answered at each commit (a file per version seen), so
    # the server meets every version however the two processes are scheduled.
    steps = [["train", 0, 2], ["full", 2], ["await", str(dump / "seen-1")]]
    for i in range(2, 8):
        steps += [["train", i, i + 1], ["delta", i + 1], ["await", str(dump / f"seen-{i}")]]
    trainer = subprocess.Popen([sys.executable, WORKER, str(root), str(dump), json.dumps(steps)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (root.exists() and any((root / d / "MANIFEST.json").exists() for d in os.listdir(root))):
            assert time.time() < deadline and trainer.poll() is None, trainer.stderr.read()[-3000:]
            time.sleep(0.1)
        sm = serving_loader.ServingModel(export, str(root))
        sm.start(every_s=0.1)
        answers = {}
        while trainer.poll() is None or len(answers) < 7:
            out, version = _predict(sm)
            answers.setdefault(version, out)
            (dump / f"seen-{version}").touch()
            if trainer.poll() is not None:
                sm.poll()
                out, version = _predict(sm)
                answers.setdefault(version, out)
                break
            time.sleep(0.02)
        sm.stop()
    finally:
        trainer.kill()
        trainer.wait()
    assert trainer.returncode in (0, -9)
    assert sorted(answers) == list(range(1, 8))
    for version, out in answers.items():
        np.testing.assert_array_equal(out, np.load(dump / f"probe-{version}.npy"), err_msg=f"seq {version}")
    assert sm.failures == 0


def test_remote_style_root_is_staged_and_applied(tmp_path):
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    root = f"memory://serving-{time.time_ns()}"
    mgr = checkpoint.CheckpointManager(root, model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, root)
    train(model, 3, 5)
    seq = mgr.save_delta()
    assert sm.poll() == seq
    np.testing.assert_array_equal(_predict(sm)[0], _want(model))
