"""The streaming job: `evstore demo` and `evstore train` as real processes,
asserting what their summaries claim; the stream, the spec and AUC."""
import difflib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from evstore_app.job.spec import SpecError, load_spec
from evstore_app.job.synthetic import ClickStream
from evstore_app.job.trainer import auc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The whole dataset when this checkout sits next to ../shared, else the slice shipped in examples/data.
_SHARED = os.path.join(os.path.dirname(REPO), "shared", "data", "movielens-small", "ratings.csv")
MOVIELENS = _SHARED if os.path.exists(_SHARED) else os.path.join(REPO, "examples", "data", "movielens",
                                                                  "ratings.csv")
SPEC = os.path.join(REPO, "examples", "movielens.json")


def _evstore(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "evstore_app.cli", *args], capture_output=True, text=True,
                       timeout=timeout)
    return p


def test_demo_serves_every_commit_restores_exactly_and_live_beats_frozen(tmp_path):
    # --keep-chains 1 with a full every 10 s: retention deletes whole chains during the run, and the
    # summary still counts every commit (from the run's history, not from what the root keeps).
    # --kafka: the stream goes through the bundled broker (the demo without one: test_demo_gate.py).
    out = tmp_path / "demo"
    p = _evstore("demo", "--kafka", "--minutes", "0.6", "--out", str(out), "--delta-every", "2", "--full-every", "10",
                 "--keep-chains", "1", "--warmup-batches", "30", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    k = s["kafka"]   # every message consumed was trained once, and the last commit holds the topic's offsets
    assert "the stream goes through Kafka topic evstore-demo-" in p.stderr and k["bundled_broker"]
    assert k["bad"] == 0 and k["messages"] == s["examples"] == sum(k["offsets"][k["topic"]].values())
    newest = max((d for d in os.listdir(out / "checkpoints") if d.startswith(("full-", "delta-"))),
                 key=lambda d: int(d.split("-")[1]))
    last = json.loads((out / "checkpoints" / newest / "MANIFEST.json").read_text())
    assert last["metadata"]["position"]["kafka"] == k["offsets"]
    sv, c = s["serving"], s["checkpoints"]
    assert sv["served_every_commit"] and sv["served_final"] and sv["apply_failures"] == 0, \
        {k: v for k, v in sv.items() if k != "freshness"}
    assert sv["committed_after_first_full"] >= 5
    assert sv["committed_after_first_full"] == len(c["commits"]) - 1 == c["fulls"] + c["deltas"] - 1
    surviving = [d for d in os.listdir(out / "checkpoints") if d.startswith(("full-", "delta-"))]
    assert len(surviving) < len(c["commits"])                  # retention did delete some
    assert s["restore_matches_trainer"] is True
    assert s["auc"]["live"] > s["auc"]["frozen"]
    assert c["fulls"] >= 2 and c["deltas"] >= 5
    assert "every one served: True" in p.stdout and "progressive AUC" in p.stdout
    assert os.listdir(out / "tensorboard")
    assert f"report: {out / 'report.png'}" in p.stdout
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "export" / "saved_model.pb").exists() and s["export"]["serve"] in p.stdout   # next to checkpoints/


def test_train_on_movielens_resumes_from_the_saved_position(tmp_path):
    root = str(tmp_path / "ckpt")
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", root, "--max-rows", "12000",
                 "--delta-every", "1", "--no-progress", "--out", str(tmp_path / "o1"))
    assert p.returncode == 0, p.stderr[-3000:]
    first = json.loads((tmp_path / "o1" / "summary.json").read_text())
    assert first["position"] == 12000 and first["restore_matches_trainer"] is True
    assert first["resumed_at"] is None and "resuming at row" not in p.stderr and "resumed at row" not in p.stdout
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", root, "--max-rows", "20000",
                 "--delta-every", "1", "--no-progress", "--out", str(tmp_path / "o2"))
    assert p.returncode == 0, p.stderr[-3000:]
    second = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert second["position"] == 20000 and second["examples"] == 20000   # 8000 new: none twice, none lost
    assert second["restore_matches_trainer"] is True
    assert 0.5 < second["auc"]["live"] < 1.0
    # The summary speaks of this run: where it resumed, its own examples and rate.
    assert second["resumed_at"] == 12000 and second["examples_this_session"] == 8000
    assert second["examples_per_s"] == pytest.approx(8000 / second["train_seconds"], rel=0.01)
    assert "resuming at row 12,000 of 20,000" in p.stderr
    assert "resumed at row 12,000" in p.stdout and "examples: 8,000 this run" in p.stdout


