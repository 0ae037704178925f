"""What an EmbeddingVariable built in a tf.distribute strategy's scope is.

TensorFlow's variables follow the strategy in scope with no extra argument
(mirrored under a MirroredStrategy, placed on parameter servers under a
ParameterServerStrategy); `EmbeddingVariable(...)` and
`evstore.keras.Embedding(...)` follow it too, or refuse to be built:

| strategy in scope | what `EmbeddingVariable(...)` builds |
| --- | --- |
| none, `OneDeviceStrategy` | the table asked for (unsharded, or sharded with `shards=` / `devices=`) |
| `MultiWorkerMirroredStrategy` | a `CollectiveEmbeddingVariable`: split by key over the workers, trained synchronously (evstore/collective.py); `shards=` / `devices=` are refused |
| `ParameterServerStrategy` | the table asked for, where `tf.device` puts it (a parameter server; the coordinator without a device scope); `shards=` spreads it over the parameter servers |
| `CentralStorageStrategy` | the table asked for: one table, like the strategy's one copy of each variable; the replicas' gradients reach it summed |
| `MirroredStrategy` of one device | the table asked for |
| `MirroredStrategy` of several devices | refused: it keeps a copy of every variable per device and updates each copy; an EV is one table per process, with no per-device copies |
| any other (`TPUStrategy`, ...) | refused |

Refusals are `ValueError`s that say which strategy to use instead. The
checks run when the EV is built, never at the first step: an EV is never
built in a scope where it would train silently wrong. Building the subclass
`UnshardedEmbeddingVariable(...)` directly is checked too (`check_table`):
under a MultiWorkerMirroredStrategy of several workers it is refused, except
as the part of a distributed EV (`building_parts()`: a
CollectiveEmbeddingVariable's local shard).
"""
import contextlib
import threading

import tensorflow as tf

__all__ = ["EV_KIND_UNSHARDED", "EV_KIND_SHARDED", "EV_KIND_COLLECTIVE", "ev_kind", "in_multi_worker_scope",
           "building_parts", "check_table"]

_PARTS = threading.local()

EV_KIND_UNSHARDED = "unsharded"
EV_KIND_SHARDED = "sharded"
EV_KIND_COLLECTIVE = "collective"


def _strategy():
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def in_multi_worker_scope():
    """Whether a MultiWorkerMirroredStrategy's scope is active."""
    return isinstance(_strategy(), tf.distribute.MultiWorkerMirroredStrategy)


def ev_kind(sharded, name=None):
    """The kind of EmbeddingVariable to build in the current scope (one of
    EV_KIND_*), for a table asked for with (`sharded`) or without shards.

    Raises:
      ValueError: the scope's strategy cannot train an EV correctly, or
        shards= / devices= were given under a MultiWorkerMirroredStrategy.
    """
    strategy = _strategy()
    asked = EV_KIND_SHARDED if sharded else EV_KIND_UNSHARDED
    what = f"EmbeddingVariable '{name}'" if name else "an EmbeddingVariable"
    if strategy is None or isinstance(strategy, (tf.distribute.OneDeviceStrategy,
                                                 tf.distribute.experimental.ParameterServerStrategy,
                                                 tf.distribute.experimental.CentralStorageStrategy)):
        return asked
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        if sharded:
            raise ValueError(
                f"{what} under a MultiWorkerMirroredStrategy is split by key over the workers (a "
                "CollectiveEmbeddingVariable); shards= / devices= do not apply there: leave them out")
        return EV_KIND_COLLECTIVE
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        if strategy.num_replicas_in_sync == 1:
            return asked
        raise ValueError(
            f"{what} cannot be built under a MirroredStrategy of {strategy.num_replicas_in_sync} devices: "
            "that strategy keeps a copy of every variable per device and updates each copy, and an "
            "EmbeddingVariable is one table per process. Use tf.distribute.experimental.CentralStorageStrategy "
            "(one copy, the replicas' gradients summed), a MultiWorkerMirroredStrategy with one device per "
            "worker (the table is then split over the workers), or a ParameterServerStrategy")
    raise ValueError(
        f"{what} cannot be built under {type(strategy).__name__}: evstore trains EVs under no strategy, "
        "OneDeviceStrategy, CentralStorageStrategy, a MirroredStrategy of one device, "
        "MultiWorkerMirroredStrategy (split over the workers) and ParameterServerStrategy (on the parameter "
        "servers). Build the model under one of those")


@contextlib.contextmanager
def building_parts():
    """While active (this thread), the tables built are parts of a distributed
    EV (a CollectiveEmbeddingVariable's local shard), which `check_table` lets through."""
    outer = getattr(_PARTS, "active", False)
    _PARTS.active = True
    try:
        yield
    finally:
        _PARTS.active = outer


def check_table(name):
    """Checks that one table of its own (an UnshardedEmbeddingVariable) may be
    built in the current scope.

    Raises:
      ValueError: the strategy in scope cannot train it (as `ev_kind`), or a
        MultiWorkerMirroredStrategy of several workers is in scope and the
        table is not a part (`building_parts`): every worker would hold its
        own whole table, trained apart.
    """
    if getattr(_PARTS, "active", False):
        return
    kind = ev_kind(False, name=name)
    strategy = _strategy()
    if kind == EV_KIND_COLLECTIVE and strategy.num_replicas_in_sync > 1:
        raise ValueError(
            f"UnshardedEmbeddingVariable '{name}' under a MultiWorkerMirroredStrategy of "
            f"{strategy.num_replicas_in_sync} workers would be a whole table per worker, trained apart: build "
            "evstore.EmbeddingVariable(...) (split over the workers) instead")
