"""EmbeddingVariable: a native hash-table embedding as a TensorFlow resource."""
import contextlib
import copy
import functools
import weakref

import numpy as np

import tensorflow as tf
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.saved_model import save_context
from tensorflow.python.trackable import base as _trackable_base
from tensorflow.python.training.saving import saveable_object

from evstore import distribute as _distribute
from evstore import evict as _evict
from evstore import schema
from evstore._ops import gen
from evstore.filters import AdmissionFilter
from evstore import storage as _storage
from evstore.storage import TieredStorage

__all__ = ["EmbeddingVariable", "UnshardedEmbeddingVariable"]

_STAT_FIELDS = schema.STATS_FIELDS
# The key dtypes an EmbeddingVariable takes (the ops' key_dtype attr lists the same).
KEY_DTYPES = (tf.int32, tf.int64, tf.string)

# Proxies: a proxy is the zero-size trainable variable through which gradients
# of training lookups reach an optimizer (see embedding_lookup); optimizers
# resolve it back to its EV here. Keys: the tf.Variable's `_unique_id`, and
# id() of a keras.Variable proxy, whose tf.Variable may not exist yet while
# Keras builds a model symbolically (resolved when the optimizer first sees it).
_PROXIES = {}
_KERAS_PROXIES = {}


def register_proxy(variable, ev):
    """Routes gradients of `variable` (a zero-size tf or keras Variable) to `ev`."""
    if isinstance(variable, tf.Variable):
        _PROXIES[variable._unique_id] = weakref.ref(ev)
    else:
        _KERAS_PROXIES[id(variable)] = (weakref.ref(variable), weakref.ref(ev))


def ev_for_variable(variable):
    """The EmbeddingVariable behind a proxy variable (tf or keras), or an EV
    itself; None for any other variable. A keras.Variable proxy registers its
    tf.Variable on first resolution (by then Keras has created it)."""
    if isinstance(variable, EmbeddingVariable):
        return variable
    entry = _KERAS_PROXIES.get(id(variable))
    if entry is not None and entry[0]() is variable:
        ev = entry[1]()
        if ev is not None:
            _PROXIES[variable.value._unique_id] = weakref.ref(ev)
        return ev
    uid = getattr(variable, "_unique_id", None)
    ref = _PROXIES.get(uid) if uid is not None else None
    return ref() if ref is not None else None


class _Colocation:
    """What a variable creator's `colocate_with` needs: a device and a name."""

    def __init__(self, device, name):
        self.device, self.name = device, name


@contextlib.contextmanager
def _colocated_with(handle):
    """Creates variables (the proxy) on the device of the table's `handle`.

    A tf.device scope is enough without a strategy; a ParameterServerStrategy
    places variables round-robin over its parameter servers unless the
    creator asks for colocation, so the proxy (read by every training lookup)
    would sit on another task and cost a round trip per step."""
    device = handle.device
    if not device:
        yield
        return

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = _Colocation(device, "ev_table")
        return next_creator(**kwargs)

    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        with tf.variable_creator_scope(creator):
            yield
    else:
        with tf.device(device):
            yield


def _check_dim(dim):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be a positive int, got {dim!r} ({type(dim).__name__})")
    if dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim}")