def test_train_on_a_finished_root_trains_and_commits_nothing(tmp_path):
    root = tmp_path / "ckpt"
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", str(root), "--max-rows", "3000",
                 "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    before = sorted(os.listdir(root))
    p = _evstore("train", "--data", MOVIELENS, "--spec", SPEC, "--checkpoints", str(root), "--max-rows", "3000",
                 "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(root)) == before                 # no empty delta
    s = json.loads((tmp_path / "ckpt.train" / "summary.json").read_text())   # the default --out of this root
    assert s["examples_this_session"] == 0 and s["checkpoints"]["deltas"] == 0
    assert "nothing new to train" in p.stdout and "nan" not in p.stdout.lower()
    assert s["restore_matches_trainer"] is True


def test_sigint_stops_train_with_a_final_delta_and_exit_130(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "evstore_app.cli", "train", "--data", MOVIELENS, "--spec", SPEC,
                             "--checkpoints", str(root), "--delta-every", "1", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not any(d.startswith("delta-") for d in (os.listdir(root) if root.exists() else [])):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT: stopping after this batch" in err and "restore of the final chain equals" in out
    s = json.loads((tmp_path / "ckpt.train" / "summary.json").read_text())
    last = max((d for d in os.listdir(root) if d.startswith(("full-", "delta-"))), key=lambda d: int(d[-10:]))
    assert json.loads((root / last / "MANIFEST.json").read_text())["metadata"]["position"] == s["position"]


def test_sigterm_stops_the_demo_gracefully_with_a_final_delta_served(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "evstore_app.cli", "demo", "--minutes", "10", "--out", str(out),
                             "--delta-every", "1", "--warmup-batches", "20", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = out / "checkpoints"
    deadline = time.time() + 240
    while not any(d.startswith("delta-") for d in (os.listdir(root) if root.exists() else [])):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["train_seconds"] < 300
    last = max((d for d in os.listdir(root) if d.startswith(("full-", "delta-"))), key=lambda d: int(d[-10:]))
    meta = json.loads((root / last / "MANIFEST.json").read_text())["metadata"]
    assert meta["examples"] == s["examples"]                  # the final delta holds everything trained
    assert s["serving"]["served_every_commit"] and s["restore_matches_trainer"] is True


def test_bad_spec_is_a_clear_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"label": {"column": "rating"}, "sparse": [{"name": "u", "column": "userId",
                                                                          "dim": 0}]}))
    p = _evstore("train", "--data", MOVIELENS, "--spec", str(bad), "--checkpoints", str(tmp_path / "c"))
    assert p.returncode == 1 and "sparse[0].dim must be a positive int" in p.stderr


def test_spec_rejects_duplicate_fields_and_unknown_filters():
    base = {"label": {"column": "y"}, "sparse": [{"name": "a", "column": "a", "dim": 4}] * 2}
    with pytest.raises(SpecError, match="two sparse fields are named 'a'"):
        load_spec(base)
    with pytest.raises(SpecError, match="filter"):
        load_spec({"label": {"column": "y"}, "sparse": [{"name": "a", "column": "a", "dim": 4,
                                                         "filter": {"sometimes": 1}}]})


@pytest.mark.parametrize("typo, message", [
    (("sparse", 0, "filtre"), "spec: sparse[0] has unknown key(s) 'filtre' (did you mean 'filter'?)"),
    (("hiden",), "spec has unknown key(s) 'hiden' (did you mean 'hidden'?)"),
    (("data", "join", 0, "colums"), "spec: data.join[0] has unknown key(s) 'colums' (did you mean 'columns'?)"),
])
def test_spec_rejects_unknown_keys_naming_them(typo, message):
    spec = json.loads(open(SPEC).read())
    node = spec
    for k in typo[:-1]:
        node = node[k]
    (right,) = difflib.get_close_matches(typo[-1], list(node), n=1)
    node[typo[-1]] = node.pop(right)         # the key misspelt
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert str(e.value).startswith(message)


