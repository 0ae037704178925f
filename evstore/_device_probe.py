"""TensorFlow's first device probe on a machine without a CUDA driver, without its error line.

A pip TensorFlow built with CUDA writes `E0000 ... failed call to cuInit: ...` to stderr the first
time it lists devices on a machine that has no CUDA driver: an error line for the expected case of a
CPU-only machine. Importing evstore lists the devices once with the process's stderr (fd 2)
captured and writes back everything captured except that line. Listing devices does not start
TensorFlow's runtime (thread pools and visible devices can still be set afterwards). With a CUDA
driver present (libcuda found) nothing is captured: a GPU machine's probe shows what TensorFlow says.
"""
import ctypes.util
import os
import sys
import tempfile

import tensorflow as tf

__all__ = ["probe_quietly"]

NOISE = b"failed call to cuInit"


def probe_quietly():
    """Lists TensorFlow's devices, dropping the cuInit failure line when no CUDA driver is installed."""
    if ctypes.util.find_library("cuda") is not None:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):     # no stderr to capture: nothing to hide
        tf.config.list_physical_devices()
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            tf.config.list_physical_devices()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        kept = [line for line in captured.read().splitlines(keepends=True) if NOISE not in line]
    if kept:
        os.write(2, b"".join(kept))
