"""Builds and runs the TF-free native core test binaries (evstore/native/core/*_test.cc).

Three builds: with AddressSanitizer + UndefinedBehaviorSanitizer at -O2,
without sanitizers at -O3 (catches optimisation-dependent bugs), and -O2 with
EVSTORE_PORTABLE_PROBE, the second configuration of the index: the portable
group probe instead of SSE2 (group_probe.h; the build aarch64 gets). Each runs
as a real process; the test fails on a non-zero exit and shows the binary's
output.
"""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "evstore" / "native" / "core"
SOURCES = sorted(CORE.glob("*_test.cc"))
GXX = shutil.which("g++")
# The core includes FarmHash from TensorFlow's include dir (string_hash.h);
# found without importing TensorFlow.
TF_INCLUDE = str(Path(importlib.util.find_spec("tensorflow").submodule_search_locations[0]) / "include")

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found")

SANITIZED = ["-O2", "-g", "-fsanitize=address,undefined"]
OPTIMISED = ["-O3"]
PORTABLE_PROBE = ["-O2", "-DEVSTORE_PORTABLE_PROBE"]


def _build(tmp_path: Path, source: Path, flags: list) -> Path:
    exe = tmp_path / (source.stem + "_" + "_".join(f.lstrip("-").split("=")[0] for f in flags[:2]).lower())
    cmd = [GXX, "-std=c++17", *flags, "-pthread", "-I", str(CORE), "-I", TF_INCLUDE, str(source), "-o", str(exe)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"build failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return exe


def _run(exe: Path) -> str:
    env = dict(os.environ)
    # UBSan reports are recoverable by default: make them fatal.
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
    proc = subprocess.run([str(exe)], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, f"{exe.name} exited with {proc.returncode}\n{output}"
    assert "all tests passed" in proc.stdout, output
    print(proc.stdout)  # visible with -s: per-test "ok" lines and the bytes/key figure
    return proc.stdout


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_core_sanitized(tmp_path, source):
    _run(_build(tmp_path, source, SANITIZED))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_core_optimised_o3(tmp_path, source):
    _run(_build(tmp_path, source, OPTIMISED))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_core_portable_group_probe(tmp_path, source):
    out = _run(_build(tmp_path, source, PORTABLE_PROBE))
    if source.name == "table_test.cc":
        assert "group probe: portable" in out
