"""evstore tables as serving tables (docs/ARCHITECTURE.md, "Serving"; docs/guides/tiered-storage.md).

An export written with `export_serving_model(..., tables="evstore")` keeps each
EV as an evstore table in the SavedModel (`ExportedTable`, a resource whose
graph op is `EvFind`), so a serving process can keep its rows in a DRAM cache
over a disk tier (`evstore.TieredStorage`): a model larger than the serving
host's memory is served. The export holds no rows (a table larger than memory
is never materialised); the checkpoint chain fills it.

`EvTable` is ServingModel's adapter for such a table (the other adapter,
serving_loader/table.py, drives a DenseHashTable): upserts and erases for a
delta, and for a reload a `replacement()` table, filled outside the lock by
streaming the full's bundle, that `adopt` makes the served table in one swap
(`EvSwapTables`) under the write lock. Serving tables hold values only, no
optimizer slots; their dirty and deleted sets are dropped after each change
(nothing is ever exported from them), so they do not grow while serving.
"""
import logging

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import gen_resource_variable_ops

from checkpoint.bundle import load_ev
from evstore import ops, schema
from serving_loader.served_table import ReplaceableTable

__all__ = ["ExportedTable", "EvTable", "STOCK", "EVSTORE", "TABLE_KINDS"]

STOCK = "stock"       # DenseHashTable: any TensorFlow loads the export
EVSTORE = "evstore"   # evstore tables: loads with evstore's op library; rows may live in a tier
TABLE_KINDS = (STOCK, EVSTORE)

log = logging.getLogger("evstore.serving")


def _anonymous_handle(key_dtype):
    """A handle to a new table name of this process (as an eager tf.Variable's)."""
    return ops.ev_handle_op(shared_name=_context.anonymous_name(), key_dtype=key_dtype)


def _create(handle, key_dtype, dim, default, storage):
    """Creates the table behind `handle`: values only, reading `default` for a
    missing key; rows all in DRAM (`storage` None) or tiered."""
    attrs = storage._native_attrs() if storage is not None else {}
    ops.ev_create(handle, tf.zeros([1, dim], tf.float32), tf.constant(default, tf.float32), key_dtype=key_dtype,
                  dim=dim, **attrs)


def _destroy(handle):
    gen_resource_variable_ops.destroy_resource_op(handle, ignore_lookup_error=True)


class ExportedTable(tf.saved_model.experimental.TrackableResource):
    """An EV's serving table in an `evstore` export: an empty evstore table of
    `dim` float32 values per key reading `default` for a missing key. A
    SavedModel holding it loads where evstore's op library is loaded (import
    evstore first); each load creates its own table."""

    def __init__(self, key_dtype, dim, default):
        self._key_dtype = tf.as_dtype(key_dtype)
        self._dim = int(dim)
        self._default = np.asarray(default, np.float32).reshape([self._dim])
        super().__init__()
        self._initialize()

    def _create_resource(self):
        return _anonymous_handle(self._key_dtype)

    def _initialize(self):
        return _create(self.resource_handle, self._key_dtype, self._dim, self._default, None)

    def _destroy_resource(self):
        _destroy(self.resource_handle)

    def lookup(self, ids):
        """Rows of `ids` ([..., dim]), the default for a key without one."""
        return ops.ev_find(self.resource_handle, ids, dim=self._dim)


class _Replacement:
    """A table filled outside the serving lock, then adopted by an EvTable."""

    def __init__(self, key_dtype, dim, default, storage):
        self.key_dtype, self.dim = key_dtype, dim
        self.resource_handle = _anonymous_handle(key_dtype)
        try:
            _create(self.resource_handle, key_dtype, dim, default, storage)
        except BaseException:
            _destroy(self.resource_handle)
            raise

    def load_bundle(self, directory, entry, clear, shard_index=0, num_shards=1):
        """Streams EV `entry` of the bundle in `directory` into the table (rows,
        frequencies and filtered keys; no slots), in chunks; with num_shards > 1
        only the keys routed to shard_index. `clear` empties it first.
        Each tensor's crc32c is checked (tf.errors.DataLossError)."""
        load_ev(directory, self, entry, [], clear=clear, shard_index=shard_index, num_shards=num_shards)

    def erase(self, keys):
        _erase(self.resource_handle, self.key_dtype, keys)

    def insert(self, keys, values, freqs=None):
        _insert(self.resource_handle, self.key_dtype, self.dim, keys, values, freqs)

    def close(self):
        if self.resource_handle is not None:
            _destroy(self.resource_handle)
            self.resource_handle = None


def _forget_changes(handle, key_dtype):
    """Drops the table's dirty and deleted sets (seal, then commit: O(changed keys))."""
    sid, _, _ = ops.ev_begin_export(handle, key_dtype=key_dtype, return_keys=False)
    ops.ev_end_export(handle, sid, key_dtype=key_dtype, commit=True)


