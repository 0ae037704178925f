"""evstore/keras_compat.py owns every change evstore makes to Keras: it refuses, at `import evstore`
and in one line, a Keras whose layout its patches do not fit, and patches nothing it does not list."""
import os
import subprocess
import sys

import keras
import pytest

import evstore  # noqa: F401  (installs the patches)
from evstore import generic, keras_compat, keras_export

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_on_a_keras_without_a_patched_method_fails_with_one_line():
    code = ("from keras.src.optimizers import base_optimizer\n"
            "del base_optimizer.BaseOptimizer._get_variable_index\n"
            "import evstore\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 1
    assert p.stderr.rstrip().splitlines()[-1] == (
        f"evstore.keras_compat.KerasLayoutError: evstore cannot attach to Keras {keras.__version__}: it has no "
        "BaseOptimizer._get_variable_index (evstore patches or calls these private Keras attributes; see "
        "evstore/keras_compat.py)")


def test_another_keras_major_version_is_refused_in_one_line():
    with pytest.raises(keras_compat.KerasLayoutError) as e:
        keras_compat.check(version="4.0.1")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("evstore needs Keras 3, found Keras 4.0.1")


def test_this_keras_passes_the_check():
    keras_compat.check()


def test_what_import_installs_is_the_modules_hooks_and_each_is_listed():
    installed = set(generic.HOOKS) | set(keras_export.HOOKS)
    assert installed <= set(keras_compat.PATCHES)
    for name in installed:
        owner, attr = keras_compat._owner(name), name.split(".", 1)[1]
        assert getattr(owner, attr) is not keras_compat.original(name), name


def test_a_patch_not_listed_is_refused():
    with pytest.raises(ValueError, match="not one of evstore's Keras patches"):
        keras_compat.patch("Model.fit", lambda own: own)
