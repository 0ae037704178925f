"""bench/run.py (`make bench`) keeps what it measured when it is stopped part-way.

A real run of two tiny table configurations, killed with SIGKILL as soon as the
first one's partial record exists: `--render` of that record prints its row.
"""
import glob
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--batches", "1", "--warmup", "0", "--batch", "256", "--no-tfra", "--opt-max-keys", "0", "--no-checkpoint",
         "--no-serving", "--no-cluster", "--no-filters", "--no-e2e", "--no-tiered"]


def test_a_run_killed_after_its_first_part_leaves_a_partial_record_that_renders(tmp_path):
    cmd = [sys.executable, "-m", "bench.run", "--matrix", "3000x16,3000x64", "--out-dir", str(tmp_path)] + SMALL
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not glob.glob(str(tmp_path / "bench-*.partial.json")) and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    partial = glob.glob(str(tmp_path / "bench-*.partial.json"))
    assert partial, "no partial record appeared"
    out = subprocess.run([sys.executable, "-m", "bench.run", "--render", partial[0]], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "| 0.003M | 16 |" in out

