"""evstore.keras.Embedding: an EmbeddingVariable as a Keras 3 layer.

A plain `keras.Model` holding this layer, compiled with an evstore optimizer,
trains with `model.fit` (EV rows through the fused native apply, dense layers
through Keras), predicts with `model.predict` (read-only lookups: unseen ids
read the default value and are not inserted), and saves with
`tf.train.Checkpoint`.

How it fits Keras 3, whose optimizers only update `keras.Variable`s: the layer
owns a zero-size trainable `keras.Variable` (its *proxy*) that every training
lookup reads. The tape therefore delivers the lookup's gradient, as
`tf.IndexedSlices(row grads, keys)`, to the proxy; Keras passes it to the
optimizer like any weight gradient, and evstore optimizers route it to the EV.
The proxy holds no values (0 parameters in `model.summary()`).
"""
import keras
import tensorflow as tf

from evstore import collective as _collective
from evstore.lookup import embedding_lookup
from evstore.variable import EmbeddingVariable, register_proxy

__all__ = ["Embedding"]


def _fit_under_multi_worker():
    """Keras 3.15's `model.fit` under a MultiWorkerMirroredStrategy of several
    workers reduces its first (x, y) batch with `strategy.reduce`, which takes
    no nested structure (ValueError: "Attempt to convert a value (PerReplica...)").
    The batch only gives the symbolic build its shapes: this worker's local
    slice serves as well and issues no collective. Installed once, by the
    first collective layer; it changes nothing for other strategies."""
    from keras.src.backend.tensorflow import trainer as _trainer
    cls = _trainer.TensorFlowTrainer
    original = cls._maybe_symbolic_build
    if getattr(original, "_evstore_local_batch", False):
        return

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
        return original(self, iterator=iterator, data_batch=data_batch)

    _maybe_symbolic_build._evstore_local_batch = True
    cls._maybe_symbolic_build = _maybe_symbolic_build

    # Its step then averages the logs over the workers with
    # `strategy.reduce("MEAN", v, axis=0)`, which fails on a scalar (the
    # loss): scalars are averaged over the workers alone (axis=None).
    reduce_per_replica = _trainer.reduce_per_replica

    def reduce_scalars_too(values, strategy, reduction):
        if reduction in ("auto", "mean") and _trainer._collective_all_reduce_multi_worker(strategy):
            def reduce(v):
                rank = strategy.experimental_local_results(v)[0].shape.rank if _trainer._is_per_replica_instance(v) \
                    else tf.convert_to_tensor(v).shape.rank
                return strategy.reduce("MEAN", v, axis=0 if rank else None)
            return tf.nest.map_structure(reduce, values)
        return reduce_per_replica(values, strategy, reduction)

    _trainer.reduce_per_replica = reduce_scalars_too


class Embedding(keras.layers.Layer):
    """Maps integer (or string) ids of any shape to `ids.shape + [dim]` embeddings.

    Args:
      dim: embedding width.
      key_dtype: "int64" (default), "int32" (integer inputs are cast to it), or
        "string": inputs are tf.string ids, used as keys as they are (bytes).
      embeddings_initializer: initializer for new rows (see EmbeddingVariable).
      filter: admission filter, `evstore.CounterFilter(3)` or `evstore.BloomFilter(...)`.
      evict: eviction policy or list (`evstore.GlobalStepEvict`, `evstore.L2WeightEvict`);
        `layer.ev.evict(step)` runs it (checkpoint saves do too).
      default_value: what ids without a row read (zeros by default).
      initializer_bank_size: rows of the initializer bank.
      shards, devices: a ShardedEmbeddingVariable of `shards` tables on
        `devices` (parameter servers under a ParameterServerStrategy scope);
        the layer then owns one proxy per shard.
      collective: a CollectiveEmbeddingVariable (evstore/collective.py): the
        table split by key over the workers of the MultiWorkerMirroredStrategy
        in scope, looked up by all-to-all; `model.fit` trains it synchronously
        (the layer's proxy is this worker's own, registered to its shard, and
        its gradient is applied there, not all-reduced). Not with `shards`.
    Inputs must be integer tensors (string tensors with key_dtype="string");
    anything else raises TypeError (declare `keras.Input(..., dtype="int64")`).
    """

    def __init__(self, dim, key_dtype="int64", embeddings_initializer=None, filter=None, default_value=None,
                 initializer_bank_size=8192, evict=None, shards=None, devices=None, collective=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.key_dtype = tf.as_dtype(key_dtype)
        self.embeddings_initializer = embeddings_initializer
        self.ev_filter = filter
        self.default_value = default_value
        self.initializer_bank_size = initializer_bank_size
        self.collective = bool(collective)
        if self.collective and (shards is not None or devices is not None):
            raise ValueError("evstore.keras.Embedding: collective=True shards by worker; shards=/devices= do not apply")
        if self.collective:
            _fit_under_multi_worker()
        make = _collective.CollectiveEmbeddingVariable if self.collective else EmbeddingVariable
        self.ev = make(self.name, dim, key_dtype=self.key_dtype, initializer=embeddings_initializer,
                                    default_value=default_value, filter=filter,
                                    initializer_bank_size=initializer_bank_size, evict=evict,
                       **({} if self.collective else dict(shards=shards, devices=devices)))
        self.shards = shards

    def build(self, input_shape=None):
        if self.collective:
            # This worker's own (a mirrored zero-size variable would be broadcast
            # at creation: a zero-element collective, which the runtime does not survive).
            with tf.variable_creator_scope(_collective._local_creator):
                self.proxy = self.add_weight(name="ev_proxy", shape=(0,), initializer="zeros", trainable=True,
                                             autocast=False)
            register_proxy(self.proxy, self.ev.local)
        elif self.ev.sharded:
            self.proxies = []
            for i, ev in enumerate(self.ev.shards):
                p = self.add_weight(name=f"ev_proxy_{i}", shape=(0,), initializer="zeros", trainable=True,
                                    autocast=False)
                register_proxy(p, ev)
                self.proxies.append(p)
        else:
            self.proxy = self.add_weight(name="ev_proxy", shape=(0,), initializer="zeros", trainable=True,
                                         autocast=False)   # the lookup reads it as float32 under mixed precision
            register_proxy(self.proxy, self.ev)
        self.built = True

    def call(self, inputs, training=None):
        ids = tf.convert_to_tensor(inputs)
        if self.key_dtype == tf.string:
            if ids.dtype != tf.string:
                raise TypeError(f"evstore.keras.Embedding '{self.name}' has string keys, got {ids.dtype.name} ids "
                                "(declare keras.Input(..., dtype='string'))")
        elif not ids.dtype.is_integer:
            raise TypeError(f"evstore.keras.Embedding '{self.name}' needs integer ids, got {ids.dtype.name} "
                            "(declare keras.Input(..., dtype='int64'), or key_dtype='string' for string ids)")
        if ids.dtype != self.key_dtype:
            ids = tf.cast(ids, self.key_dtype)
        if not self.collective and self.ev.sharded:
            proxy = [p.value for p in self.proxies]
        else:
            proxy = self.proxy.value
        out = embedding_lookup(self.ev, ids, training=bool(training), proxy=proxy)
        if self.compute_dtype != "float32":   # a mixed-precision policy: rows in the compute dtype, as keras.layers.Embedding
            out = tf.cast(out, self.compute_dtype)
        return out

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.dim,)

    def get_config(self):
        config = super().get_config()
        config.update(dim=self.dim, key_dtype=self.key_dtype.name,
                      initializer_bank_size=self.initializer_bank_size, shards=self.shards,
                      collective=self.collective)
        return config
