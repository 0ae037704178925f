"""The module graph: evstore_app -> serving_loader -> checkpoint -> evstore,
and no import cycle inside evstore or inside checkpoint.

The contracts live in pyproject.toml ([tool.importlinter], docs/ARCHITECTURE.md,
"Layout"); import-linter checks them from the source, lazy imports inside
functions included.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint(contract):
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([lint, "--no-cache", "--contract", contract], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout, r.stdout


def test_no_package_imports_a_layer_above_it():
    _lint("layers")


def test_no_module_inside_evstore_imports_one_that_imports_it_back():
    _lint("evstore-acyclic")


def test_no_module_inside_checkpoint_imports_one_that_imports_it_back():
    _lint("checkpoint-acyclic")
