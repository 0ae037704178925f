"""From training to serving in one step, as real processes: `evstore train
--export` on the MovieLens slice, `evstore serve` on what it wrote, a query
answered with the trainer's predictions; and `evstore serve` refusing a root
it has nothing to serve from (one line, non-zero exit) unless --allow-empty."""
import json
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from serve_proc import Server, evstore, last_line, predict_columns, wait_until  # noqa: E402

DATA = os.path.join(REPO, "examples", "data", "movielens", "ratings.csv")
SPEC = os.path.join(REPO, "examples", "movielens.json")


def _train(tmp, rows, out):
    return evstore("train", "--data", DATA, "--spec", SPEC, "--checkpoints", str(tmp / "ckpt"), "--export",
                   str(tmp / "export"), "--max-rows", str(rows), "--delta-every", "1", "--no-progress",
                   "--out", str(tmp / out))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-export")
    p = _train(tmp, 3000, "o1")
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp, json.loads((tmp / "o1" / "summary.json").read_text()), p.stdout


def _queries():
    """Model inputs of the slice's last rows (ids as the trainer computes them)."""
    from evstore_app.job.source import FileStream
    from evstore_app.job.spec import load_spec
    spec = load_spec(SPEC)
    _, (cols, _) = next(FileStream(DATA, spec).batches(29000))
    from evstore_app.job.model import model_inputs
    return spec, {k: v[:16] for k, v in model_inputs(spec, cols).items()}


def test_train_export_writes_the_serving_export_next_to_the_checkpoints(trained):
    tmp, summary, stdout = trained
    assert summary["export"]["written"] is True
    assert os.path.exists(tmp / "export" / "saved_model.pb")
    assert os.path.exists(tmp / "export" / "assets.extra" / "evstore_serving.json")
    assert f"evstore serve --export {tmp / 'export'} --checkpoints {tmp / 'ckpt'} --model_name movielens" in stdout


def test_the_first_runs_summary_calls_its_full_the_initial_untrained_model(trained):
    _, summary, stdout = trained
    c = summary["checkpoints"]
    assert (c["fulls"], c["untrained_fulls"]) == (1, 1) and c["deltas"] >= 1
    (line,) = [x for x in stdout.splitlines() if x.startswith("checkpoints: ")]
    assert line.startswith("checkpoints: 1 full (the initial, untrained model: "), line
    assert "1 fulls" not in line and "1 deltas" not in line


@pytest.fixture(scope="module")
def export_alone(tmp_path_factory):
    """`evstore train --max-rows 0 --export`: (its directory, the CompletedProcess)."""
    tmp = tmp_path_factory.mktemp("export-alone")
    return tmp, _train(tmp, 0, "o")


def test_train_max_rows_0_with_export_writes_the_export_alone(export_alone):
    tmp, p = export_alone
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert os.path.exists(tmp / "export" / "assets.extra" / "evstore_serving.json")
    assert not os.path.exists(tmp / "ckpt") or not any(n.startswith(("full-", "delta-"))
                                                       for n in os.listdir(tmp / "ckpt"))
    assert "nothing to train: no rows (--max-rows 0 or empty data); no checkpoint committed" in p.stdout
    assert "--model_name movielens" in p.stdout


def test_serve_of_a_directory_without_an_export_names_the_command_that_writes_one(tmp_path):
    p = evstore("serve", "--export", str(tmp_path), "--allow-empty", "--port", "0", "--rest_api_port", "0")
    assert p.returncode == 1 and not p.stdout
    line = last_line(p.stderr)
    assert line.startswith(f"evstore serve: {tmp_path} is not an evstore serving export"), line
    assert line.endswith(f"from the command line: evstore train --data DATA --spec SPEC --checkpoints ROOT "
                         f"--export {tmp_path} --max-rows 0 writes the export alone"), line


def test_train_export_then_serve_answers_with_the_trainers_predictions(trained):
    import checkpoint
    from evstore_app.job.model import build_model

    tmp, summary, _ = trained
    spec, x = _queries()
    model = build_model(spec)
    checkpoint.CheckpointManager(str(tmp / "ckpt"), model).restore()   # the trainer's final state
    server = Server(str(tmp), str(tmp / "export"), str(tmp / "ckpt"), name="movielens")
    try:
        assert server.version() == summary["checkpoints"]["final"]
        got = np.asarray(predict_columns(server, x))
        np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
        assert got.shape == (16, 1) and np.all((got > 0) & (got < 1))
    finally:
        assert server.stop() == 0


