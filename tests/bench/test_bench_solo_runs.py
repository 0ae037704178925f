"""bench/tables/solo_runs.py: a table configuration too large for one process runs one system per process,
in rounds, and renders like the others (`make bench`'s 10M x 64 cells)."""
import glob
import json
import subprocess
import sys

from bench.tables.solo_runs import build_solo, order, pool
from test_bench_run_partial import ROOT, SMALL


def test_a_system_s_rate_is_the_median_of_its_batches_pooled_over_its_rounds():
    rounds = [{"find": 99.0, "find_batch_s": [[1.0], [3.0]], "fill_s": 7.0},
              {"find": 1.0, "find_batch_s": [[2.0], [4.0], [5.0]], "fill_s": 8.0}]
    merged = pool(rounds, batch=30)
    assert merged["find"] == 10.0                     # 30 keys / the median of 1, 3, 2, 4, 5 seconds
    assert merged["find_s_min_med_max"] == [1.0, 3.0, 5.0]
    assert merged["fill_s"] == 7.0 and merged["rounds_pooled"] == 2


def test_keys_per_cpu_second_are_pooled_over_the_rounds_as_the_rates_are():
    merged = pool([{"find_batch_s": [[1.0]], "find_batch_cpu_s": [2.0]},
                   {"find_batch_s": [[1.0], [1.0]], "find_batch_cpu_s": [6.0, 4.0]}], batch=8)
    assert merged["find_cpu"] == 2.0 and merged["find_batch_cpu_s"] == [2.0, 6.0, 4.0]


def test_a_training_step_s_apply_rate_is_pooled_beside_the_step_s():
    merged = pool([{"train_step_batch_s": [[2.0, 1.0]]}, {"train_step_batch_s": [[4.0, 0.5]]}], batch=6)
    assert merged["train_step"] == 2.0 and merged["train_apply"] == 8.0


def test_each_round_runs_the_processes_in_the_reverse_order_of_the_one_before():
    assert order(3, with_tfra=True) == [["evstore", "dense_hash", "tfra"], ["tfra", "dense_hash", "evstore"],
                                        ["evstore", "dense_hash", "tfra"]]
    assert order(2, with_tfra=False) == [["evstore", "dense_hash"], ["dense_hash", "evstore"]]


def _built(system, cpu_s, wall_s):
    """bench_insert_build's result for one table built alone (1,000 keys)."""
    figures = {"rate_wall": 1000 / wall_s, "rate_cpu": 1000 / cpu_s, "bytes_per_key": 9.0,
               "batch_s_median": wall_s, "batch_s_max": wall_s}
    return {"keys": 1000, "dim": 8, "batch": 100, "tf_version": "x", "rss_peak_mib": 5.0,
            "rounds": [{system: figures}], system: figures}


def test_a_build_one_table_per_process_pairs_each_round_s_two_tables_by_cpu_and_by_wall():
    cpu = {"evstore1": 1.0, "dense_hash1": 2.0, "dense_hash2": 3.0, "evstore2": 6.0}
    ran = []

    def run_one(tag, system):
        ran.append((tag, system))
        return _built(system, cpu_s=cpu[tag], wall_s=10.0 if system == "evstore" else 5.0)
    res = build_solo(run_one, rounds=2)
    assert ran == [("evstore1", "evstore"), ("dense_hash1", "dense_hash"), ("dense_hash2", "dense_hash"),
                   ("evstore2", "evstore")]
    assert res["ratio_cpu"] == [2.0, 0.5] and res["ratio_wall"] == [0.5, 0.5]
    assert res["keys"] == 1000 and len(res["rounds"]) == 2 and not res["solo"]["errors"]


def test_a_round_whose_build_process_failed_is_left_out_of_the_pairing_and_named():
    def run_one(tag, system):
        return {"error": "exit 3"} if tag == "dense_hash1" else _built(system, cpu_s=1.0, wall_s=1.0)
    res = build_solo(run_one, rounds=2)
    assert res["ratio_cpu"] == [1.0] and res["solo"]["errors"] == ["round 1 dense_hash: exit 3"]
    assert "error" in build_solo(lambda tag, system: {"error": "exit 3"}, rounds=1)


def test_a_configuration_over_the_solo_bound_runs_one_system_per_process_and_renders_as_the_others(tmp_path):
    cmd = [sys.executable, "-m", "bench.run", "--matrix", "3000x16", "--out-dir", str(tmp_path),
           "--solo-above-mib", "0", "--solo-rounds", "2"] + SMALL
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (path,) = glob.glob(str(tmp_path / "bench-*.json"))
    with open(path) as f:
        (res,) = json.load(f)["results"]
    assert [(p["round"], p["process"]) for p in res["solo"]["processes"]] == \
        [(1, "evstore"), (1, "dense_hash"), (2, "dense_hash"), (2, "evstore")]
    assert res["A"]["evstore"] is not None and res["A"]["evstore"] == res["B"]["evstore"]
    assert res["A"]["evstore"]["rounds_pooled"] == res["A"]["dense_hash"]["rounds_pooled"] == 2
    assert res["A"]["numpy"]["gather"] > 0 and res["A"]["dense_hash"]["insert_new"] > 0
    assert res["A"]["evstore"]["find_cpu"] > 0 and len(res["A"]["dense_hash"]["find_batch_cpu_s"]) == 2
    assert "| 0.003M | 16 |" in out and "3000x16 ran one system per process" in out
    assert "3000x16 by CPU time per key" in out
    assert [(p["round"], p["process"]) for p in res["I"]["solo"]["processes"]] == \
        [(1, "evstore"), (1, "dense_hash"), (2, "dense_hash"), (2, "evstore")]
    assert len(res["I"]["ratio_cpu"]) == len(res["I"]["ratio_wall"]) == 2
    assert all(rnd["evstore"]["size"] == rnd["dense_hash"]["size"] == 3000 for rnd in res["I"]["rounds"])
    assert "3000x16 run I built one table per process" in out


def test_run_i_is_skipped_by_its_flag_and_the_notes_say_so(tmp_path):
    cmd = [sys.executable, "-m", "bench.run", "--matrix", "3000x16", "--out-dir", str(tmp_path),
           "--no-insert-build"] + SMALL
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (path,) = glob.glob(str(tmp_path / "bench-*.json"))
    with open(path) as f:
        (res,) = json.load(f)["results"]
    assert res["I"] == {"skipped": "--no-insert-build"} and res["A"]["evstore"]["find"] > 0
    assert "3000x16 run I skipped (--no-insert-build)" in out


def test_only_run_i_runs_with_its_flag_and_only_its_table_is_printed(tmp_path):
    cmd = [sys.executable, "-m", "bench.run", "--matrix", "3000x64", "--out-dir", str(tmp_path), "--batch", "256",
           "--only-insert-build", "--solo-above-mib", "0", "--solo-rounds", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (path,) = glob.glob(str(tmp_path / "bench-*.json"))
    with open(path) as f:
        data = json.load(f)
    (res,) = data["results"]
    assert set(res) == {"keys", "dim", "I"} and data["checkpoint"] is None and data["cluster"] is None
    assert [p["process"] for p in res["I"]["solo"]["processes"]] == ["evstore", "dense_hash"]
    assert "(run I; M keys/s)" in out and "Read-only find" not in out
