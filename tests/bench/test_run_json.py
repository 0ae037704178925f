"""bench/harness/peers.run_json: what a benchmark process's exit status and last JSON line give back."""
import sys

from bench.harness.peers import run_json

PRINTS_THEN_EXITS_1 = [sys.executable, "-c", "print('{\"rows\": 3}'); raise SystemExit(1)"]


def test_a_process_that_printed_its_result_and_exited_1_is_an_error_by_default():
    assert "error" in run_json(PRINTS_THEN_EXITS_1, None)


def test_with_partial_ok_its_result_is_kept_with_the_exit_status():
    res = run_json(PRINTS_THEN_EXITS_1, None, partial_ok=True)
    assert res["rows"] == 3 and res["exit_status"] == 1


def test_with_partial_ok_a_process_that_printed_nothing_is_still_an_error():
    assert "error" in run_json([sys.executable, "-c", "raise SystemExit(1)"], None, partial_ok=True)


def test_a_failed_process_s_error_carries_the_last_line_of_its_log(tmp_path):
    says_why = [sys.executable, "-c", "import sys; print('MemAvailable 900 MiB < 1024 MiB: stopping', file=sys.stderr);"
                " raise SystemExit(3)"]
    err = run_json(says_why, str(tmp_path / "b.log"))["error"]
    assert "exit 3: MemAvailable 900 MiB < 1024 MiB: stopping" in err
