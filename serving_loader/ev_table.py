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
optimizer slots, in float32 or the serving view's precision
(evstore/native/core/serving_rows.h); they keep no dirty or deleted sets
(nothing is ever exported from them), so they do not grow while serving.
"""
import logging

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import gen_resource_variable_ops

from checkpoint.bundle import load_ev
from checkpoint.serving_view import CODECS
from evstore import ops, schema
from evstore.storage import TierNeed, record_bytes
from serving_loader.served_table import ReplaceableTable
from serving_loader.served_tensors import ViewRows

__all__ = ["ExportedTable", "EvTable", "STOCK", "EVSTORE", "TABLE_KINDS", "FLOAT32", "PRECISIONS"]

STOCK = "stock"       # DenseHashTable: any TensorFlow loads the export
EVSTORE = "evstore"   # evstore tables: loads with evstore's op library; rows may live in a tier
TABLE_KINDS = (STOCK, EVSTORE)
FLOAT32 = "float32"
# The precisions a serving table keeps its rows in: float32 or a serving view's (checkpoint/serving_view.py).
PRECISIONS = (FLOAT32,) + tuple(CODECS)

log = logging.getLogger("evstore.serving")


def _anonymous_handle(key_dtype):
    """A handle to a new table name of this process (as an eager tf.Variable's)."""
    return ops.ev_handle_op(shared_name=_context.anonymous_name(), key_dtype=key_dtype)


def _create(handle, key_dtype, dim, default, storage, precision=None, dram_bytes=None):
    """Creates the table behind `handle`: values only, reading `default` for a
    missing key; rows all in DRAM (`storage` None) or tiered. `precision`
    (PRECISIONS) makes it a serving table keeping its rows in that precision
    (evstore/native/core/serving_rows.h), whose lookups count in the keys'
    frequencies; None: a plain table (the export's own). `dram_bytes`: a
    tiered table's budget other than `storage`'s."""
    attrs = storage._native_attrs() if storage is not None else {}
    if storage is not None and dram_bytes is not None:
        attrs["tier_dram_bytes"] = dram_bytes
    if precision is not None:
        attrs["serving_rows"] = precision
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


# A replacement table loads with this fraction of the DRAM budget, at least LOADING_MIN_BYTES (a
# cache of a few thousand rows made a load through it many times slower) and at most the budget.
LOADING_FRACTION = 1 / 8
LOADING_MIN_BYTES = 64 << 20


def loading_dram_bytes(dram_bytes):
    """The DRAM budget a replacement table loads with (never above the served budget)."""
    return min(dram_bytes, max(LOADING_MIN_BYTES, int(dram_bytes * LOADING_FRACTION)))


class _Replacement:
    """A table filled outside the serving lock, then adopted by an EvTable;
    its rows in `precision`."""

    def __init__(self, key_dtype, dim, default, storage, precision, dram_bytes=None):
        self.key_dtype, self.dim, self.precision = key_dtype, dim, precision
        self.resource_handle = _anonymous_handle(key_dtype)
        try:
            _create(self.resource_handle, key_dtype, dim, default, storage, precision, dram_bytes)
        except BaseException:
            _destroy(self.resource_handle)
            raise

    def load_bundle(self, directory, entry, clear, shard_index=0, num_shards=1, view=None):
        """Streams EV `entry` of the bundle in `directory` into the table (rows,
        frequencies and filtered keys; no slots), in chunks; with num_shards > 1
        only the keys routed to shard_index. `clear` empties it first.
        `view`: the commit's serving view dtype when it holds one: its codes
        are stored as they are when it is the table's precision; otherwise the
        float32 rows are read (and encoded into the precision). Each tensor's
        crc32c is checked (tf.errors.DataLossError)."""
        load_ev(directory, self, entry, [], clear=clear, shard_index=shard_index, num_shards=num_shards,
                view=view if view == self.precision != FLOAT32 else "")

    def erase(self, keys):
        _erase(self.resource_handle, self.key_dtype, keys)

    def insert(self, keys, values, freqs=None):
        _insert(self.resource_handle, self.key_dtype, keys, values, freqs)

    def close(self):
        if self.resource_handle is not None:
            _destroy(self.resource_handle)
            self.resource_handle = None


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
    """Erases keys from a serving table (which keeps no deleted set)."""
    _completed(lambda: ops.ev_remove(handle, tf.constant(keys, key_dtype)))


def _insert(handle, key_dtype, keys, values, freqs):
    """Upserts rows into a serving table: `values` float32 [n, dim] (encoded
    into the table's precision) or ViewRows in its precision (stored as they
    are); nothing is marked dirty."""
    n = len(keys)
    freqs = np.ones([n], np.int64) if freqs is None else np.asarray(freqs, np.int64)
    if isinstance(values, ViewRows):
        codes, scales = values.codes, values.scales if values.scales is not None else np.zeros([0], np.float32)
    else:
        codes, scales = np.asarray(values, np.float32), np.zeros([0], np.float32)
    # numpy arguments, converted without running an op each
    _completed(lambda: ops.ev_serve_upsert(handle, tf.constant(keys, key_dtype), codes, scales, freqs))


class EvTable(ReplaceableTable):
    """ServingModel's adapter for a loaded `ExportedTable`.

    Args:
      resource: the restored table resource (`loaded.tables[i]`), kept alive
        here: its handle is what the loaded graph's lookups read.
      key_dtype, dim, default: the table's (the serving map's, the export's
        `ev_defaults[i]`).
      storage: None keeps every row in DRAM; an `evstore.TieredStorage`
        keeps them in a DRAM cache of `storage.dram_bytes` over a private
        directory under `storage.path`, removed when the table is closed.

    The loaded (empty) table is replaced under the same handle by a serving
    table: float32 rows until a reload brings a full with a serving view,
    whose precision its replacement keeps (`precision`: "float32",
    "bfloat16", "float16" or "int8"; evstore/native/core/serving_rows.h).
    Lookups decode rows to float32 and count in the keys' frequencies, which
    a tier's cache policy weighs (docs/guides/tiered-storage.md).
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
        self.precision = FLOAT32
        _destroy(self._h)
        _create(self._h, self.key_dtype, self.dim, self.default, storage, self.precision)

    def size(self):
        """Rows served: keys that own a row (a streamed full also brings the
        checkpoint's filtered keys, which read the default as they would
        absent; they are not counted)."""
        return self.stats()["admitted"]

    def stats(self):
        """The table's stats ({field: int}, evstore.schema.STATS_FIELDS), the
        tier's cache_hits / cache_misses / cache_rows / cache_capacity /
        disk_bytes included."""
        raw = ops.ev_stats(self._h, key_dtype=self.key_dtype).numpy()
        return dict(zip(schema.STATS_FIELDS, (int(x) for x in raw)))

    def erase(self, keys):
        _erase(self._h, self.key_dtype, keys)

    def insert(self, keys, values, freqs=None):
        """Upserts rows: `values` float32 [n, dim] (encoded into the table's
        precision as the serving view encodes them) or `ViewRows` in its
        precision (stored as they are); `freqs`: the keys' training
        frequencies, which the tier's cache policy weighs (None: 1)."""
        _insert(self._h, self.key_dtype, keys, values, freqs)

    def held(self, keys):
        """Whether each of `keys` (1-D) owns a row here (bool ndarray)."""
        _, _, admitted = ops.ev_key_info(self._h, tf.constant(keys, self.key_dtype))
        return admitted.numpy()

    def warm(self, keys):
        """Outside the write lock: a tiered table reads the rows of `keys` it
        holds into its DRAM cache and evicts rows to make room for the others
        (EvServeWarm), so upserting them under the lock reads and writes no
        disk. Only a speed-up: an error is logged, not raised."""
        if self.storage is None:
            return
        try:
            ops.ev_serve_warm(self._h, tf.constant(keys, self.key_dtype))
        except tf.errors.OpError as e:
            log.warning("warming serving table rows failed: %s", e.message)

    def replacement(self, precision=FLOAT32):
        """A new empty table like this one (its own tier directory), its rows
        in `precision`, to be filled and then adopted, or closed. A tiered
        one is filled with a cache of loading_dram_bytes(budget) (the rows
        it loads go to its tier), so that while it loads the process holds
        one budget and a fraction, not two; adopting it gives it the whole
        budget."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        loading = loading_dram_bytes(self.storage.dram_bytes) if self.storage is not None else None
        return _Replacement(self.key_dtype, self.dim, self.default, self.storage, precision, loading)

    def tier_need(self, name, rows, precision=FLOAT32):
        """What a replacement() in `precision` filled with `rows` of EV `name` writes to its tier at least
        (evstore.storage.TierNeed: each row beyond its loading cache, one record of the row packed in
        the precision: evstore.storage.record_bytes); None for a table all in DRAM."""
        if self.storage is None:
            return None
        return TierNeed(name, self.storage.path, None, rows, record_bytes(self.dim, precision=precision),
                        loading_dram_bytes(self.storage.dram_bytes), lambda: self.stats()["disk_bytes"])

    def adopt(self, replacement):
        """Makes `replacement`'s rows (and precision) this table's (the caller
        holds the write lock: no lookup runs), with the whole DRAM budget, and
        drops the previous ones (and their tier)."""
        ops.ev_swap_tables(self._h, replacement.resource_handle, key_dtype=self.key_dtype)
        if self.storage is not None:
            ops.ev_set_dram_bytes(self._h, np.int64(self.storage.dram_bytes), key_dtype=self.key_dtype)
        self.precision = replacement.precision
        replacement.close()

    def close(self):
        """Drops the table (and its tier directory). The model serves no more."""
        _destroy(self._h)
