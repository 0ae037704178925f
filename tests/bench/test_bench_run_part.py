"""bench/run.run_part: a part of `make bench` that fails or outlives its bound gives a reason, and the run goes on."""
import sys

from bench.run import run_part

# The part's driver starts a worker (as bench_e2e does), prints the worker's pid, then waits on it. A shell
# starts its worker within milliseconds of its exec, so the worker exists long before the part's bound even on
# a loaded machine (a Python driver's start-up alone can take seconds there).
DRIVER_WITH_A_WORKER = ["sh", "-c", "sleep 600 & echo $!; wait"]


def gone(pid):
    """Whether the process is gone or a zombie (killed, not yet reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_part_past_its_time_bound_is_stopped_with_its_workers_and_says_so(tmp_path):
    out, reason = run_part(DRIVER_WITH_A_WORKER, str(tmp_path / "part.log"), timeout=2)
    assert reason == "stopped after 2 s (the part's time bound, --part-timeout)"
    assert gone(int(out.split()[0]))


def test_a_failed_part_s_reason_carries_its_exit_status_and_last_log_line(tmp_path):
    fails = [sys.executable, "-c", "import sys; print('no TFRA venv', file=sys.stderr); raise SystemExit(2)"]
    assert run_part(fails, str(tmp_path / "part.log"), timeout=60)[1] == "failed (exit 2: no TFRA venv)"


def test_a_part_that_exits_0_gives_its_output_and_no_reason(tmp_path):
    assert run_part([sys.executable, "-c", "print('| table |')"], str(tmp_path / "p.log"), timeout=60) == \
        ("| table |\n", None)
