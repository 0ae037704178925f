"""evstore.keras.Embedding: an EmbeddingVariable as a Keras 3 layer.

A plain `keras.Model` holding this layer, compiled with an evstore optimizer,
trains with `model.fit` (EV rows through the fused native apply, dense layers
through Keras), predicts with `model.predict` (read-only lookups: unseen ids
read the default value and are not inserted), and saves with
`tf.train.Checkpoint`, checkpoint.CheckpointManager (full and delta
checkpoints) or Keras's own `model.save("m.keras")` (the whole table, see
`Embedding`).

How it fits Keras 3, whose optimizers only update `keras.Variable`s: the layer
owns a zero-size trainable `keras.Variable` (its *proxy*) that every training
lookup reads. The tape therefore delivers the lookup's gradient, as
`tf.IndexedSlices(row grads, keys)`, to the proxy; Keras passes it to the
optimizer like any weight gradient, and evstore optimizers route it to the EV.
The proxy holds no values (0 parameters in `model.summary()`).
"""
import keras
import numpy as np
import tensorflow as tf

from evstore import collective as _collective
from evstore import distribute as _distribute
from evstore import evict as _evict
from evstore import keras_compat as _keras_compat
from evstore import keras_saving as _keras_saving
from evstore.evict import GlobalStepEvict, L2WeightEvict
from evstore.filters import BloomFilter, CounterFilter
from evstore.lookup import embedding_lookup
from evstore.variable import EmbeddingVariable, register_proxy

__all__ = ["Embedding"]


