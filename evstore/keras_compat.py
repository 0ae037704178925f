"""Every change evstore makes to Keras, in one module, behind one check of Keras's layout.

evstore attaches to Keras 3 at private points, each listed in PATCHES and set
only through `patch` below:

| Keras attribute | evstore's replacement | why | installed |
| --- | --- | --- | --- |
| `BaseOptimizer.add_variable_from_reference`, `._get_variable_index`, `.apply`, `LossScaleOptimizer.apply`, `TFOptimizer._distributed_tf_update_step`, `._backend_increment_gradient_accumulators` | evstore/generic.py's HOOKS | any Keras optimizer trains EmbeddingVariables (the generic row path) | when Keras is imported (evstore/__init__.py, `install`) |
| `Model.export` | refuses models holding evstore tables (evstore/keras_export.py's HOOKS) | Keras's export would write evstore's own ops | when Keras is imported (evstore/__init__.py, `install`) |
| `TensorFlowTrainer._maybe_symbolic_build`, `trainer.reduce_per_replica` | `install_multi_worker_fit` below | `model.fit` under a MultiWorkerMirroredStrategy of several workers | the first collective layer |

At import this module checks that Keras's major version is KERAS_MAJOR and
that every attribute patched, and every private one the replacements call
(CALLED), exists: on a Keras it does not know, evstore's attaching to it
(at `import evstore` where Keras is imported, else when Keras is first
imported: evstore/__init__.py) raises KerasLayoutError (an ImportError) whose
message is one line naming the Keras version and what is missing, instead of
failing later inside a training step.
Every install is idempotent; `original(name)` is Keras's own function of a
patched attribute.
"""
import importlib

import keras
import tensorflow as tf

__all__ = ["KerasLayoutError", "KERAS_MAJOR", "PATCHES", "CALLED", "check", "install", "install_multi_worker_fit",
           "original", "patch"]

KERAS_MAJOR = 3

# "Owner.attribute" -> (module, owner class or None for the module itself)
_OWNERS = {
    "BaseOptimizer": ("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
    "LossScaleOptimizer": ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer"),
    "TFOptimizer": ("keras.src.backend.tensorflow.optimizer", "TFOptimizer"),
    "TensorFlowTrainer": ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
    "trainer": ("keras.src.backend.tensorflow.trainer", None),
    "Model": ("keras", "Model"),
}
# Every attribute of Keras evstore replaces.
PATCHES = ("BaseOptimizer.add_variable_from_reference", "BaseOptimizer._get_variable_index", "BaseOptimizer.apply",
           "LossScaleOptimizer.apply", "TFOptimizer._distributed_tf_update_step",
           "TFOptimizer._backend_increment_gradient_accumulators", "Model.export",
           "TensorFlowTrainer._maybe_symbolic_build", "trainer.reduce_per_replica")
# Private attributes of Keras the replacements call.
CALLED = ("BaseOptimizer._backend_update_step", "BaseOptimizer._get_current_learning_rate",
          "BaseOptimizer._use_weight_decay", "trainer._collective_all_reduce_multi_worker",
          "trainer._is_per_replica_instance", "Model._flatten_layers")

_ORIGINAL = {}   # "Owner.attribute" -> Keras's own value, kept when patched


class KerasLayoutError(ImportError):
    """This Keras is not a layout evstore's patches fit (its major version, or
    an attribute patched or called is missing). The message is one line."""


def _owner(name):
    module, cls = _OWNERS[name.split(".", 1)[0]]
    mod = importlib.import_module(module)
    return mod if cls is None else getattr(mod, cls)


def check(version=None):
    """Raises KerasLayoutError unless this Keras (`version`: its version
    string, default keras.__version__) is of major version KERAS_MAJOR and has
    every attribute of PATCHES and CALLED."""
    version = keras.__version__ if version is None else version
    major = version.split(".", 1)[0]
    if major != str(KERAS_MAJOR):
        raise KerasLayoutError(f"evstore needs Keras {KERAS_MAJOR}, found Keras {version}: install the Keras "
                               "that evstore's pinned TensorFlow brings (make install in the evstore checkout)")
    missing = []
    for name in PATCHES + CALLED:
        try:
            if not hasattr(_owner(name), name.split(".", 1)[1]):
                missing.append(name)
        except (ImportError, AttributeError):
            missing.append(name)
    if missing:
        raise KerasLayoutError(f"evstore cannot attach to Keras {version}: it has no {', '.join(missing)} "
                               f"(evstore patches or calls these private Keras attributes; see evstore/keras_compat.py)")


def patch(name, make):
    """Sets Keras's `name` (one of PATCHES) to `make(Keras's own)`, once: a
    second call changes nothing. Returns Keras's own."""
    if name not in PATCHES:
        raise ValueError(f"{name} is not one of evstore's Keras patches (keras_compat.PATCHES)")
    if name in _ORIGINAL:
        return _ORIGINAL[name]
    owner, attr = _owner(name), name.split(".", 1)[1]
    own = getattr(owner, attr)
    _ORIGINAL[name] = own
    setattr(owner, attr, make(own))
    return own


def original(name):
    """Keras's own value of patched attribute `name`."""
    return _ORIGINAL[name]


def install(*hooks):
    """Applies each table of `hooks` ({"Owner.attribute" of PATCHES: make},
    see `patch`): generic.py installs its HOOKS (the generic optimizer path)
    and keras_export.py its own (the export refusal) when they are imported,
    which evstore/__init__.py makes happen as soon as Keras is imported."""
    for table in hooks:
        for name, make in table.items():
            patch(name, make)


def install_multi_worker_fit():
    """`model.fit` under a MultiWorkerMirroredStrategy of several workers
    (installed by the first collective layer; other strategies run Keras's own code).

    Keras's fit reduces its first (x, y) batch with `strategy.reduce`, which
    takes no nested structure (ValueError: "Attempt to convert a value
    (PerReplica...)"). The batch only gives the symbolic build its shapes: this
    worker's local slice serves as well and issues no collective. Its step then
    averages the logs over the workers with `strategy.reduce("MEAN", v,
    axis=0)`, which fails on a scalar (the loss): scalars are averaged over the
    workers alone (axis=None)."""
    trainer = _owner("trainer")

    def local_batch_build(own):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = getattr(self, "_distribute_strategy", None)
            if iterator is not None and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
                for _, _, it in iterator:
                    batch = next(it)
                    data_batch = tf.nest.map_structure(
                        lambda x: strategy.experimental_local_results(x)[0]
                        if isinstance(x, tf.distribute.DistributedValues) else x, batch)
                    break
                iterator = None
            return own(self, iterator=iterator, data_batch=data_batch)
        return _maybe_symbolic_build

    def scalars_too(own):
        def reduce_per_replica(values, strategy, reduction):
            if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):
                def reduce(v):
                    rank = strategy.experimental_local_results(v)[0].shape.rank \
                        if trainer._is_per_replica_instance(v) else tf.convert_to_tensor(v).shape.rank
                    return strategy.reduce("MEAN", v, axis=0 if rank else None)
                return tf.nest.map_structure(reduce, values)
            return own(values, strategy, reduction)
        return reduce_per_replica

    patch("TensorFlowTrainer._maybe_symbolic_build", local_batch_build)
    patch("trainer.reduce_per_replica", scalars_too)


check()
