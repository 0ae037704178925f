"""`evstore` follows command-line conventions: --help and --version answer
without importing TensorFlow, TensorFlow's log lines only with --verbose,
usage errors exit 2, runtime errors 1 (one line on stderr), every flag has
help, and --delta-every means seconds wherever it exists."""
import argparse
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "evstore_app", *args]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}   # as a user's shell has it
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def _parsers():
    from evstore_app.cli import build_parser
    todo, seen = [("evstore", build_parser())], []
    while todo:
        name, p = todo.pop()
        seen.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}", sp) for n, sp in a.choices.items()]
    return seen


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["ckpt", "inspect", "--help"], ["--version"]])
def test_help_and_version_do_not_import_tensorflow(args):
    code = ("import sys\nfrom evstore_app.cli import main\ntry:\n    main(%r)\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint('tensorflow imported:', 'tensorflow' in sys.modules)" % (args,))
    p = _run(code=code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith("tensorflow imported: False")


def test_version_names_the_installed_release():
    from importlib.metadata import version
    p = _run("--version")
    assert (p.returncode, p.stdout.strip()) == (0, f"evstore {version('evstore')}")


def test_usage_errors_exit_2():
    p = _run("train", "--data", "x")
    assert p.returncode == 2 and "the following arguments are required: --spec, --checkpoints" in p.stderr


def test_a_runtime_error_is_one_line_on_stderr_with_no_tensorflow_log_and_exit_1(tmp_path):
    p = _run("ckpt", "inspect", str(tmp_path / "nowhere"))
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"evstore ckpt inspect: error: checkpoint root {tmp_path / 'nowhere'} does not exist"]
    assert p.stdout == ""


def test_serve_runtime_errors_exit_1_like_the_other_commands(tmp_path):
    p = _run("serve", "--export", str(tmp_path / "no-export"), "--port", "0", "--rest_api_port", "0")
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[-1].startswith("evstore serve: ") and "Traceback" not in p.stderr


def test_every_flag_has_help():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in _parsers() for a in p._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert missing == []


def test_delta_every_means_seconds_wherever_it_exists():
    for name, p in _parsers():
        for a in p._actions:
            if "--delta-every" in a.option_strings or "--full-every" in a.option_strings:
                assert a.metavar == "SECONDS" and "seconds" in a.help, name
            if any(o.endswith("-every-steps") for o in a.option_strings):
                assert a.metavar == "STEPS", name