def _completed(op):
    """Runs `op()`. A tiered table whose disk refused a write-back still
    completes the op (the row stays in DRAM, the cache over its budget) and
    then reports ResourceExhausted (core/tiered_store.h): a publish must not
    stop half-way for it, so it is logged and the op counts as done."""
    try:
        op()
    except tf.errors.ResourceExhaustedError as e:
        if "free disk space" not in e.message:   # not a refused write-back (e.g. out of memory): not completed
            raise
        log.warning("serving table over its DRAM budget: %s", e.message)


def _erase(handle, key_dtype, keys):
    _completed(lambda: ops.ev_remove(handle, tf.constant(keys, key_dtype)))
    _forget_changes(handle, key_dtype)


def _insert(handle, key_dtype, dim, keys, values, freqs, forget=True):
    n = len(keys)
    freqs = np.ones([n], np.int64) if freqs is None else np.asarray(freqs, np.int64)
    # numpy arguments, converted without running an op each
    _completed(lambda: ops.ev_import(handle, tf.constant(keys, key_dtype), np.asarray(values, np.float32),
                                     np.zeros([n, 0, dim], np.float32), tf.constant([], tf.string),
                                     np.full([n], -1, np.int64), freqs,
                                     tf.constant([], key_dtype), np.zeros([0], np.int64), clear=False))
    if forget:
        _forget_changes(handle, key_dtype)


class EvTable(ReplaceableTable):
    """ServingModel's adapter for a loaded `ExportedTable`.

    Args:
      resource: the restored table resource (`loaded.tables[i]`), kept alive
        here: its handle is what the loaded graph's lookups read.
      key_dtype, dim, default: the table's (the serving map's, the export's
        `ev_defaults[i]`).
      storage: None keeps every row in DRAM; an `evstore.TieredStorage`
        replaces the loaded (empty) table by a tiered one under the same
        handle: rows in a DRAM cache of `storage.dram_bytes` over a private
        directory under `storage.path`, removed when the table is closed.
    """

    reserves_sentinels = False   # an evstore table holds every key (serving_loader/table.py's does not)
    weighs_freqs = True          # insert() takes the keys' frequencies: the tier's cache policy weighs them

    def __init__(self, resource, key_dtype, dim, default, storage=None):
        self._resource = resource
        self._h = resource.resource_handle
        self.key_dtype = tf.as_dtype(key_dtype)
        self.dim = int(dim)
        self.default = np.asarray(default, np.float32)
        self.storage = storage
        if storage is not None:
            _destroy(self._h)
            _create(self._h, self.key_dtype, self.dim, self.default, storage)

    def size(self):
        """Rows served: keys that own a row (a streamed full also brings the
        checkpoint's filtered keys, which read the default as they would
        absent; they are not counted)."""
        return self.stats()["admitted"]

    def stats(self):
        """The table's stats ({field: int}, evstore.schema.STATS_FIELDS), the
        tier's cache_hits / cache_misses / cache_rows / disk_bytes included."""
        raw = ops.ev_stats(self._h, key_dtype=self.key_dtype).numpy()
        return dict(zip(schema.STATS_FIELDS, (int(x) for x in raw)))

    def erase(self, keys):
        _erase(self._h, self.key_dtype, keys)

    def insert(self, keys, values, freqs=None, forget=True):
        """Upserts rows (`freqs`: the keys' training frequencies, which the tier's
        cache policy weighs; None: 1). `forget=False` keeps the table's dirty
        set (one op instead of three), for a table that is dropped whole soon
        (a sharded front's row cache)."""
        _insert(self._h, self.key_dtype, self.dim, keys, values, freqs, forget)

    def held(self, keys):
        """Whether each of `keys` (1-D) owns a row here (bool ndarray)."""
        _, _, admitted = ops.ev_key_info(self._h, tf.constant(keys, self.key_dtype))
        return admitted.numpy()

    def warm(self, keys):
        """Reads the rows of `keys` (a tiered table faults them into its DRAM
        cache), outside the write lock, so that upserting them under it reads
        no disk. Only a speed-up: an error is logged, not raised."""
        if self.storage is None:
            return
        try:
            ops.ev_find(self._h, tf.constant(keys, self.key_dtype), dim=self.dim)
        except tf.errors.OpError as e:
            log.warning("warming serving table rows failed: %s", e.message)

    def replacement(self):
        """A new empty table like this one (its own tier directory), to be
        filled and then adopted, or closed."""
        return _Replacement(self.key_dtype, self.dim, self.default, self.storage)

    def adopt(self, replacement):
        """Makes `replacement`'s rows this table's (the caller holds the write
        lock: no lookup runs) and drops the previous ones (and their tier)."""
        ops.ev_swap_tables(self._h, replacement.resource_handle, key_dtype=self.key_dtype)
        replacement.close()

    def close(self):
        """Drops the table (and its tier directory). The model serves no more."""
        _destroy(self._h)
