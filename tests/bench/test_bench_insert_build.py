"""bench/tables/bench_insert_build.py builds evstore and DenseHashTable from empty with the same new keys and
times every batch (growth included).

One tiny run; no timing thresholds: only that both tables end with every key and the fields are there,
and that the DenseHashTable memory it reports follows TF's doubling rule.
"""
import gc
import json
import os
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.tables.bench_insert_build import build_batches, dense_hash_buckets  # noqa: E402


def test_a_tiny_build_gives_both_tables_every_key_and_reports_wall_cpu_and_bytes():
    out = subprocess.run([sys.executable, "-m", "bench.tables.bench_insert_build", "--keys", "3000", "--dim", "8",
                          "--batch", "1000", "--rounds", "2"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=240).stdout
    data = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert len(data["rounds"]) == 2 and len(data["ratio_cpu"]) == 2
    for rnd in data["rounds"]:
        assert rnd["evstore"]["size"] == 3000 and rnd["dense_hash"]["size"] == 3000
    for system in ("evstore", "dense_hash"):
        assert data[system]["rate_wall"] > 0 and data[system]["rate_cpu"] > 0 and data[system]["bytes_per_key"] > 0


def test_dense_hash_buckets_double_before_a_batch_would_pass_four_fifths_full():
    assert dense_hash_buckets(3000, 1000) == 131072
    assert dense_hash_buckets(104857, 65536) == 131072     # 104,857 <= 0.8 x 131,072
    assert dense_hash_buckets(104858, 65536) == 262144     # the second batch would pass it
    assert dense_hash_buckets(65536, 65536) == 131072
    assert dense_hash_buckets(1_000_000, 65536) == 2 ** 21
    assert dense_hash_buckets(10_000_000, 65536) == 2 ** 24


def test_every_batch_is_timed_with_the_garbage_collector_off_and_it_is_on_again_after():
    seen = []
    run = {"evstore": lambda k: seen.append(gc.isenabled()), "dense_hash": lambda k: seen.append(gc.isenabled())}
    tot = {s: {"wall_s": 0.0, "cpu_s": 0.0, "batches_s": []} for s in run}
    build_batches(SimpleNamespace(keys=10, batch=3), SimpleNamespace(constant=list), run, tot)
    assert seen == [False] * 8 and gc.isenabled()
    assert len(tot["evstore"]["batches_s"]) == len(tot["dense_hash"]["batches_s"]) == 4
