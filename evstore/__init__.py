"""evstore: incremental-checkpoint online learning for TensorFlow.

Public API (docs/ARCHITECTURE.md, "Ops and Python API"):
  EmbeddingVariable (builds an UnshardedEmbeddingVariable, or a ShardedEmbeddingVariable with shards=N),
  CollectiveEmbeddingVariable (synchronous, sharded over MultiWorkerMirroredStrategy workers),
  shard_index, CounterFilter, BloomFilter, GlobalStepEvict, L2WeightEvict,
  embedding_lookup, embedding_lookup_group, embedding_lookup_sparse, safe_embedding_lookup_sparse,
  optimizers.{SGD, Adagrad, Adam, AdamW, Ftrl, GroupAdam, GroupAdagrad} (fused; every other Keras
  optimizer trains EVs through generic, see generic.sparse_apply_keras for v1 graphs), keras.Embedding,
  summary.ev_stats, substitute_lookups (the lookup hook serving exports use), ops (the kernels).
"""
from evstore import keras_compat  # first: refuses a Keras layout evstore's patches do not fit, in one line
from evstore import _device_probe
from evstore import generic  # any Keras optimizer trains EVs (keras_compat.install below)
from evstore import optimizers  # noqa: F401
from evstore import training  # noqa: F401
from evstore import keras  # noqa: F401
from evstore import keras_export
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

# Every change evstore makes to Keras, through evstore/keras_compat.py: the generic optimizer path
# and the refusal of model.export() for models holding evstore tables.
keras_compat.install(generic.HOOKS, keras_export.HOOKS)
_device_probe.probe_quietly()   # no "failed call to cuInit" error line on a machine without a CUDA driver

__version__ = "0.1.0"

__all__ = ["EmbeddingVariable", "ShardedEmbeddingVariable", "UnshardedEmbeddingVariable", "CollectiveEmbeddingVariable",
           "shard_index", "CounterFilter", "BloomFilter", "TieredStorage", "TierSpaceError", "GlobalStepEvict", "L2WeightEvict",
           "embedding_lookup", "embedding_lookup_group", "embedding_lookup_sparse", "safe_embedding_lookup_sparse", "optimizers", "keras",
           "summary", "ops", "substitute_lookups", "MAX_STRING_KEY_BYTES"]
