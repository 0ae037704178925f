"""bench/cluster/bench_cluster.py (python -m bench.cluster.bench_cluster) runs the evstore side end to end on a loopback cluster and reports its fields.

One quick run (2 PS, 1 worker, batch 256, 8 timed steps), a real cluster of
processes; no timing thresholds: only that the result has the measured fields.
"""
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_reports_examples_bytes_and_rpcs_per_step(tmp_path):
    cmd = [sys.executable, "-m", "bench.cluster.bench_cluster", "--quick", "--systems", "evstore",
           "--worker-counts", "1", "--ps-counts", "", "--steps", "4", "--out-dir", str(tmp_path)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out[-3000:]
    data = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    r = data["results"]["evstore/ps2/w1"]
    assert r["examples_per_s"] > 0
    assert r["per_step"]["worker_to_ps_bytes"] > 0 and r["per_step"]["ps_to_worker_bytes"] > 0
    assert r["per_step"]["worker_ps_rpcs"] > 0
    assert r["analytic_min"]["embedding_bytes"] > 0
    assert os.path.exists(os.path.join(ROOT, data["files"] + ".md"))
