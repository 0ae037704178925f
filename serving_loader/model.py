"""ServingModel: a loaded serving export kept fresh by applying checkpoints in place.

Apply protocol (docs/ARCHITECTURE.md, "Serving"):
  * stage (no lock): pick the next committed checkpoint of the served chain
    (its manifest's parent is the served sequence, its base the served full),
    verify every file against the manifest (size, crc32c), read its tensors
    into memory (a delta is small);
  * publish (exclusive lock): erase deleted keys and keys that lost their row,
    upsert changed rows, assign dense variables, set `version`.
  Predictions hold the lock shared, so none sees half a checkpoint; staging
  never blocks them. Checkpoints are applied in chain order, each once.
  * A gap, a bad checksum, a missing file or content the served tables cannot
    hold keeps the last good state serving; the failure is counted once per
    checkpoint (`failures`, kept in `last_error`) and that checkpoint is not
    retried. Recovery: once the root's newest chain resolves and does not
    contain the served checkpoint (the trainer wrote a new full), the model
    reloads from it (reload holds the lock for its duration; it also runs at
    start).
  * Identity, not just numbers: the served checkpoint is known by its
    sequence number and its manifest checksum, and a delta is applied only if
    its parent link names both. If the served checkpoint was withdrawn (a
    writer's lost acknowledgement: its manifest disappears or the newest
    chain no longer contains it), the model reloads from the newest chain.

Hold and roll back (an operator's controls):
  * `pin()` stops applying new commits (polls still scan the root, so
    `newest_committed` shows how far behind the served version is);
    `resume()` unpins and catches up at once (the chain is followed or the
    newest chain reloaded, as at any poll).
  * `rollback(seq, then="pin")` serves the retained commit `seq` (earlier or
    later than the served one): its whole chain (full + deltas up to `seq`)
    is staged and verified first, then published under the write lock in one
    step (the tables emptied and the chain applied), so a prediction sees the
    old version or `seq`, never a mix, and a failure leaves the served state
    untouched. Memory: the staged chain (keys, rows and dense weights of the
    full and its deltas up to `seq`) is held in addition to the served
    tables until it is published; nothing is kept between operations (the
    history is the root's retained commits).

Where each job lives (ServingModel is assembled from them; this module keeps
the loading, predictions and the public names):
  * serving_loader/staging.py: staging and publishing a checkpoint;
  * serving_loader/polling.py: following the root, reloads, failures, the
    background poll;
  * serving_loader/rollback.py: pin, resume, rollback, admin status;
  * serving_loader/apply_metrics.py: apply counters and `metrics()`;
  * serving_loader/flat_call.py: the fast signature call and `zero_example`;
  * serving_loader/rwlock.py, serving_loader/table.py: the reader-writer lock
    and the serving table adapter.
"""
import atexit
import json
import os
import threading
import weakref

import tensorflow as tf

from checkpoint.chain import scan
from checkpoint.shards import logical_entries
from checkpoint.storage import Storage
from evstore.storage import TieredStorage
from serving_loader.apply_metrics import ApplyMetrics
from serving_loader.ev_table import EVSTORE, STOCK, EvTable
from serving_loader.export import FORMAT, MAP_FILE
from serving_loader.flat_call import FlatCall, zero_example
from serving_loader.gate import Gate, GateState
from serving_loader.polling import Polling
from serving_loader.rollback import Rollback, RollbackError
from serving_loader.rwlock import RWLock
from serving_loader.staging import Staging
from serving_loader.streamed_reload import StreamedReload
from serving_loader.table import Table

__all__ = ["ServingModel", "NothingToServeError", "NotAnExportError", "RollbackError", "zero_example"]


