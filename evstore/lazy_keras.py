"""Keras, only where a process imports it.

`import evstore` (and `import checkpoint`, `import serving_loader`) does not
import Keras, so that a process that never builds a Keras object (a parameter
server's task server, a serving replica, `evstore ckpt`) does not pay for it.
Two things make that safe:

- no object is a Keras object before Keras is imported, so a type check asks
  `isinstance_of`, which is False for everything while Keras is not loaded;
- `when_imported(fn)` runs `fn` as soon as Keras is imported, by anyone and
  however (`import keras`, TensorFlow's own import or `tf.keras`, one of
  evstore's Keras modules): evstore/__init__.py attaches its Keras patches
  there, so they are in place before any Keras object can exist.
"""
import importlib.abc
import importlib.util
import sys

__all__ = ["loaded", "isinstance_of", "when_imported"]


def loaded():
    """The `keras` module if this process has imported it, else None."""
    return sys.modules.get("keras")


def isinstance_of(obj, *names):
    """True when `obj` is an instance of one of the Keras classes `names`
    ("Variable", "Model", "layers.Layer", "optimizers.Optimizer", ...); False
    for every object while Keras is not imported."""
    keras = loaded()
    if keras is None:
        return False
    classes = []
    for name in names:
        cls = keras
        for part in name.split("."):
            cls = getattr(cls, part)
        classes.append(cls)
    return isinstance(obj, tuple(classes))


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """On sys.meta_path until Keras is imported: finds `keras` with the other
    finders and runs the callbacks once Keras's own module has run (an error
    of one propagates: the import of Keras fails with it, and the next
    import of Keras runs them again)."""

    def __init__(self):
        self.callbacks = []
        self._loader = None

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or self._loader is not None:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self._loader
        try:
            self._loader.exec_module(module)
            for fn in self.callbacks:
                fn()
        except BaseException:
            self._loader = None              # Keras is not imported: the next import tries again
            sys.meta_path.insert(0, self)
            raise


_hook = _AfterImport()


def when_imported(fn):
    """Runs `fn()` now if Keras is imported, else right after Keras's import
    completes (before the importer gets the module)."""
    if loaded() is not None:
        fn()
        return
    _hook.callbacks.append(fn)
    if _hook not in sys.meta_path and _hook._loader is None:
        sys.meta_path.insert(0, _hook)