class EmbeddingVariable:
    """An embedding table keyed by sparse ids, with no vocabulary size.

    Each admitted key owns one row of `dim` float32 values (plus optimizer
    slots), a version (global step of its last optimizer update, -1 if never
    updated) and a lookup frequency. New rows are initialised from an
    initializer bank: `initializer_bank_size` rows drawn once from
    `initializer`; key k starts from bank row `hash(k) % initializer_bank_size`
    (deterministic for a given bank).

    Args:
      name: a name for the table (used in checkpoints).
      dim: embedding width, a positive int.
      key_dtype: tf.int64 (default), tf.int32 or tf.string. String keys are
        bytes: any byte string (empty and non-UTF-8 included) of at most
        `evstore.MAX_STRING_KEY_BYTES` (65535) bytes; a longer key fails the
        op with InvalidArgumentError and changes nothing. They hash with
        FarmHash Fingerprint64 (= `tf.fingerprint`), see docs/guides/string-keys.md.
      initializer: a TF/Keras initializer called as `initializer(shape, dtype)`;
        default `tf.random_normal_initializer(0, 0.01)`.
      default_value: what a key without a row reads (a scalar or `dim` floats);
        zeros by default.
      filter: an admission filter, `evstore.CounterFilter(min_freq)` or
        `evstore.BloomFilter(min_freq, capacity, fp_rate)`; None admits every
        key on first sight (evstore/filters.py).
      evict: an eviction policy, `evstore.GlobalStepEvict(steps_to_live)` or
        `evstore.L2WeightEvict(threshold)`, a list of them (a key goes when any
        selects it), or None. Runs on `ev.evict(global_step)` and before
        checkpoint saves (evstore/evict.py).
      initializer_bank_size: rows in the initializer bank.
      num_segments: index segments (a power of two, each with its own lock).
      trainable: whether optimizers update it.
      storage: where rows live: None (default) keeps every row in DRAM;
        `evstore.TieredStorage(dram_bytes=..., path=...)` keeps a DRAM cache
        of rows over a private directory on local disk, for tables larger
        than memory (evstore/storage.py, docs/guides/tiered-storage.md).
      shards, devices: split the table by key over `shards` tables on
        `devices`; the constructor then builds the subclass
        `evstore.ShardedEmbeddingVariable` (evstore/sharded.py). Under a
        ParameterServerStrategy scope, `devices=None` spreads the shards over
        the parameter servers. Without them it builds the subclass
        `UnshardedEmbeddingVariable`: one table in one resource.

    In a tf.distribute strategy's scope the constructor builds what that
    strategy calls for, as tf.Variable does (evstore/distribute.py): under a
    MultiWorkerMirroredStrategy a `CollectiveEmbeddingVariable` split over the
    workers; under a strategy that cannot train an EV correctly (a
    MirroredStrategy of several devices, TPUStrategy) it raises ValueError
    saying which strategy to use.

    Both kinds are EmbeddingVariables with one surface: every lookup,
    optimizer, checkpoint and serving export takes either. `ev.shards` are
    the tables that hold the rows (`(ev,)` for an unsharded EV), `ev.sharded`
    tells whether the EV is split into parts (its checkpoint then names
    each part `<name>/part_<i>`).

    Raises:
      TypeError / ValueError: bad `dim`, `key_dtype`, `default_value`,
        `filter`, `evict` or `storage`.
      ValueError: the strategy in scope cannot train an EV correctly.
    """

    _sharded_class = None   # ShardedEmbeddingVariable, registered by its class statement (evstore/sharded.py)
    _collective_class = None   # CollectiveEmbeddingVariable, likewise (evstore/collective.py)

    def __new__(cls, *args, shards=None, devices=None, **kwargs):
        # Like tf.Variable: constructing the base builds one of its subclasses,
        # the one the strategy in scope calls for (evstore/distribute.py).
        if cls is EmbeddingVariable:
            name = args[0] if args else kwargs.get("name")
            kind = _distribute.ev_kind(shards is not None or devices is not None, name=name)
            cls = {_distribute.EV_KIND_UNSHARDED: UnshardedEmbeddingVariable,
                   _distribute.EV_KIND_SHARDED: EmbeddingVariable._sharded_class,
                   _distribute.EV_KIND_COLLECTIVE: EmbeddingVariable._collective_class}[kind]
            if cls is None:
                raise ImportError(f"evstore's {kind} EmbeddingVariable is not imported (import evstore first)")
        return super().__new__(cls)

    def __init_subclass__(cls, sharded_implementation=False, collective_implementation=False, **kwargs):
        super().__init_subclass__(**kwargs)
        if sharded_implementation:
            EmbeddingVariable._sharded_class = cls
        if collective_implementation:
            EmbeddingVariable._collective_class = cls

    # ---- the surface both kinds share ----------------------------------------
    @property
    def sharded(self):
        """Whether the EV is split by key into parts (`shards` > its own table)."""
        raise NotImplementedError

    @property
    def shards(self):
        """The unsharded EVs that hold the rows: shard i holds the keys k with
        `shard_index(k, num_shards) == i`; `(self,)` for an unsharded EV."""
        raise NotImplementedError

    @property
    def num_shards(self):
        return len(self.shards)

    def _lookup(self, ids, training, proxy=None):
        """`embedding_lookup`'s rows of `ids` (already of the key dtype, no
        lookup substitute) for this kind of EV; `proxy` as embedding_lookup's."""
        raise NotImplementedError

    def _group_lookup(self):
        """The function that looks up a group of EVs of this kind together,
        `fn(evs, ids, training=, proxies=, name=)`, or None for the per-device
        exchange of evstore/group.py. A group holds EVs of one kind only."""
        return None

    @property
    def trainable_variables(self):
        """What `tape.gradient` and `apply_gradients` take for this EV: its shards
        (`[ev]` when unsharded), or `[]` when it is not trainable."""
        return list(self.shards) if self.trainable else []

    @property
    def dtype(self):
        return tf.float32


