"""The layering contract: evstore_app -> serving_loader -> checkpoint -> evstore.

Each package imports only those below it (docs/ARCHITECTURE.md, "Layout"); the
contract lives in pyproject.toml ([tool.importlinter]) and import-linter
checks it from the source, lazy imports inside functions included.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_package_imports_a_layer_above_it():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout, r.stdout
