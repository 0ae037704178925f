"""`import tensorflow` without Keras, for a process that never uses Keras.

TensorFlow's import loads `keras.src.optimizers` eagerly (so that Keras's
SavedModel registrations happen at load time) and ignores an ImportError
there; Keras is about a third of that import's CPU. A process that never
builds, loads or saves a Keras object (a parameter server's task server, a
serving replica) imports TensorFlow with that import refused; `import evstore`
does not import Keras either (evstore/lazy_keras.py), and Keras imports as
usual if anything asks for it later (`import keras`, `tf.keras`), evstore's
patches attaching to it then.

This module imports nothing of TensorFlow or evstore itself: it must run
before them.
"""
import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["import_tensorflow_without_keras"]


class _Refuse(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `keras` where it is, with a loader that refuses to run it."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("Keras is not imported while TensorFlow's import runs (evstore_app/tf_without_keras.py)")


def import_tensorflow_without_keras():
    """Imports TensorFlow without the Keras import its own import makes.

    TensorFlow's import loads `keras.src.optimizers` eagerly (so that Keras's
    SavedModel registrations happen at load time) and ignores an ImportError
    there; Keras is about a third of that import's CPU. A process that never
    builds, loads or saves a Keras object (a parameter server's task server,
    a serving replica) imports TensorFlow with that import refused; Keras
    imports as usual afterwards (`import keras`, `tf.keras`). Returns the
    tensorflow module; the same as `import tensorflow` where TensorFlow or
    Keras is already imported."""
    if "tensorflow" not in sys.modules and "keras" not in sys.modules:
        refuse = _Refuse()
        sys.meta_path.insert(0, refuse)
        try:
            import tensorflow  # noqa: F401
        finally:
            sys.meta_path.remove(refuse)
    return importlib.import_module("tensorflow")