class UnshardedEmbeddingVariable(EmbeddingVariable, tf.saved_model.experimental.TrackableResource):
    """One EmbeddingVariable table in one TensorFlow resource (what
    `EmbeddingVariable(...)` builds without `shards` / `devices`; the shards of
    a ShardedEmbeddingVariable are these). See EmbeddingVariable for the arguments.
    """

    # Lets tf.GradientTape and optimizers treat the EV like a variable: its
    # `handle` is the proxy variable that training lookups read. While a
    # SavedModel is written it is a resource, not a variable (hasattr is
    # False), so the writer records it as one and traces its save / restore
    # functions (_serialize_to_tensors) into the SavedModel.
    @property
    def _should_act_as_resource_variable(self):
        if save_context.in_save_context():
            raise AttributeError("_should_act_as_resource_variable")
        return True

    def __init__(self, name, dim, key_dtype=tf.int64, initializer=None, default_value=None,
                 filter=None, initializer_bank_size=8192, num_segments=64, trainable=True, evict=None,
                 shards=None, devices=None, storage=None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        _distribute.check_table(name)
        _check_dim(dim)
        key_dtype = tf.as_dtype(key_dtype)
        if key_dtype not in KEY_DTYPES:
            raise TypeError(f"key_dtype must be tf.int32, tf.int64 or tf.string, got {key_dtype.name}")
        if not isinstance(initializer_bank_size, int) or initializer_bank_size < 1:
            raise ValueError(f"initializer_bank_size must be a positive int, got {initializer_bank_size!r}")
        if num_segments < 1 or num_segments > 4096 or num_segments & (num_segments - 1):
            raise ValueError(f"num_segments must be a power of two in [1, 4096], got {num_segments}")
        if filter is not None and not isinstance(filter, AdmissionFilter):
            raise TypeError("filter must be an evstore.CounterFilter, evstore.BloomFilter or None, "
                            f"got {type(filter).__name__}")
        if storage is not None and not isinstance(storage, TieredStorage):
            raise TypeError(f"storage must be an evstore.TieredStorage or None, got {type(storage).__name__}")
        self._storage = storage
        self._evict_policies = _evict.normalize(evict)
        self._name = name
        self._dim = dim
        self._key_dtype = key_dtype
        self._initializer = initializer or tf.random_normal_initializer(0.0, 0.01)
        self._bank_size = initializer_bank_size
        self._segments_log2 = num_segments.bit_length() - 1
        self._filter = filter
        self._trainable = trainable
        if default_value is None:
            default_value = [0.0] * dim
        dv = tf.convert_to_tensor(default_value, tf.float32)
        if dv.shape.rank == 0:
            dv = tf.fill([dim], dv)
        if dv.shape.num_elements() != dim:
            raise ValueError(f"default_value must be a scalar or have {dim} elements, got shape {dv.shape}")
        self._default_value = tf.reshape(dv, [dim])
        self._default_np = self._default_value.numpy() if tf.executing_eagerly() else None
        if tf.executing_eagerly():
            self._shared_name = f"{name}_{_tf_ops.uid()}"
        else:
            self._shared_name = _tf_ops.get_default_graph().unique_name(name, mark_as_used=True)
        super().__init__()
        self._track_trackable(_SlotInitialValues(self), _SLOT_INITIAL_VALUES_CHILD)
        with tf.init_scope(), _colocated_with(self.resource_handle):
            self._proxy = tf.Variable(tf.zeros([0]), trainable=trainable, name=f"{name}_ev_proxy")
        register_proxy(self._proxy, self)
        self._init_op = self._initialize()
        if not tf.executing_eagerly():
            # One initializer makes the EV usable: the table and its proxy.
            self._init_op = tf.group(self._init_op, self._proxy.initializer)
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, self._init_op)

    # ---- resource protocol -------------------------------------------------
    def _create_resource(self):
        return gen.ev_handle_op(shared_name=self._shared_name, key_dtype=self._key_dtype)

    def _initialize(self):
        return self._create_table(self._default_value)

    def _create_table(self, default_value, bank=None):
        if bank is None:
            bank = self._initializer(shape=[self._bank_size, self._dim], dtype=tf.float32)
        bank = tf.convert_to_tensor(bank, tf.float32)
        if tf.executing_eagerly():
            self._bank = bank   # kept: a saved model carries it, so new keys start alike after a load
            if self._storage is not None:
                _storage._track(self)
        return self._create_table_at(self.resource_handle, bank, default_value)

    def _create_table_at(self, handle, bank, default_value):
        """Creates an empty table of this EV's kind (dim, key dtype, segments, filter, storage) behind
        `handle`, new keys starting from `bank` (also evstore/staging.py's second table)."""
        attrs = self._filter._native_attrs() if self._filter is not None else {}
        if self._storage is not None:
            attrs.update(self._storage._native_attrs())
        return gen.ev_create(handle, bank, default_value, key_dtype=self._key_dtype,
                             dim=self._dim, segments_log2=self._segments_log2, **attrs)

    def initializer_bank(self):
        """The rows new keys start from (float32 numpy [rows, dim]): key k starts
        from row `hash(k) % rows`. Eager only (None for an EV built in a graph)."""
        bank = getattr(self, "_bank", None)
        return None if bank is None else bank.numpy()

    def replace_table(self, bank):
        """Replaces the table by an empty one whose new keys start from `bank`
        ([rows >= 1, dim] floats), with this EV's filter and default value.

        Every row, slot, count and Bloom counter is dropped: this is the first
        half of loading a saved state (`evstore.keras.Embedding` loads a
        `.keras` file so, then applies the saved rows), which must also bring
        back the bank the saved keys' rows were drawn from. Eager only.

        Raises:
          ValueError: `bank` is not [rows >= 1, dim]; the table is unchanged.
          RuntimeError: called while building a graph.
        """
        if not tf.executing_eagerly():
            raise RuntimeError(f"EmbeddingVariable '{self._name}': replace_table runs eagerly only")
        bank = np.asarray(bank, np.float32)
        if bank.ndim != 2 or bank.shape[0] < 1 or bank.shape[1] != self._dim:
            raise ValueError(f"EmbeddingVariable '{self._name}': the bank must be [rows >= 1, {self._dim}], "
                             f"got {list(bank.shape)}")
        gen_resource_variable_ops.destroy_resource_op(self.resource_handle, ignore_lookup_error=True)
        self._create_table(self._default_value, bank=bank)

    def _destroy_resource(self):
        if tf.executing_eagerly() and self._resource_handle is not None:
            gen_resource_variable_ops.destroy_resource_op(self._resource_handle, ignore_lookup_error=True)

    # ---- variable-like surface -----------------------------------------------
    @property
    def name(self):
        return self._name

    @property
    def dim(self):
        return self._dim

    @property
    def key_dtype(self):
        return self._key_dtype

    @property
    def sharded(self):
        return False

    @property
    def shards(self):
        return (self,)

    @property
    def shape(self):
        return tf.TensorShape([None, self._dim])

    @property
    def trainable(self):
        return self._trainable

    @property
    def handle(self):
        """The proxy variable's handle: where tapes deliver this EV's gradients."""
        return self._proxy.handle

    @property
    def device(self):
        return self.resource_handle.device

    @property
    def proxy(self):
        """The zero-size tf.Variable that training lookups read: gradients reach it,
        and optimizers update the EV in its place (`optimizer.build` takes it;
        `ev_for_variable(ev.proxy) is ev`)."""
        return self._proxy

    @property
    def owner(self):
        """The ShardedEmbeddingVariable this EV is a shard of, or None."""
        ref = getattr(self, "_sharded_parent", None)
        return ref() if ref is not None else None

    @property
    def initializer(self):
        """The op that creates the table (graph mode); also in TABLE_INITIALIZERS."""
        return self._init_op

    @property
    def default_value(self):
        """What a key without a row reads: float32 numpy [dim] for an EV built
        eagerly; None for one built inside a graph (the value is a graph tensor)."""
        return self._default_np

    @property
    def filter(self):
        return self._filter

    @property
    def evict_policies(self):
        """The eviction policies, a tuple (empty when none)."""
        return self._evict_policies

    def __repr__(self):
        return f"<evstore.EmbeddingVariable '{self._name}' dim={self._dim} key_dtype={self._key_dtype.name}>"

    # ---- inspection ----------------------------------------------------------
    def size(self):
        """Number of admitted keys (keys that own a row), an int64 scalar tensor."""
        return gen.ev_size(self.resource_handle, key_dtype=self._key_dtype)

    def stats(self):
        """Table statistics as a dict of Python ints (eager) or int64 tensors (graph).

        size: keys in the index (admitted + filtered by a CounterFilter);
        admitted: keys that own a row; filtered: keys counted but not admitted
        (exact with a CounterFilter; with a BloomFilter an estimate of the
        distinct keys counted in the filter and not admitted); free_rows:
        recycled rows waiting for reuse; index_bytes; meta_bytes (per-row
        versions); row_bytes (embeddings + slots, free rows included);
        filter_bytes (Bloom counters); bytes: all of those; dirty (open dirty
        list length); deleted (open deleted set); evicted: keys evicted since
        the EV was created (this process). `evstore.summary.ev_stats` writes
        them as TensorBoard scalars; zero_rows: admitted keys whose
        embedding is exactly all zero (rows the group-lasso optimizers dropped,
        or rows of a zero initializer not yet trained; see `zero_row_keys`).
        """
        s = gen.ev_stats(self.resource_handle, key_dtype=self._key_dtype)
        if tf.executing_eagerly():
            out = dict(zip(_STAT_FIELDS, (int(x) for x in s.numpy())))
        else:
            out = {k: s[i] for i, k in enumerate(_STAT_FIELDS)}
        out["bytes"] = out["index_bytes"] + out["meta_bytes"] + out["row_bytes"] + out["filter_bytes"]
        return out

    def evict(self, global_step=None, return_rows=False):
        """Runs this EV's eviction policies at `global_step`; returns how many keys
        were evicted (an int64 scalar tensor), or with `return_rows` the tuple
        (count, keys [n], embeddings [n, dim]) of the keys evicted, read before
        their rows were freed.

        `global_step` (int or int64 tensor, >= 0) is the current training step;
        None uses the EV's clock (the highest global step it has seen from
        optimizer applies and evict calls). Evicted keys leave the table like
        `remove`: rows to the free list, keys to the deleted set. With no policy
        (`evict_policies == ()`) nothing is evicted (returns 0).

        Raises:
          ValueError: a negative Python `global_step`.
        """
        if global_step is None:
            step = tf.constant(-1, tf.int64)
        else:
            if isinstance(global_step, (int, np.integer)) and not isinstance(global_step, bool) and global_step < 0:
                raise ValueError(f"global_step must be >= 0, got {global_step}")
            step = tf.cast(global_step, tf.int64)
        out = gen.ev_evict(self.resource_handle, step, key_dtype=self._key_dtype, return_rows=bool(return_rows),
                           **_evict.native_attrs(self._evict_policies))
        return tuple(out) if return_rows else out.evicted

    def _lookup(self, ids, training, proxy=None):
        if not training:
            return gen.ev_find(self.resource_handle, ids, dim=self.dim)
        proxy = self._proxy if proxy is None else proxy
        proxy = getattr(proxy, "value", proxy) if not isinstance(proxy, tf.Variable) else proxy
        if not tf.compat.v1.executing_eagerly_outside_functions():
            # v1 graph: check the table first, so an uninitialized EV reports
            # itself (and tables_initializer) rather than its proxy variable.
            with tf.control_dependencies([gen.ev_size(self.resource_handle, key_dtype=self.key_dtype)]):
                pv = tf.identity(proxy)
        else:
            pv = tf.convert_to_tensor(proxy)
        return gen.ev_find_or_insert(self.resource_handle, ids, pv, dim=self.dim)

    def _key_tensor(self, ids, what="keys"):
        """The one validation of keys for every op on this EV: tensors must have
        the EV's key dtype (TypeError otherwise, nothing runs); Python lists and
        numpy arrays of integers (of bytes / str for a tf.string EV) are
        converted to it."""
        if self._key_dtype == tf.string:
            return self._string_key_tensor(ids, what)
        if not tf.is_tensor(ids):
            arr = np.asarray(ids)
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"EmbeddingVariable '{self._name}': {what} must be integers, got {arr.dtype} values")
            if self._key_dtype == tf.int32 and arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
                raise ValueError(f"EmbeddingVariable '{self._name}' has int32 keys; {what} hold values outside int32")
            return tf.convert_to_tensor(arr.astype(self._key_dtype.as_numpy_dtype))
        if ids.dtype != self._key_dtype:
            hint = (" (ids must be integers)" if not ids.dtype.is_integer
                    else f" (use tf.cast({what}, tf.{self._key_dtype.name}))")
            raise TypeError(f"EmbeddingVariable '{self._name}' has {self._key_dtype.name} keys but {what} are "
                            f"{ids.dtype.name}{hint}")
        return ids

    def _string_key_tensor(self, ids, what):
        if not tf.is_tensor(ids):
            arr = np.asarray(ids, dtype=object) if not isinstance(ids, np.ndarray) else ids
            if arr.size and arr.dtype.kind not in "SUO":
                raise TypeError(f"EmbeddingVariable '{self._name}' has string keys; {what} must be bytes or str, "
                                f"got {arr.dtype} values")
            if arr.dtype.kind == "O" and any(not isinstance(x, (bytes, str)) for x in arr.flat):
                raise TypeError(f"EmbeddingVariable '{self._name}' has string keys; {what} must be bytes or str")
            return tf.convert_to_tensor(arr, dtype=tf.string) if arr.size else tf.zeros(arr.shape, tf.string)
        if ids.dtype != tf.string:
            raise TypeError(f"EmbeddingVariable '{self._name}' has string keys but {what} are {ids.dtype.name} "
                            "(string keys are not converted from numbers: use tf.strings.as_string to make "
                            "them strings, or a tf.int64 EV)")
        return ids

    def frequency(self, keys):
        """Lookup counts of `keys` (0 for unseen keys), int64 with keys' shape."""
        f, _, _ = gen.ev_key_info(self.resource_handle, self._key_tensor(keys))
        return f

    def version(self, keys):
        """Global step of each key's last update (-1: never updated or absent)."""
        _, v, _ = gen.ev_key_info(self.resource_handle, self._key_tensor(keys))
        return v

    def admitted(self, keys):
        """Whether each key owns a row (bool, keys' shape)."""
        _, _, a = gen.ev_key_info(self.resource_handle, self._key_tensor(keys))
        return a

    def zero_row_keys(self):
        """Keys of admitted rows whose embedding is exactly all zero (int vector).

        With `optimizers.GroupAdam` / `GroupAdagrad` these are the features the
        group lasso dropped: they contribute nothing to the model, so they are
        natural eviction candidates (`ev.remove(ev.zero_row_keys())`, or an L2
        eviction policy with any threshold > 0). Their count is
        `stats()["zero_rows"]`.
        """
        return gen.ev_zero_row_keys(self.resource_handle, key_dtype=self._key_dtype)

    def set_slot_initial_values(self, inits):
        """Declares the initial values of optimizer slots ({slot name: float}):
        keys admitted from now on start those slots there. A slot the table
        lacks is added to every row at that value. Fused optimizers declare
        their slots at every update. Every save holds them and every restore
        brings them back, because the first training lookup after a restore
        may admit keys before the first update does; `CheckpointManager.restore`
        calls this for a checkpoint written before they were saved."""
        names = sorted(inits)
        with tf.device(self.device or None):
            gen.ev_read_rows(self.resource_handle, tf.constant([], self._key_dtype),
                             tf.constant(names, tf.string, shape=[len(names)]),
                             tf.constant([float(inits[n]) for n in names], tf.float32, shape=[len(names)]),
                             dim=self.dim)

    def remove(self, keys):
        """Erases keys (rows return to the free list; keys join the deleted set).
        Returns how many were present."""
        return gen.ev_remove(self.resource_handle, tf.reshape(self._key_tensor(keys), [-1]))

    def export(self):
        """The whole table as a dict of tensors (small tables, debugging, tf.train.Checkpoint).

        keys [N], values [N, dim], versions [N], freqs [N], slots {name: [N, dim]},
        filtered_keys [M], filtered_freqs [M] (counted but not admitted keys).
        `versions` are the stored values, as checkpoints hold them: v >= 0 is
        the step of the last update; v < 0 means never updated, with v = -2 - s
        for a key admitted at step s (-1: admission step unknown). `version()`
        returns -1 for every never-updated key.
        """
        k, v, s, ver, f, fk, ff, names = gen.ev_export(self.resource_handle, key_dtype=self._key_dtype,
                                                       dim=self._dim)
        out = {"keys": k, "values": v, "versions": ver, "freqs": f, "filtered_keys": fk, "filtered_freqs": ff}
        if tf.executing_eagerly():
            out["slots"] = {n.decode(): s[:, i, :] for i, n in enumerate(names.numpy())}
        else:
            out["slots_packed"], out["slot_names"] = s, names
        return out

    def load(self, keys, values, versions=None, freqs=None, slots=None, filtered_keys=None,
             filtered_freqs=None, clear=False):
        """Writes rows into the table (the inverse of `export`).

        keys [N] with values [N, dim]; versions default -1, freqs default 0;
        slots: {slot_name: [N, dim]}; filtered keys/freqs are counted-not-admitted
        keys. With clear=True the table is emptied first (a restore); otherwise
        rows are upserted and marked dirty.
        """
        keys = tf.reshape(self._key_tensor(keys), [-1])
        n = tf.shape(keys)[0]
        values = tf.convert_to_tensor(values, tf.float32)
        versions = tf.fill([n], tf.constant(-1, tf.int64)) if versions is None else tf.cast(versions, tf.int64)
        freqs = tf.zeros([n], tf.int64) if freqs is None else tf.cast(freqs, tf.int64)
        slots = slots or {}
        names = sorted(slots)
        packed = (tf.stack([tf.convert_to_tensor(slots[s], tf.float32) for s in names], axis=1) if names
                  else tf.zeros([n, 0, self._dim]))
        fk = self._key_tensor(tf.zeros([0], self._key_dtype) if filtered_keys is None else filtered_keys)
        ff = tf.zeros([0], tf.int64) if filtered_freqs is None else tf.cast(filtered_freqs, tf.int64)
        return gen.ev_import(self.resource_handle, keys, values, packed, tf.constant(names, tf.string),
                             versions, freqs, fk, ff, clear=clear)

    def keep_from(self, source, keys):
        """Copy-on-write of `source`'s values (an EmbeddingVariable of the same
        dim and key dtype): for each of `keys` (any shape) this EV holds no
        row of, writes the embedding an inference lookup of `source` reads now
        (its row, or its default value) as a never-updated row; keys this EV
        holds keep their rows. Returns how many keys were copied (an int64
        scalar tensor). Calls on one EV must not run concurrently."""
        if source.key_dtype != self._key_dtype or source.dim != self._dim:
            raise ValueError(f"EmbeddingVariable '{self._name}' ({self._key_dtype.name}, dim {self._dim}) cannot "
                             f"keep rows of '{source.name}' ({source.key_dtype.name}, dim {source.dim})")
        return gen.ev_keep_rows(self.resource_handle, source.resource_handle, self._key_tensor(keys))

    # ---- two-phase export (used by checkpoint savers) ----------------------
    def begin_export(self, return_keys=True):
        """Seals the keys changed and deleted since the last sealed export.

        Returns (snapshot_id, dirty_keys, deleted_keys); with return_keys=False
        the key lists are left empty (checkpoint writers stream the sealed keys
        from the snapshot instead of materialising them). Changes made from now on
        go to fresh sets. Exactly one of `commit_export(snapshot_id)` (the
        checkpoint holding these keys is durable) or `abort_export(snapshot_id)`
        (it failed: the keys are merged back, so the next export carries them)
        must follow; a second begin_export before that raises
        FailedPreconditionError.
        """
        return gen.ev_begin_export(self.resource_handle, key_dtype=self._key_dtype, return_keys=bool(return_keys))

    def commit_export(self, snapshot_id):
        """Drops a sealed snapshot: its changes are durable elsewhere."""
        return gen.ev_end_export(self.resource_handle, snapshot_id, key_dtype=self._key_dtype, commit=True)

    def abort_export(self, snapshot_id):
        """Merges a sealed snapshot back into the open dirty / deleted sets."""
        return gen.ev_end_export(self.resource_handle, snapshot_id, key_dtype=self._key_dtype, commit=False)

    # ---- tf.train.Checkpoint / v1 Saver / SavedModel (materialise the table) --
    # Tensor names follow docs/reference/checkpoint-format.md except that
    # these paths pack the optimizer slots into `<name>-slots` [N, S, dim] with
    # `<name>-slot_names` [S]: a restore must build its ops before the EV knows
    # its slots. tf.train.Checkpoint prefixes them with the object path
    # (`.../.ATTRIBUTES/-keys`); tf.compat.v1.train.Saver with the EV's name.
    def _ensure_created_in_saved_model(self):
        # A loaded SavedModel calls the save / restore functions before it
        # runs the resource's initializer, so the functions traced for it
        # create the table first (EvCreate is idempotent).
        tracing = isinstance(_tf_ops.get_default_graph(), func_graph.FuncGraph)
        if not (save_context.in_save_context() and tracing and self._default_np is not None):
            return []
        return [self._create_table(tf.constant(self._default_np))]

    def _export_tensors(self):
        deps = self._ensure_created_in_saved_model()
        if self._evict_policies:   # like every checkpoint save: evict first (at the EV's clock)
            with tf.control_dependencies(deps):
                deps = [self.evict()]
        with tf.control_dependencies(deps):
            k, v, s, ver, f, fk, ff, names = gen.ev_export(self.resource_handle, key_dtype=self._key_dtype,
                                                           dim=self._dim)
        return {schema.KEYS: k, schema.VALUES: v, schema.VERSIONS: ver, schema.FREQS: f, schema.KEYS_FILTERED: fk,
                schema.FREQS_FILTERED: ff, schema.SLOTS: s, schema.SLOT_NAMES: names}

    def _import_tensors(self, t):
        with tf.control_dependencies(self._ensure_created_in_saved_model()):
            return gen.ev_import(handle=self.resource_handle, keys=t[schema.KEYS], values=t[schema.VALUES],
                                 slots=t[schema.SLOTS], slot_names=t[schema.SLOT_NAMES],
                                 versions=t[schema.VERSIONS], freqs=t[schema.FREQS],
                                 filtered_keys=t[schema.KEYS_FILTERED], filtered_freqs=t[schema.FREQS_FILTERED],
                                 clear=True)

    def _serialize_to_tensors(self):
        return self._export_tensors()

    def _restore_from_tensors(self, restored_tensors):
        return self._import_tensors(restored_tensors)

    def _gather_saveables_for_checkpoint(self):
        # Used by tf.compat.v1.train.Saver only (TF2 uses the two methods above).
        return {"ev": functools.partial(_EVSaveable, self, name=self._name)}


