"""bench/harness/rss.py's process-tree figures and memory guard, which the object-store benchmark at size
relies on: TreeUsage counts what a child process holds, labelled by its command line, and the disk its
files take; guard_available_memory stops the benchmark and everything it started once the machine's
available memory falls under the floor. Real processes, no timing thresholds."""
import os
import subprocess
import sys
import textwrap
import time

from bench.harness.rss import TreeUsage, descendants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLDER = "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); " \
         "time.sleep(60)"


def test_tree_usage_counts_a_childs_memory_under_its_label_and_the_files_under_a_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"\0" * (3 << 20))
    child = subprocess.Popen([sys.executable, "-c", HOLDER, "memory-holder"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert child.pid in descendants(os.getpid())
        with TreeUsage(label=lambda cmd: "holder" if "memory-holder" in cmd else "",
                       disk_dirs=[str(tmp_path)], interval=0.05, disk_interval=0.05) as u:
            for _ in range(600):   # until both were sampled (at most 30 s: a hang is a failure, not a wait)
                if "holder" in u.hwm and u.disk_peak:
                    break
                time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    d = u.as_dict()
    assert d["rss_peak_mib"]["holder"] >= 64
    assert d["rss_sum_peak_mib"] >= d["rss_peak_mib"]["holder"]
    assert d["disk_peak_mib"] == 3


def test_the_memory_guard_kills_what_the_benchmark_started_and_exits_3_under_the_floor(tmp_path):
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from bench.harness.rss import guard_available_memory
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        guard_available_memory(10 ** 9, interval=0.05,
                               on_low=lambda avail: open({str(tmp_path / 'low')!r}, 'w').write(str(avail)))
        time.sleep(60)
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert "stopping this benchmark" in p.stderr
    assert (tmp_path / "low").exists()
    child = int(p.stdout.split()[0])
    assert _ends(child), f"process {child} the benchmark started is still running"


def _ends(pid):
    """True once `pid` is gone or a zombie (a SIGKILLed process dies when next scheduled: on a loaded
    machine not at once; at most 30 s: a hang is a failure, not a wait)."""
    for _ in range(600):
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
