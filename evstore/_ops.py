"""Loads the native op library and registers gradients.

The library is built (CMakeLists.txt, by `make install` or `pip install .`)
against the installed TensorFlow; its ABI is tied to TensorFlow's minor
version (2.21).
"""
import glob
import os

import tensorflow as tf

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")


def _load():
    candidates = sorted(glob.glob(os.path.join(_HERE, "_evstore_ops*.so")))
    if not candidates:
        raise ImportError(
            "evstore's native op library is not built (no evstore/native/_evstore_ops*.so). "
            "Run `make install` (or `pip install -e . --no-build-isolation`) to build it against "
            f"TensorFlow {tf.__version__}.")
    try:
        return tf.load_op_library(candidates[0])
    except tf.errors.NotFoundError as e:
        raise ImportError(
            f"evstore's op library {candidates[0]} does not load into TensorFlow {tf.__version__} "
            f"(it was probably built against another TensorFlow; rebuild with `make install`): {e}") from e


gen = _load()


def native_library():
    """The op library as a ctypes.CDLL (the same handle TensorFlow loaded), for the C entry points
    that register a process's object sink and source (checkpoint/object_sink.py, object_source.py)."""
    import ctypes
    return ctypes.CDLL(sorted(glob.glob(os.path.join(_HERE, "_evstore_ops*.so")))[0], mode=ctypes.RTLD_GLOBAL)


@tf.RegisterGradient("EvFindOrInsert")
def _ev_find_or_insert_grad(op, grad):
    """Gradient of a training lookup: (keys, row gradients) as IndexedSlices.

    The gradient flows to the `proxy` input (a zero-size variable read), so
    `tape.gradient(loss, ev)` returns IndexedSlices whose indices are keys.
    Duplicates are summed by the fused apply kernels.
    """
    dim = op.get_attr("dim")
    keys = tf.reshape(op.inputs[1], [-1])
    values = tf.reshape(grad, [-1, dim])
    return [None, None, tf.IndexedSlices(values, keys)]


@tf.RegisterGradient("EvFindOrInsertCounted")
def _ev_find_or_insert_counted_grad(op, grad):
    """Gradient of a sharded EV's shard lookup (distinct keys): (keys, row
    gradients) as IndexedSlices on the proxy input (op input 3)."""
    dim = op.get_attr("dim")
    return [None, None, None, tf.IndexedSlices(tf.reshape(grad, [-1, dim]), op.inputs[1])]


tf.no_gradient("EvFind")
tf.no_gradient("EvShardIndex")