_SLOT_INITIAL_VALUES_CHILD = "slot_initial_values"


class _SlotInitialValues(_trackable_base.Trackable):
    """The table's optimizer slots and their initial values (schema.SLOT_NAMES,
    schema.SLOT_INITIAL_VALUES) in a tf.train.Checkpoint or SavedModel, so the
    first lookup after a restore admits keys with their slots where the saved
    table would have started them (Adagrad's initial_accumulator_value), before
    any optimizer update states them. A child object of the EV rather than two
    more of its own tensors: a checkpoint written before it existed lacks the
    child, which TensorFlow then leaves unrestored, where a missing tensor of the
    EV itself would fail the restore."""

    def __init__(self, ev):
        self._ev = weakref.ref(ev)   # the EV owns this child: no cycle

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        # A SavedModel saves the copy of each object that it maps here: this one
        # reads the EV's copy in the SavedModel's graph (made by the EV's own
        # export, which may come after this one).
        ev = self._ev()
        exported = copy.copy(self)
        exported._ev = lambda: object_map.get(ev, ev)
        object_map[self] = exported
        return []

    def _serialize_to_tensors(self):
        ev = self._ev()
        with tf.control_dependencies(ev._ensure_created_in_saved_model()):
            names, inits = gen.ev_slots(ev.resource_handle, key_dtype=ev.key_dtype)
        return {schema.SLOT_NAMES: names, schema.SLOT_INITIAL_VALUES: inits}

    def _restore_from_tensors(self, restored_tensors):
        ev = self._ev()
        with tf.control_dependencies(ev._ensure_created_in_saved_model()):
            # Reading no keys declares the named slots with these initial values (EvReadRows).
            out = gen.ev_read_rows(ev.resource_handle, tf.constant([], ev.key_dtype),
                                   restored_tensors[schema.SLOT_NAMES],
                                   restored_tensors[schema.SLOT_INITIAL_VALUES], dim=ev.dim)
        return tf.group(out.values, out.slots, out.admitted)


class _EVSaveable(saveable_object.SaveableObject):
    """v1 Saver view of an EV: one spec per tensor, named `<name>-keys` etc."""

    def __init__(self, ev, name):
        self._ev = ev
        tensors = ev._export_tensors()
        self._suffixes = list(tensors)
        specs = [saveable_object.SaveSpec(t, "", name + suffix) for suffix, t in tensors.items()]
        super().__init__(ev, specs, name)

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes
        return self._ev._import_tensors(dict(zip(self._suffixes, restored_tensors)))
