"""bench/tables/solo_runs.py: a table configuration too large for one process runs one system per process,
in rounds, and renders like the others (`make bench`'s 10M x 64 cells)."""
import glob
import json
import subprocess
import sys

from bench.tables.solo_runs import order, pool
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