def test_resumed_training_keeps_the_export_of_the_same_model(trained):
    tmp, _, _ = trained
    before = os.stat(tmp / "export" / "saved_model.pb").st_mtime_ns
    p = _train(tmp, 3500, "o2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp / "o2" / "summary.json").read_text())["export"]["written"] is False
    assert os.stat(tmp / "export" / "saved_model.pb").st_mtime_ns == before


def test_an_export_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    import serving_loader
    from evstore_app.job.model import build_model
    from evstore_app.job.spec import load_spec

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no evstore serving export"):
        serving_loader.ensure_serving_export(build_model(load_spec(SPEC)), str(tmp_path / "export"))
    assert os.listdir(tmp_path / "export") == ["notes.txt"] and os.listdir(tmp_path) == ["export"]


def test_serve_on_a_missing_root_exits_non_zero_with_a_one_line_reason(trained, tmp_path):
    tmp, _, _ = trained
    p = evstore("serve", "--export", str(tmp / "export"), "--checkpoints", str(tmp_path / "nope"), "--port", "0", "--rest_api_port", "0")
    assert p.returncode != 0 and not p.stdout
    assert last_line(p.stderr) == (f"evstore serve: checkpoint root {tmp_path / 'nope'} does not exist "
                                   "(--allow-empty serves the export as it is)")


def test_serve_on_an_empty_root_exits_non_zero_with_a_one_line_reason(trained, tmp_path):
    tmp, _, _ = trained
    p = evstore("serve", "--export", str(tmp / "export"), "--checkpoints", str(tmp_path), "--port", "0", "--rest_api_port", "0")
    assert p.returncode != 0 and not p.stdout
    assert last_line(p.stderr).startswith(f"evstore serve: checkpoint root {tmp_path} holds no committed checkpoint")


def test_serve_on_a_root_of_another_model_exits_non_zero_with_a_one_line_reason(trained, tmp_path):
    import keras

    import checkpoint
    import evstore as ev

    tmp, _, _ = trained
    ids = keras.Input(shape=(1,), dtype="int64", name="ids")
    other = keras.Model(ids, keras.layers.Flatten()(ev.keras.Embedding(4, name="clicks")(ids)))
    other(np.array([[1]]))
    checkpoint.CheckpointManager(str(tmp_path / "other"), other).save_full()
    p = evstore("serve", "--export", str(tmp / "export"), "--checkpoints", str(tmp_path / "other"), "--port", "0", "--rest_api_port", "0")
    assert p.returncode != 0 and not p.stdout
    line = last_line(p.stderr)
    assert line.startswith(f"evstore serve: checkpoint root {tmp_path / 'other'} holds none of the export's "
                           "tables ['genre', 'movie', 'user']"), line


def test_serve_with_allow_empty_serves_the_export_and_applies_the_first_commit(trained, export_alone, tmp_path):
    """The newcomer's order: `train --max-rows 0 --export` writes the export, `serve --allow-empty`
    serves it, and the first commit of the root is applied when it appears."""
    import shutil

    tmp, _, _ = trained
    alone, p = export_alone
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path / "later"
    server = Server(str(tmp_path), str(alone / "export"), str(root), name="m", extra=["--allow-empty"])
    try:
        assert server.version() == 0            # the export as written
        shutil.copytree(tmp / "ckpt", tmp_path / "staging")
        os.rename(tmp_path / "staging", root)   # the trainer's commits arrive
        wait_until(lambda: server.version() > 0, "the first commit to be served")
    finally:
        assert server.stop() == 0


def test_train_export_tables_evstore_writes_the_export_that_tiered_serving_takes(trained, tmp_path):
    import checkpoint
    from evstore_app.job.model import build_model

    tmp, _, _ = trained
    p = evstore("train", "--data", DATA, "--spec", SPEC, "--checkpoints", str(tmp_path / "ckpt"), "--export",
                str(tmp_path / "export"), "--export-tables", "evstore", "--max-rows", "0", "--no-progress",
                "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "export" / "assets.extra" / "evstore_serving.json").read_text())["tables"] == \
        "evstore"
    spec, x = _queries()
    model = build_model(spec)
    manager = checkpoint.CheckpointManager(str(tmp / "ckpt"), model)
    manager.restore()      # the root's newest commit (an earlier test of this module may have trained on)
    server = Server(str(tmp_path), str(tmp_path / "export"), str(tmp / "ckpt"), name="movielens",
                    extra=["--tiered-dram-bytes", "65536"])     # rows on disk behind a small DRAM cache
    try:
        assert server.version() == manager.last_committed.seq
        np.testing.assert_allclose(np.asarray(predict_columns(server, x)), model.predict(x, verbose=0), rtol=1e-5,
                                   atol=1e-6)
    finally:
        assert server.stop() == 0
