"""bench/tables/bench_insert_cpu.py reports wall and CPU time per batch of finds and of new keys for evstore and DenseHashTable.

One tiny run, huge pages off (the prctl path); no timing thresholds: only that
every system inserted and the fields are there.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_tiny_run_reports_wall_and_cpu_per_batch_for_both_systems_and_phases():
    out = subprocess.run([sys.executable, "-m", "bench.tables.bench_insert_cpu", "--keys", "5000", "--dim", "16",
                          "--batch", "512", "--batches", "2", "--warmup", "0", "--no-thp"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=240).stdout
    data = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert data["thp"] is False
    for system in ("evstore", "dense_hash"):
        for phase in ("find", "insert"):
            assert data[system][phase]["rate"] > 0 and len(data[system][phase]["wall_cpu_ms"]) == 2
    assert isinstance(data["thread_cpu_s"], list)  # clock ticks: empty for a run this short
