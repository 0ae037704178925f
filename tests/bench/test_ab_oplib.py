"""bench/tiered/ab_oplib.py compares builds of the op library without touching the worktree: each build's
children import evstore from a private copy of the package holding that build's library, ahead of the
repository's own (the children run from the repository root)."""
import os
import subprocess
import sys

from bench.harness.paths import ROOT
from bench.tiered.ab_oplib import overlay
from bench.tiered.bench_tiered_ev import OVERLAY_BOOT


def test_a_build_overlay_holds_the_package_with_that_build_as_its_op_library(tmp_path):
    lib = tmp_path / "other.so"
    lib.write_bytes(b"another build")
    tree = overlay(str(lib), str(tmp_path / "other"))
    native = os.path.join(tree, "evstore", "native")
    libs = [n for n in os.listdir(native) if n.startswith("_evstore_ops") and n.endswith(".so")]
    assert len(libs) == 1 and open(os.path.join(native, libs[0]), "rb").read() == b"another build"
    assert os.path.exists(os.path.join(tree, "evstore", "__init__.py"))


def test_a_child_started_through_the_overlay_imports_evstore_from_the_overlay_not_the_repository(tmp_path):
    lib = tmp_path / "other.so"
    lib.write_bytes(b"another build")
    tree = overlay(str(lib), str(tmp_path / "other"))
    with open(os.path.join(tree, "where_is_evstore.py"), "w") as f:
        f.write("import importlib.util\nprint(importlib.util.find_spec('evstore').origin)\n")
    out = subprocess.run([sys.executable, "-c", OVERLAY_BOOT, tree, "where_is_evstore"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == os.path.join(tree, "evstore", "__init__.py")