@keras.saving.register_keras_serializable(package="evstore")
class Embedding(keras.layers.Layer):
    """Maps integer (or string) ids of any shape to `ids.shape + [dim]` embeddings.

    Args:
      dim: embedding width.
      key_dtype: "int64" (default), "int32" (integer inputs are cast to it), or
        "string": inputs are tf.string ids, used as keys as they are (bytes).
      embeddings_initializer: initializer for new rows (see EmbeddingVariable):
        a Keras initializer or its name, a TensorFlow initializer
        (`tf.random_normal_initializer`, ...) or a callable `(shape, dtype)`.
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
        None (the default): collective exactly when a MultiWorkerMirroredStrategy
        is in scope, as TensorFlow's variables become mirrored there.

    Inputs must be integer tensors (string tensors with key_dtype="string");
    anything else raises TypeError (declare `keras.Input(..., dtype="int64")`).

    Keras conventions (docs/guides/keras.md): `get_config` / `from_config`
    hold every argument (filter, eviction policies and initializer included),
    so `keras.models.clone_model` and `.keras` files need no `custom_objects`
    once evstore is imported; `model.save("m.keras")` stores the table's whole
    state (rows, slots, versions, frequencies, filtered keys and their counts,
    the clock, Bloom counters, the initializer bank) and
    `keras.models.load_model` brings it back. `model.export()` refuses:
    `serving_loader.export_serving_model` is evstore's serving export.

    Raises:
      ValueError: bad arguments; collective=False, shards= or devices= under a
        MultiWorkerMirroredStrategy; a strategy in scope that cannot train the
        table correctly (evstore/distribute.py).
    """

    _evstore_table_layer = True   # what model.export() refuses (evstore/keras_export.py)

    def __init__(self, dim, key_dtype="int64", embeddings_initializer=None, filter=None, default_value=None,
                 initializer_bank_size=8192, evict=None, shards=None, devices=None, collective=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.key_dtype = tf.as_dtype(key_dtype)
        if isinstance(embeddings_initializer, (str, dict)):
            embeddings_initializer = _initializer_from_config(embeddings_initializer)
        self.embeddings_initializer = embeddings_initializer
        self.ev_filter = filter
        self.evict_policies = _evict.normalize(evict)
        self.default_value = default_value
        self.initializer_bank_size = initializer_bank_size
        self.devices = None if devices is None else [str(d) for d in devices]
        multi_worker = _distribute.in_multi_worker_scope()
        if collective is False and multi_worker:
            raise ValueError(f"evstore.keras.Embedding '{self.name}': collective=False under a "
                             "MultiWorkerMirroredStrategy would give every worker its own whole table, trained "
                             "apart: leave collective unset (the table is then split over the workers)")
        self._collective_arg = collective
        self.collective = multi_worker if collective is None else bool(collective)
        if self.collective and (shards is not None or devices is not None):
            raise ValueError("evstore.keras.Embedding: collective=True shards by worker; shards=/devices= do not apply")
        if self.collective:
            _keras_compat.install_multi_worker_fit()
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
        """Every constructor argument: policies and the initializer as Keras
        serializations (registered classes, see `from_config`)."""
        config = super().get_config()
        dv = self.default_value
        if dv is not None:
            dv = np.asarray(dv, np.float32)
            dv = float(dv) if dv.ndim == 0 else dv.ravel().tolist()
        config.update(dim=self.dim, key_dtype=self.key_dtype.name,
                      embeddings_initializer=_initializer_config(self.embeddings_initializer),
                      filter=None if self.ev_filter is None else keras.saving.serialize_keras_object(self.ev_filter),
                      evict=[keras.saving.serialize_keras_object(p) for p in self.evict_policies] or None,
                      default_value=dv, initializer_bank_size=self.initializer_bank_size, shards=self.shards,
                      devices=self.devices, collective=self._collective_arg)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("filter") is not None:
            config["filter"] = keras.saving.deserialize_keras_object(config["filter"])
        if config.get("evict") is not None:
            config["evict"] = [keras.saving.deserialize_keras_object(p) for p in config["evict"]]
        config["embeddings_initializer"] = _initializer_from_config(config.get("embeddings_initializer"))
        return cls(**config)

    # ---- the table's state in Keras's variable store (.keras, save_weights) ----
    def _tables(self):
        if self.collective and self.ev.num_workers > 1:
            raise NotImplementedError(
                f"evstore.keras.Embedding '{self.name}' is split over {self.ev.num_workers} workers: a .keras file "
                "holds one process's weights. Save it with checkpoint.CheckpointManager (every worker writes its "
                "shard, and a chain restores into any number of workers)")
        return self.ev.shards

    def save_own_variables(self, store):
        """Stores every table's whole state (evstore/keras_saving.py); the
        zero-size proxies hold nothing."""
        tables = self._tables()
        store["tables"] = np.asarray(len(tables), np.int64)
        for i, ev in enumerate(tables):
            _keras_saving.save_table(ev, store, f"table{i}_")

    def load_own_variables(self, store):
        """Replaces every table's state by the stored one.

        Raises:
          ValueError: the store holds another number of tables, or a table of
            another width, key dtype or format, or a corrupt one (checked
            before any table changes).
        """
        tables = self._tables()
        where = f"evstore.keras.Embedding '{self.name}'"
        saved = int(np.asarray(store["tables"])) if "tables" in store else 0
        if saved != len(tables):
            raise ValueError(f"{where}: the saved weights hold {saved} table(s), the layer has {len(tables)} "
                             "(another shards= ?)")
        for i, ev in enumerate(tables):
            _keras_saving.load_table(ev, store, f"table{i}_", where)


_TF_INITIALIZERS = "tensorflow.python.ops.init_ops_v2"   # tf.constant_initializer, tf.random_normal_initializer, ...


def _initializer_config(initializer):
    """A JSON-able description of `initializer`: Keras's serialization, or
    {"tf_initializer": class, "config": ...} for TensorFlow's own initializers
    (which Keras serializes but cannot deserialize)."""
    if initializer is None:
        return None
    if type(initializer).__module__ == _TF_INITIALIZERS:
        config = {k: (np.asarray(v).tolist() if isinstance(v, np.ndarray) else v)
                  for k, v in initializer.get_config().items()}
        return {"tf_initializer": type(initializer).__name__, "config": config}
    return keras.saving.serialize_keras_object(initializer)


def _initializer_from_config(config):
    if config is None:
        return None
    if isinstance(config, dict) and "tf_initializer" in config:
        from tensorflow.python.ops import init_ops_v2
        cls = getattr(init_ops_v2, config["tf_initializer"], None)
        if not isinstance(cls, type) or not issubclass(cls, init_ops_v2.Initializer):
            raise ValueError(f"unknown TensorFlow initializer {config['tf_initializer']!r}")
        return cls.from_config(config["config"])
    if isinstance(config, str):
        return keras.initializers.get(config)
    return keras.saving.deserialize_keras_object(config)


# Filters and eviction policies are plain classes (evstore/filters.py,
# evict.py); a layer's config holds them as registered Keras serializables.
for _cls in (CounterFilter, BloomFilter, GlobalStepEvict, L2WeightEvict):
    keras.saving.register_keras_serializable(package="evstore")(_cls)
