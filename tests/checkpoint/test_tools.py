"""`evstore ckpt inspect|verify|compact|to-parquet` (checkpoint/tools.py, docs/ARCHITECTURE.md, "Checkpoints"):
real CheckpointManager chains, the CLI as a subprocess for inspect and verify."""
import json
import os
import subprocess
import sys
import uuid

import keras
import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import evstore
from checkpoint import CheckpointManager, tools
from evstore_app import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- a real chain ----------------------------------------------------------------------
def make_model():
    """Two EVs (int64 keys with Adam slots and a frequency filter; int32 keys, plain SGD), a dense
    variable and a global step."""
    return {"user": evstore.EmbeddingVariable("user", dim=4, filter=evstore.CounterFilter(min_freq=2)),
            "item": evstore.EmbeddingVariable("item", dim=3, key_dtype=tf.int32),
            "dense": tf.Variable(tf.zeros([4, 2]), name="dense"),
            "step": tf.Variable(0, dtype=tf.int64, name="step")}


def train(model, lo, hi, seed):
    """One step on user keys [lo, hi) (half of them seen twice, so admitted) and a few item keys."""
    user, item, step = model["user"], model["item"], model["step"]
    rng = np.random.default_rng(seed)
    ukeys = tf.constant(np.arange(lo, hi, dtype=np.int64) * 7919)
    evstore.embedding_lookup(user, ukeys)
    evstore.embedding_lookup(user, ukeys[: (hi - lo) // 2])
    g = tf.IndexedSlices(tf.constant(rng.normal(size=(hi - lo, 4)), tf.float32), ukeys)
    evstore.training.sparse_apply_adam(user, g, 0.01, step)
    ikeys = tf.constant(rng.integers(0, 50, 20), tf.int32)
    evstore.embedding_lookup(item, ikeys)
    evstore.training.sparse_apply_sgd(item, tf.IndexedSlices(tf.ones([20, 3]), ikeys), 0.1, step)
    model["dense"].assign_add(tf.constant(rng.normal(size=(4, 2)), tf.float32))
    step.assign_add(1)


def manager_for(root, model):
    return CheckpointManager(root, {k: v for k, v in model.items() if k != "step"}, global_step=model["step"])


def save_chain(root):
    """full (seq 1), delta (2: new rows and two removed keys), delta (3). Returns the live model."""
    model = make_model()
    mgr = manager_for(root, model)
    train(model, 0, 200, seed=1)
    mgr.save_full(metadata={"offset": 100})
    train(model, 150, 260, seed=2)
    model["user"].remove(np.array([3, 5], np.int64) * 7919)
    mgr.save_delta(metadata={"offset": 200})
    train(model, 240, 300, seed=3)
    mgr.save_delta(metadata={"offset": 300})
    return model


def state(model):
    """Everything a restore must reproduce, as bytes, keys sorted."""
    out = {}
    for name in ("user", "item"):
        ex = model[name].export()
        order = np.argsort(ex["keys"].numpy(), kind="stable")
        forder = np.argsort(ex["filtered_keys"].numpy(), kind="stable")
        for f in ("keys", "values", "versions", "freqs"):
            out[f"{name}.{f}"] = ex[f].numpy()[order].tobytes()
        for s, v in ex["slots"].items():
            out[f"{name}/{s}"] = v.numpy()[order].tobytes()
        out[f"{name}.filtered_keys"] = ex["filtered_keys"].numpy()[forder].tobytes()
        out[f"{name}.filtered_freqs"] = ex["filtered_freqs"].numpy()[forder].tobytes()
    out["dense"] = model["dense"].numpy().tobytes()
    out["step"] = model["step"].numpy().tobytes()
    return out


def restored_state(root, seq=None):
    model = make_model()
    metadata = manager_for(root, model).restore(seq=seq)
    return state(model), metadata


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "evstore_app.cli", "ckpt", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def data_file(ckpt_dir):
    """The largest data shard of a checkpoint directory."""
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("ckpt.data-")]
    return os.path.join(ckpt_dir, max(names, key=lambda n: os.path.getsize(os.path.join(ckpt_dir, n))))


@pytest.fixture
def chain_root(tmp_path):
    root = str(tmp_path / "ckpt")
    return root, save_chain(root)


# ---- inspect -------------------------------------------------------------------------------
def test_inspect_cli_lists_every_checkpoint_and_marks_the_restore_chain(chain_root):
    root, _ = chain_root
    r = run_cli("inspect", root, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert [(c["seq"], c["kind"], c["parent"], c["base"]) for c in info["checkpoints"]] == [
        (1, "full", None, 1), (2, "delta", 1, 1), (3, "delta", 2, 1)]
    assert info["restore_chain"] == [1, 2, 3]
    assert all(c["in_restore_chain"] for c in info["checkpoints"])
    assert [c["global_step"] for c in info["checkpoints"]] == [1, 2, 3]
    assert info["checkpoints"][1]["evs"]["user"]["deleted"] == 2
    assert info["checkpoints"][0]["evs"]["user"]["rows"] == 100        # keys seen twice
    assert info["checkpoints"][0]["evs"]["user"]["filtered"] == 100    # seen once
    assert info["checkpoints"][0]["dense_vars"] == 1
    assert all(c["total_bytes"] > 0 for c in info["checkpoints"])
    text = run_cli("inspect", root)
    assert text.returncode == 0, text.stderr
    assert "restore() applies: 1 -> 2 -> 3" in text.stdout
    marked = [line.split() for line in text.stdout.splitlines() if line.startswith("*")]
    assert [(m[1], m[2]) for m in marked] == [("1", "full"), ("2", "delta"), ("3", "delta")]


def test_inspect_shows_slots_from_the_newest_checkpoint_not_an_empty_initial_full(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    model = make_model()
    mgr = manager_for(root, model)
    mgr.save_full()                      # what `evstore train` commits first: nothing trained, no slots yet
    train(model, 0, 50, seed=1)
    mgr.save_delta()
    assert cli.main(["ckpt", "inspect", root]) == 0
    out = capsys.readouterr().out
    assert "EV user: dim 4, int64 keys, slots m, v" in out


def test_inspect_of_one_checkpoints_directory_names_the_root(chain_root, capsys):
    root, _ = chain_root
    assert cli.main(["ckpt", "inspect", os.path.join(root, "delta-0000000002")]) == 0
    out = capsys.readouterr().out
    assert f"one checkpoint's own directory; the root is its parent: evstore ckpt inspect {root}" in out


def test_inspect_lists_uncommitted_dirs_and_corrupt_manifests(chain_root, capsys):
    root, _ = chain_root
    os.makedirs(os.path.join(root, "delta-0000000004"))
    os.makedirs(os.path.join(root, "delta-0000000005"))
    with open(os.path.join(root, "delta-0000000005", "MANIFEST.json"), "w") as f:
        f.write("{not json")
    assert cli.main(["ckpt", "inspect", root]) == 0
    out = capsys.readouterr().out
    assert "uncommitted" in out and "delta-0000000004" in out
    assert "corrupt manifest (seq 5)" in out
    assert "restore() cannot run" in out   # a newer corrupt manifest stops restore() without a seq


def test_inspect_of_a_missing_root_is_one_line_on_stderr_and_exit_1(tmp_path):
    r = run_cli("inspect", str(tmp_path / "nowhere"))
    assert r.returncode == 1
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


# ---- verify ---------------------------------------------------------------------------------
def test_verify_cli_passes_a_sound_root(chain_root):
    root, _ = chain_root
    r = run_cli("verify", root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK: 3 checkpoint(s)")


def test_verify_cli_names_a_bit_flipped_data_file(chain_root):
    root, _ = chain_root
    path = data_file(os.path.join(root, "full-0000000001"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    r = run_cli("verify", root)
    assert r.returncode == 1
    line, verdict = r.stdout.splitlines()       # the whole report on stdout
    assert path in line and "crc32c" in line and "Traceback" not in r.stderr
    assert verdict.startswith("FAILED: 1 problem(s)") and r.stderr == ""


def test_verify_cli_names_a_truncated_index(chain_root):
    root, _ = chain_root
    path = os.path.join(root, "delta-0000000002", "ckpt.index")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    r = run_cli("verify", root)
    assert r.returncode == 1
    line, _ = r.stdout.splitlines()
    assert path in line and "truncated" in line


def test_verify_reports_a_missing_delta_as_a_chain_gap(chain_root, capsys):
    root, _ = chain_root
    os.remove(os.path.join(root, "delta-0000000002", "MANIFEST.json"))
    assert cli.main(["ckpt", "verify", root]) == 1
    out = capsys.readouterr().out
    assert "delta-0000000003 follows checkpoint 2" in out and "gap" in out


def test_verify_seq_checks_only_the_chain_restore_seq_applies(chain_root, capsys):
    root, _ = chain_root
    path = data_file(os.path.join(root, "delta-0000000003"))
    with open(path, "r+b") as f:
        f.write(b"\xff\xff")
    assert cli.main(["ckpt", "verify", root, "--seq", "2"]) == 0
    assert "the chain 1 -> 2 resolves" in capsys.readouterr().out
    assert cli.main(["ckpt", "verify", root, "--seq", "3"]) == 1
    assert path in capsys.readouterr().out


# ---- compact ----------------------------------------------------------------------------------
def test_compact_restores_bit_for_bit_like_the_chain(chain_root, capsys):
    root, live = chain_root
    chain_state, chain_meta = restored_state(root)
    assert chain_state == state(live)
    assert cli.main(["ckpt", "compact", root]) == 0
    assert "compacted 1 -> 2 -> 3 into full-0000000004" in capsys.readouterr().out
    model = make_model()
    mgr = manager_for(root, model)
    assert [m.seq for m in mgr.chain()] == [4]
    meta = mgr.restore()
    assert state(model) == chain_state
    assert meta == chain_meta == {"offset": 300}


def test_compact_writes_a_full_that_inspect_and_verify_accept(chain_root):
    root, _ = chain_root
    _, m = tools.compact(root)
    assert (m.kind, m.seq, m.parent, m.base, m.global_step) == ("full", 4, None, 4, 3)
    assert m.evs["user"]["slots"] == ["m", "v"] and m.evs["item"]["slots"] == []
    assert tools.inspect(root)["restore_chain"] == [4]
    checked, problems = tools.verify(root)
    assert problems == [] and [c.seq for c in checked] == [1, 2, 3, 4]


def test_compact_seq_folds_the_chain_restore_seq_applies(chain_root):
    root, _ = chain_root
    want, _ = restored_state(root, seq=2)
    tools.compact(root, seq=2)
    got, meta = restored_state(root)       # the compacted full is the newest checkpoint
    assert got == want and meta == {"offset": 200}


def test_training_resumes_with_deltas_on_a_compacted_full(chain_root):
    root, _ = chain_root
    tools.compact(root)
    model = make_model()
    mgr = manager_for(root, model)
    mgr.restore()
    train(model, 280, 330, seed=4)
    assert mgr.save_delta() == 5
    want = state(model)
    got, _ = restored_state(root)
    assert got == want


def test_compact_of_a_corrupt_chain_fails_naming_the_file_and_writes_nothing(chain_root, capsys):
    root, _ = chain_root
    path = data_file(os.path.join(root, "delta-0000000002"))
    with open(path, "r+b") as f:
        f.write(b"\x00\x01\x02")
    before = sorted(os.listdir(root))
    assert cli.main(["ckpt", "compact", root]) == 1
    err = capsys.readouterr().err
    assert path in err and err.count("\n") == 1
    assert sorted(os.listdir(root)) == before


def keras_model():
    ids = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(evstore.keras.Embedding(dim=4, name="ids_embedding")(ids))
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid", name="head")(x))
    model.compile(optimizer=evstore.optimizers.Adam(learning_rate=0.05), loss="binary_crossentropy")
    return model


def keras_state(model):
    (layer,) = [l for l in model.layers if isinstance(l, evstore.keras.Embedding)]
    ex = layer.ev.export()
    order = np.argsort(ex["keys"].numpy())
    out = {f: ex[f].numpy()[order].tobytes() for f in ("keys", "values", "versions", "freqs")}
    out.update({s: v.numpy()[order].tobytes() for s, v in ex["slots"].items()})
    dense = [v for v in list(model.variables) + list(model.optimizer.variables)
             if evstore.variable.ev_for_variable(v) is None]
    out.update({i: v.numpy().tobytes() for i, v in enumerate(dense)})   # Keras paths differ per model
    return out


def test_compact_of_a_keras_model_on_a_memory_root_restores_like_the_chain():
    root = f"memory://compact-{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    model = keras_model()
    mgr = CheckpointManager(root, model)
    for i in range(3):
        x = rng.integers(0, 500, size=(256, 2))
        model.fit(x, (x[:, :1] % 2).astype("float32"), epochs=1, batch_size=64, verbose=0)
        mgr.save_full() if i == 0 else mgr.save_delta(metadata={"epoch": i})
    chain_model = keras_model()
    CheckpointManager(root, chain_model).restore()
    want = keras_state(chain_model)
    assert want == keras_state(model)
    chain, m = tools.compact(root)
    assert [c.seq for c in chain] == [1, 2, 3] and m.seq == 4
    got_model = keras_model()
    got_mgr = CheckpointManager(root, got_model)
    assert [c.seq for c in got_mgr.chain()] == [4]
    assert got_mgr.restore() == {"epoch": 2}
    assert keras_state(got_model) == want


def test_compact_of_an_empty_root_is_a_clear_error(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert cli.main(["ckpt", "compact", str(tmp_path / "empty")]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err


# ---- to-parquet -----------------------------------------------------------------------------------
def test_to_parquet_rows_equal_ev_export(chain_root, tmp_path, capsys):
    root, live = chain_root
    out = tmp_path / "pq"
    assert cli.main(["ckpt", "to-parquet", root, str(out)]) == 0
    capsys.readouterr()
    for name in ("user", "item"):
        ex = live[name].export()
        order = np.argsort(ex["keys"].numpy())
        t = pq.read_table(out / f"{name}.parquet")
        slots = sorted(ex["slots"])
        assert t.column_names == ["key", "version", "freq", "value"] + [f"slot_{s}" for s in slots]
        dim = live[name].dim
        torder = np.argsort(t["key"].to_numpy())
        assert t["key"].type == ("int64" if name == "user" else "int32")
        np.testing.assert_array_equal(t["key"].to_numpy()[torder], ex["keys"].numpy()[order])
        np.testing.assert_array_equal(t["version"].to_numpy()[torder], ex["versions"].numpy()[order])
        np.testing.assert_array_equal(t["freq"].to_numpy()[torder], ex["freqs"].numpy()[order])

        def rows(column, torder=torder, dim=dim):
            return np.stack(column.to_numpy(zero_copy_only=False))[torder].reshape(-1, dim)

        assert rows(t["value"]).tobytes() == ex["values"].numpy()[order].tobytes()
        for s in slots:
            assert rows(t[f"slot_{s}"]).tobytes() == ex["slots"][s].numpy()[order].tobytes()
        f = pq.read_table(out / f"{name}.filtered.parquet")
        forder, eorder = np.argsort(f["key"].to_numpy()), np.argsort(ex["filtered_keys"].numpy())
        np.testing.assert_array_equal(f["key"].to_numpy()[forder], ex["filtered_keys"].numpy()[eorder])
        np.testing.assert_array_equal(f["freq"].to_numpy()[forder], ex["filtered_freqs"].numpy()[eorder])
        assert json.loads(t.schema.metadata[b"evstore"])["seq"] == 3


def test_to_parquet_seq_writes_the_state_restore_seq_gives(chain_root, tmp_path):
    root, _ = chain_root
    model = make_model()
    manager_for(root, model).restore(seq=1)
    res = tools.to_parquet(root, str(tmp_path / "pq1"), seq=1)
    assert res["seq"] == 1
    t = pq.read_table(res["files"]["user"]["rows"])
    assert sorted(t["key"].to_numpy().tolist()) == sorted(model["user"].export()["keys"].numpy().tolist())


def test_to_parquet_quotes_ev_names_holding_a_slash(tmp_path):
    ev = evstore.EmbeddingVariable("ns/user", dim=2)
    evstore.embedding_lookup(ev, tf.constant([4, 5], tf.int64))
    CheckpointManager(str(tmp_path / "ckpt"), {"ns/user": ev}).save_full()
    res = tools.to_parquet(str(tmp_path / "ckpt"), str(tmp_path / "pq"))
    assert os.path.basename(res["files"]["ns/user"]["rows"]) == "ns%2Fuser.parquet"
    assert sorted(pq.read_table(res["files"]["ns/user"]["rows"])["key"].to_pylist()) == [4, 5]


def test_to_parquet_of_an_empty_ev_writes_empty_files_with_the_schema(tmp_path):
    ev = evstore.EmbeddingVariable("empty", dim=3)
    CheckpointManager(str(tmp_path / "ckpt"), [ev]).save_full()
    res = tools.to_parquet(str(tmp_path / "ckpt"), str(tmp_path / "pq"))
    t = pq.read_table(res["files"]["empty"]["rows"])
    assert t.num_rows == 0 and t.column_names == ["key", "version", "freq", "value"]
    assert pq.read_table(res["files"]["empty"]["filtered"]).num_rows == 0
