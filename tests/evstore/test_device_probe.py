"""On a machine without a CUDA driver, TensorFlow's first device probe writes an error line
(`failed call to cuInit`); importing evstore probes the devices with that line dropped."""
import ctypes.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stderr(code):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}   # as a user's shell has it
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(env, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr


def test_importing_evstore_drops_the_cuinit_error_line_on_a_machine_without_a_cuda_driver():
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has a CUDA driver: TensorFlow's probe is shown as it is")
    plain = _stderr("import tensorflow as tf\nprint(tf.constant(1) + 1)")
    assert "failed call to cuInit" in plain        # what a plain TensorFlow prints here
    quiet = _stderr("import tensorflow as tf\nimport evstore\nprint(tf.constant(1) + 1)")
    assert "failed call to cuInit" not in quiet