def _read_signature_defs(export_dir):
    """{signature key: SignatureDef proto} of the export's (only) meta graph, as
    saved_model.pb holds them (TF Serving's metadata answers with these,
    including the `__saved_model_init_op` entry of a TF2 SavedModel)."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    return dict(sm.meta_graphs[0].signature_def)


def _close_at_exit(ref):
    model = ref()
    if model is not None:
        model.close()


class NothingToServeError(ValueError):
    """The checkpoint root has nothing the export can serve (it does not exist,
    holds no committed checkpoint, none of the export's tables, or its newest
    chain cannot be applied). The message is one line."""


class NotAnExportError(ValueError):
    """`export_dir` holds no evstore serving export (export_serving_model's
    map file is missing). The message is one line."""


TIER_STATS = ("cache_hits", "cache_misses", "cache_rows", "disk_bytes")


class ServingModel(Polling, Rollback, StreamedReload, Staging, ApplyMetrics):
    """A serving export (export_serving_model) plus the checkpoint chain applied to it.

    Args:
      export_dir: the SavedModel written by `export_serving_model`.
      checkpoint_root: the trainer's checkpoint root (path or fsspec URL);
        None serves the export as it is.
      storage_options: fsspec options for a remote root.
      allow_empty: serve the export as it is when the root does not exist or
        has nothing to apply yet (then polled as usual). False (default):
        raise NothingToServeError instead, so a wrong root is not mistaken
        for a served model.
      gate: a quality gate (a serving_loader.gate expression or Gate; None:
        every commit is applied): a commit that fails it stays committed but
        is not served; the model holds the last good version and serves again
        from the first later commit that passes (`admin_status()` reports it).
      use_serving_view: read a commit's serving view (lower-precision rows
        the trainer wrote with it, checkpoint/serving_view.py) when it has
        one (default True); False reads its float32 rows. Either way a
        replica reads only what it serves (checkpoint/fetch.py). An export
        of evstore tables reads float32 rows.
      storage: for an export written with `tables="evstore"`: None (default)
        keeps every row in DRAM; an `evstore.TieredStorage(dram_bytes,
        path)` keeps each served table's rows in a DRAM cache of
        `dram_bytes` (per table) over a private directory under `path`,
        removed by `close()` (serving_loader/ev_table.py,
        docs/guides/tiered-storage.md). A reload or rollback streams the full
        into a second table, then swaps it in.

    Attributes: `version` (sequence number served; None before the first
    checkpoint), `base` (its full), `pinned`, `serving_view` (precision of
    the served rows: "float32", "bfloat16", "float16" or "int8"),
    `metrics()` for monitoring.

    Raises:
      NotAnExportError (a ValueError): `export_dir` is not a serving export.
      ValueError: `storage` given for
        an export of stock tables.
      TypeError: `storage` is not an evstore.TieredStorage.
      NothingToServeError: (allow_empty=False) nothing of the root can be served.
      serving_loader.gate.GateError (a ValueError): a malformed gate.
    """

    def __init__(self, export_dir, checkpoint_root=None, storage_options=None, allow_empty=False, gate=None,
                 use_serving_view=True, storage=None):
        map_path = os.path.join(export_dir, MAP_FILE)
        try:
            with open(map_path) as f:
                self.mapping = json.load(f)
        except FileNotFoundError:
            raise NotAnExportError(f"{export_dir} is not an evstore serving export (no {MAP_FILE}); write it with "
                                   "serving_loader.export_serving_model") from None
        if self.mapping.get("format") != FORMAT:
            raise ValueError(f"{map_path} is not an evstore serving map")
        self.export_dir = export_dir
        self.table_kind = self.mapping.get("tables", STOCK)
        if storage is not None:
            if not isinstance(storage, TieredStorage):
                raise TypeError(f"storage must be an evstore.TieredStorage or None, got {type(storage).__name__}")
            if self.table_kind != EVSTORE:
                raise ValueError(f"{export_dir} serves its EVs from stock DenseHashTables, which hold every row in "
                                 "DRAM; tiered storage needs an export written with "
                                 "export_serving_model(..., tables=\"evstore\")")
        self.storage_tier = storage
        # The quality gate (serving_loader/gate.py): parsed first, so a malformed one is refused at once.
        if gate is not None and not isinstance(gate, GateState):
            gate = GateState(gate if isinstance(gate, Gate) else Gate.parse(gate))
        self.gate = gate
        self.served_quality = None     # quality record of the served commit (None: not recorded)
        self.storage = Storage(checkpoint_root, storage_options) if checkpoint_root is not None else None
        if self.storage is not None and not allow_empty:
            why = self._nothing_to_serve(scan(self.storage))   # before the (slow) SavedModel load
            if why:
                raise NothingToServeError(why)
        self._loaded = tf.saved_model.load(export_dir)
        self.signature = self.mapping["signature"]
        self._fn = self._loaded.signatures[self.signature]
        self._flat = {}   # signature key -> FlatCall or None (built on first use)
        self.signature_defs = _read_signature_defs(export_dir)
        if self.table_kind == EVSTORE:
            self._tables = {n: EvTable(self._loaded.tables[e["index"]], e["key_dtype"], e["dim"],
                                       self._loaded.ev_defaults[e["default"]].numpy(), storage=storage)
                            for n, e in self.mapping["evs"].items()}
        else:
            self._tables = {n: Table(self._loaded.tables[e["index"]], e["key_dtype"])
                            for n, e in self.mapping["evs"].items()}
        self._dense = {n: self._loaded.dense[i] for n, i in self.mapping["dense"].items()}
        # The two sentinel keys' rows (export.py); absent in exports older than them.
        self._reserved = {n: (self._loaded.reserved_rows[e["reserved"]], self._loaded.reserved_present[e["reserved"]])
                          for n, e in self.mapping["evs"].items() if "reserved" in e}
        self.inputs = {i["name"]: i for i in self.mapping["inputs"]}
        self._lock = RWLock()
        self._poll_lock = threading.Lock()
        self.version = None
        self.base = None
        self._served_checksum = None   # content identity of the served checkpoint
        self._bad = {}                 # (seq, checksum) -> error of a checkpoint refused for good
        self._counted = set()          # checkpoints whose failure `failures` counted
        self.applied = 0
        self.applied_seqs = []     # sequence numbers published, in order (a reload publishes its last)
        self.failures = 0
        self.last_error = None
        self.freshness_s = []      # commit -> served, per applied checkpoint (bounded)
        self.apply_latency_s = []  # stage + publish, per applied checkpoint (bounded)
        self.use_serving_view = bool(use_serving_view) and self.table_kind == STOCK
        self.serving_view = None       # precision of the served rows: "float32" or a view dtype (None: none yet)
        self.fetched_bytes_total = 0   # bytes read from the root for published checkpoints
        self.last_fetched_bytes = None # ... for the last one
        self.last_lag_s = None         # commit (its manifest's wall time) -> served, last checkpoint
        self.last_apply_s = None       # stage + publish, last checkpoint
        self.pinned = False
        self.newest_committed = None   # the newest committed sequence seen by the last poll
        self.rollbacks = 0
        self.rollback_failures = 0
        self.last_rollback = None      # {"from", "to", "then", "seconds", "wall_time"} of the last one done
        self._sched = None
        if self.table_kind == EVSTORE:   # a tiered table's directory goes with the process
            atexit.register(_close_at_exit, weakref.ref(self))
        if self.storage is not None:
            self.poll()
            if self.version is None and not allow_empty:
                raise NothingToServeError(" ".join(f"checkpoint root {self.storage.url}: {self.last_error or 'nothing to apply'}"
                                                   .split()))

    def _nothing_to_serve(self, sc):
        """Why the root (scanned as `sc`) has nothing for this export, or None."""
        where = f"checkpoint root {self.storage.url}"
        try:
            exists = self.storage.fs.isdir(self.storage.path)
        except OSError:
            exists = False
        if not exists and not sc.manifests:
            return f"{where} does not exist"
        if not sc.manifests:
            return f"{where} holds no committed checkpoint"
        want = set(self.mapping["evs"])
        held = set()
        for m in sc.manifests.values():
            held |= set(logical_entries(m))
        if want and not want & held:
            return (f"{where} holds none of the export's tables {sorted(want)} (its checkpoints hold "
                    f"{sorted(held)}): a checkpoint root of another model?")
        return None

    def predict(self, inputs):
        """Runs the serving signature. `inputs`: {input name: array-like}.
        Returns {output name: np.ndarray}. Raises ValueError for unknown or
        missing inputs (shapes and dtypes are checked by the signature)."""
        if not isinstance(inputs, dict):
            raise ValueError(f"inputs must be a dict of {sorted(self.inputs)}")
        unknown = sorted(set(inputs) - set(self.inputs))
        missing = sorted(set(self.inputs) - set(inputs))
        if unknown or missing:
            raise ValueError(f"unknown inputs {unknown}, missing inputs {missing}; the model takes "
                             f"{sorted(self.inputs)}")
        tensors = {n: tf.convert_to_tensor(v, dtype=self.inputs[n]["dtype"]) for n, v in inputs.items()}
        self._lock.acquire_read()
        try:
            self._fill_rows(self.signature, tensors)
            out = self._fn(**tensors)
            version = self.version
        except tf.errors.InvalidArgumentError as e:
            raise ValueError(f"the serving signature refused the inputs: {e.message}") from None
        finally:
            self._lock.release_read()
        return {k: v.numpy() for k, v in out.items()}, version

    def run(self, signature, inputs):
        """Runs signature `signature` of the export on `inputs` ({input name:
        np.ndarray of the signature's dtype}) under the read lock: the answer
        comes from exactly one applied checkpoint. Returns ({output name:
        np.ndarray}, version). Raises KeyError for an unknown signature and
        TensorFlow's errors for inputs the signature refuses."""
        fn = self._fn if signature == self.signature else self._loaded.signatures[signature]
        self._lock.acquire_read()
        try:
            self._fill_rows(signature, inputs)
            flat = self._flat.get(signature, False)
            if flat is False:   # its probe compares two calls: no publish between them
                flat = self._flat[signature] = FlatCall.build(fn, signature)
            out = flat(inputs) if flat is not None else None
            if out is None:
                out = fn(**inputs)
            version = self.version
        finally:
            self._lock.release_read()
        return {k: v.numpy() for k, v in out.items()}, version

    def rows(self):
        """{EV name: rows in its serving table}."""
        self._lock.acquire_read()   # a reload swaps evstore tables under the write lock
        try:
            return {n: int(t.size()) for n, t in self._tables.items()}
        finally:
            self._lock.release_read()

    def tier_stats(self):
        """{EV name: {"cache_hits", "cache_misses", "cache_rows", "disk_bytes"}} of
        tiered serving tables ({} for DRAM ones)."""
        if self.storage_tier is None:
            return {}
        self._lock.acquire_read()
        try:
            return {n: {k: v for k, v in t.stats().items() if k in TIER_STATS} for n, t in self._tables.items()}
        finally:
            self._lock.release_read()

    def close(self):
        """Stops polling and drops evstore serving tables now (a tiered table's
        directory is removed); the model serves no more. Idempotent; also run
        at interpreter exit. Stock tables are freed with the model."""
        self.stop()
        self._lock.acquire_write()
        try:
            tables, self._tables = self._tables, {}
            for t in tables.values():
                t.close()
        finally:
            self._lock.release_write()
