"""evstore: incremental-checkpoint online learning for TensorFlow.

Public API (docs/ARCHITECTURE.md, "Ops and Python API"):
  EmbeddingVariable (builds an UnshardedEmbeddingVariable, or a ShardedEmbeddingVariable with shards=N),
  CollectiveEmbeddingVariable (synchronous, sharded over MultiWorkerMirroredStrategy workers),
  shard_index, CounterFilter, BloomFilter, GlobalStepEvict, L2WeightEvict,
  embedding_lookup, embedding_lookup_group, embedding_lookup_sparse, safe_embedding_lookup_sparse,
  optimizers.{SGD, Adagrad, Adam, AdamW, Ftrl, GroupAdam, GroupAdagrad} (fused; every other Keras
  optimizer trains EVs through generic, see generic.sparse_apply_keras for v1 graphs), keras.Embedding,
  summary.ev_stats, substitute_lookups (the lookup hook serving exports use), ops (the kernels).

`import evstore` does not import Keras (evstore/lazy_keras.py): `evstore.optimizers`,
`evstore.keras` and `evstore.generic` import it when first used, and whenever Keras is
imported, by anyone, evstore attaches to it as that import completes (`_attach_to_keras`).
"""
import importlib

from evstore import _device_probe
from evstore import lazy_keras
from evstore import training  # noqa: F401
from evstore import ops  # noqa: F401
from evstore import summary  # noqa: F401
from evstore.collective import CollectiveEmbeddingVariable
from evstore.evict import GlobalStepEvict, L2WeightEvict
from evstore.filters import BloomFilter, CounterFilter
from evstore.group import embedding_lookup_group
from evstore.lookup import embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from evstore.sharded import ShardedEmbeddingVariable, shard_index
from evstore.storage import TieredStorage, TierSpaceError
from evstore.substitution import substitute_lookups
from evstore.schema import MAX_STRING_KEY_BYTES
from evstore.variable import EmbeddingVariable, UnshardedEmbeddingVariable

# evstore's modules loaded with Keras (evstore.keras's keras_saving included), in the order they attach
# to it: keras_compat's layout check first.
_KERAS_MODULES = ("keras_compat", "generic", "keras_export", "keras_saving", "optimizers", "keras")


def _attach_to_keras():
    """Imports evstore's Keras modules, which attach to Keras as they are imported: keras_compat
    first refuses a Keras layout its patches do not fit, in one line (KerasLayoutError); generic.py
    installs the generic optimizer path (any Keras optimizer trains EVs) and keras_export.py the
    refusal of model.export() for models holding evstore tables; optimizers.py and keras.py register
    evstore's optimizers and layer for `.keras` files. One of them may be the module whose own
    `import keras` got here: it is returned half-run and attaches when it finishes."""
    for name in _KERAS_MODULES:
        importlib.import_module(f"evstore.{name}")


lazy_keras.when_imported(_attach_to_keras)


def __getattr__(name):
    """evstore.optimizers, evstore.keras, ...: imported, with Keras, when first used."""
    if name in _KERAS_MODULES:
        return importlib.import_module(f"evstore.{name}")
    raise AttributeError(f"module 'evstore' has no attribute {name!r}")


_device_probe.probe_quietly()   # no "failed call to cuInit" error line on a machine without a CUDA driver

__version__ = "0.1.0"

__all__ = ["EmbeddingVariable", "ShardedEmbeddingVariable", "UnshardedEmbeddingVariable", "CollectiveEmbeddingVariable",
           "shard_index", "CounterFilter", "BloomFilter", "TieredStorage", "TierSpaceError", "GlobalStepEvict", "L2WeightEvict",
           "embedding_lookup", "embedding_lookup_group", "embedding_lookup_sparse", "safe_embedding_lookup_sparse", "optimizers", "keras",
           "summary", "ops", "substitute_lookups", "MAX_STRING_KEY_BYTES"]