def _tiny_data(tmp_path):
    (tmp_path / "events.csv").write_text("user,item,ts,y\n" + "".join(
        f"{u},{i},{ts},{y}\n" for u, i, ts, y in [(1, 10, 5, 1), (2, 11, 5, 0), (3, 10, 1, 1), (4, 12, 5, 0),
                                                   (5, 11, 1, 0), (6, 10, 9, 1)]))
    (tmp_path / "items.csv").write_text("item,kind\n10,a\n11,b\n12,c\n")
    return {"data": {"format": "csv", "timestamp": "ts",
                     "join": [{"file": "items.csv", "on": "item", "columns": ["kind"]}]},
            "label": {"column": "y"}, "sparse": [{"name": "u", "column": "user", "dim": 2},
                                                 {"name": "k", "column": "kind", "dim": 2, "keys": "string"}],
            "batch_size": 2}


def test_a_join_column_typo_is_one_line_naming_the_file_and_column(tmp_path):
    from evstore_app.job.source import FileStream
    spec = _tiny_data(tmp_path)
    spec["data"]["join"][0]["columns"] = ["kinds"]
    with pytest.raises(ValueError) as e:
        FileStream(str(tmp_path / "events.csv"), load_spec(spec))
    assert str(e.value) == (f"spec: data.join[0]: {tmp_path / 'items.csv'} has no column(s) ['kinds'] "
                            "(it has ['item', 'kind'])")


def test_input_order_is_timestamp_then_read_order_whatever_the_join_does(tmp_path):
    from evstore_app.job.source import FileStream
    spec = load_spec(_tiny_data(tmp_path))
    a = FileStream(str(tmp_path / "events.csv"), spec)
    b = FileStream(str(tmp_path / "events.csv"), spec)
    assert a.cols["user"].tolist() == [3, 5, 1, 2, 4, 6]     # ts 1, 1, 5, 5, 5, 9; ties in file order
    assert all(np.array_equal(a.cols[c], b.cols[c]) for c in a.cols)


def test_an_s3_root_without_s3fs_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['s3fs'] = None; from evstore_app.cli import main; "
            f"sys.exit(main(['train', '--data', {MOVIELENS!r}, '--spec', {SPEC!r}, '--checkpoints', "
            "'s3://bucket/ckpt', '--no-progress']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        "evstore train: checkpoint root s3://bucket/ckpt: Install s3fs to access S3 (pip install 'evstore[s3]')"]


def test_rows_over_time_shows_no_point_twice():
    from evstore_app.job.report import _pick
    pts = list(range(9))
    assert _pick(pts) == sorted(set(_pick(pts))) and _pick(pts)[0] == 0 and _pick(pts)[-1] == 8
    assert _pick([1, 2, 3]) == [1, 2, 3]


def test_train_writes_next_to_its_own_root_by_default():
    from evstore_app.job.train import default_out
    assert default_out("/data/a/ckpt") == "/data/a/ckpt.train"
    assert default_out("/data/a/other/") == "/data/a/other.train"
    assert default_out("memory://job1").endswith("/evstore-train-job1")
    assert default_out("s3://bucket/jobs/ctr").endswith("/evstore-train-ctr")


def test_synthetic_stream_is_reproducible_and_drifts():
    a, b = ClickStream(seed=3, batch_size=256), ClickStream(seed=3, batch_size=256)
    (ca, ya), (cb, yb) = a.batch(17), b.batch(17)
    assert all(np.array_equal(ca[k], cb[k]) for k in ca) and np.array_equal(ya, yb)
    early = set(a.batch(0)[0]["user"].tolist())
    late = set(a.batch(5000)[0]["user"].tolist())
    assert len(late - early) > len(late) // 4      # new users keep arriving
    assert 0.05 < float(np.mean(np.concatenate([a.batch(i)[1] for i in range(20)]))) < 0.95


def test_auc_matches_the_rank_statistic():
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([0, 0, 1, 1], [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert auc([0, 1, 1, 0], [0.1, 0.4, 0.35, 0.8]) == 0.5
    assert np.isnan(auc([1, 1], [0.2, 0.3]))
