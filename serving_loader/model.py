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

The parts (TF Serving's Source, Loader, Manager and AspiredVersionPolicy; each
owns its state and is reached only through its methods), in the order a
commit walks through them (serving_loader/walk.py):
  * source.py, CommitSource: which commits of the root exist;
  * stager.py, Stager (streamed_reload.py for evstore tables): reads and
    checks one commit, no lock;
  * policy.py, ServingPolicy: what to serve (pin, quality gate, refusals);
  * publisher.py, Publisher: the served tables, dense weights and
    ServedVersion, and the reader-writer lock predictions read under;
  * apply_metrics.py, ApplyMetrics: counters for monitoring;
  * rollback.py: a walk to an operator's chosen commit.
This module loads the export, assembles the parts and answers predictions;
the served table kinds share served_table.py's interface (table.py,
ev_table.py); flat_call.py holds the fast signature call and `zero_example`.
"""
import atexit
import json
import os
import weakref

import tensorflow as tf

from checkpoint.storage import Storage
from evstore.storage import TieredStorage
from serving_loader import rollback as _rollback
from serving_loader.apply_metrics import ApplyMetrics
from serving_loader.ev_table import EVSTORE, STOCK, EvTable
from serving_loader.export import FORMAT, MAP_FILE
from serving_loader.flat_call import FlatCall, zero_example
from serving_loader.gate import Gate, GateState
from serving_loader.policy import ServingPolicy
from serving_loader.publisher import Publisher
from serving_loader.rollback import RollbackError
from serving_loader.source import CommitSource
from serving_loader.stager import Stager
from serving_loader.table import Table
from serving_loader.walk import REPLACE, STREAM, CommitWalk

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


TIER_STATS = ("cache_hits", "cache_misses", "cache_rows", "cache_capacity", "disk_bytes")


def _part(part, name, doc):
    """A read-only attribute of the model that is `name` of its part `part`."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


def _served(field, doc):
    return property(lambda self: getattr(self.publisher.served, field), doc=doc)


class ServingModel:
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
        replica reads only what it serves (checkpoint/fetch.py). Evstore
        tables keep the rows in the view's precision (in DRAM and on their
        tier: 2-3.5x the rows per byte; docs/guides/tiered-storage.md): the
        precision of the full a chain was loaded from.
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
        self.policy = ServingPolicy(gate)
        self.storage = Storage(checkpoint_root, storage_options) if checkpoint_root is not None else None
        self.source = CommitSource(self.storage) if self.storage is not None else None
        if self.source is not None and not allow_empty:   # before the (slow) SavedModel load
            self._check_root()
        self._loaded = tf.saved_model.load(export_dir)
        self.signature = self.mapping["signature"]
        self._fn = self._loaded.signatures[self.signature]
        self._flat = {}   # signature key -> FlatCall or None (built on first use)
        self.signature_defs = _read_signature_defs(export_dir)
        evs = self.mapping["evs"]
        if self.table_kind == EVSTORE:
            tables = {n: EvTable(self._loaded.tables[e["index"]], e["key_dtype"], e["dim"],
                                 self._loaded.ev_defaults[e["default"]].numpy(), storage=storage)
                      for n, e in evs.items()}
        else:
            tables = {n: Table(self._loaded.tables[e["index"]], e["key_dtype"]) for n, e in evs.items()}
        dense = {n: self._loaded.dense[i] for n, i in self.mapping["dense"].items()}
        # The two sentinel keys' rows (export.py); absent in exports older than them.
        reserved = {n: (self._loaded.reserved_rows[e["reserved"]], self._loaded.reserved_present[e["reserved"]])
                    for n, e in evs.items() if "reserved" in e}
        self.publisher = Publisher(tables, dense, reserved, {n: e["key_dtype"] for n, e in evs.items()})
        self.inputs = {i["name"]: i for i in self.mapping["inputs"]}
        self.use_serving_view = bool(use_serving_view)
        self.stager = Stager(self.storage, self.mapping, self.publisher, self.use_serving_view)
        self.apply_metrics = ApplyMetrics()
        self.walk = CommitWalk(self.source, self.stager, self.policy, self.publisher, self.apply_metrics,
                               reload=STREAM if self.table_kind == EVSTORE else REPLACE)
        if self.table_kind == EVSTORE:   # a tiered table's directory goes with the process
            atexit.register(_close_at_exit, weakref.ref(self))
        if self.storage is not None:
            self._first_poll(allow_empty)

    def _check_root(self):
        """NothingToServeError unless the root holds something for this export."""
        why = self.source.nothing_to_serve(self.source.scan(), self.mapping["evs"])
        if why:
            raise NothingToServeError(why)

    def _first_poll(self, allow_empty):
        self.poll()
        if self.version is None and not allow_empty:
            raise NothingToServeError(" ".join(f"checkpoint root {self.storage.url}: {self.last_error or 'nothing to apply'}"
                                               .split()))

    def _attach_root(self, checkpoint_root, storage_options=None, allow_empty=False, poll=True):
        """For a model made without a root (a sharded fleet's front and shards, which set
        up their tables first): follows `checkpoint_root` from now on, as the constructor
        would have (NothingToServeError unless `allow_empty`), polling it once if `poll`."""
        self.storage = Storage(checkpoint_root, storage_options)
        self.source = self.walk.source = CommitSource(self.storage)
        self.stager.storage = self.storage
        if not allow_empty:
            self._check_root()
        if poll:
            self._first_poll(allow_empty)

    def _fill_rows(self, signature, inputs):
        """Under the read lock, before signature `signature` runs on `inputs`: a sharded
        front fetches the rows it looks up from its shards (serving_loader/front.py).
        Nothing to do for one replica."""

    # What is served (the publisher's), how it got there (the metrics'), what is decided (the policy's).
    version = _served("seq", "Sequence number of the served commit (None before the first).")
    base = _served("base", "The served commit's full.")
    serving_view = _served("view", 'Precision of the served rows: "float32" or a view dtype (None: none yet).')
    served_quality = _served("quality", "Quality record of the served commit (None: not recorded).")
    pinned = _part("policy", "pinned", "True while the operator holds the served version.")
    gate = _part("policy", "gate", "The quality gate's state (serving_loader.gate.GateState), or None.")
    newest_committed = property(lambda self: self.source.newest_committed if self.source else None,
                                doc="The newest committed sequence number the last scan saw.")
    applied = _part("apply_metrics", "applied", "Commits published (a reload counts each it newly serves).")
    applied_seqs = _part("apply_metrics", "applied_seqs", "Sequence numbers published, in order (bounded).")
    failures = _part("apply_metrics", "failures", "Failures counted (each refused commit once).")
    last_error = _part("apply_metrics", "last_error", "The last failure's message.")
    freshness_s = _part("apply_metrics", "freshness_s", "Commit -> served seconds per applied commit (bounded).")
    apply_latency_s = _part("apply_metrics", "apply_latency_s", "Stage + publish seconds per applied commit (bounded).")
    fetched_bytes_total = _part("apply_metrics", "fetched_bytes_total", "Bytes read from the root for published commits.")
    last_fetched_bytes = _part("apply_metrics", "last_fetched_bytes", "Bytes read for the last published commit.")
    last_lag_s = _part("apply_metrics", "last_lag_s", "Commit -> served seconds, last commit.")
    last_apply_s = _part("apply_metrics", "last_apply_s", "Stage + publish seconds, last commit.")
    rollbacks = _part("apply_metrics", "rollbacks", "Rollbacks done.")
    rollback_failures = _part("apply_metrics", "rollback_failures", "Rollbacks that failed.")
    last_rollback = _part("apply_metrics", "last_rollback",
                          'The last rollback: {"from", "to", "then", "seconds", "wall_time"}.')

    def poll(self):
        """Applies every checkpoint committed since the served one; returns `version`."""
        return self.walk.poll()

    def start(self, every_s=1.0):
        """Polls the checkpoint root every `every_s` seconds (apscheduler).
        Raises ValueError (no root, a bad period) or RuntimeError (already polling)."""
        self.walk.start(every_s)

    def stop(self):
        """Stops the background polling (waits for a poll in progress)."""
        self.walk.stop()

    def pin(self):
        """Stops applying new commits (waits for an apply in progress); returns `version`.
        Polls still scan the root, so `newest_committed` shows how far behind the served version is."""
        with self.walk.lock:
            self.policy.pinned = True
            return self.version

    def resume(self):
        """Applies new commits again, starting now (catches up before
        returning; a failure is reported as by any poll). Returns `version`."""
        with self.walk.lock:
            self.policy.pinned = False
        return self.poll()

    def retained(self):
        """Sequence numbers of the root's committed checkpoints, ascending (the
        commits `rollback` can serve, if their chain is intact)."""
        return self.source.retained() if self.source is not None else []

    def rollback(self, seq, then="pin"):
        """Serves the retained commit `seq`, whole or not at all, then stays
        pinned (then="pin", the default) or resumes applying new commits
        (then="resume": catches up before returning). Returns `version`.

        Raises:
          RollbackError: a bad argument (status 400), `seq` not a retained
            commit (404), no checkpoint root or the commit's chain cannot be
            staged (409; counted in `rollback_failures`, `last_error` says
            why). The served state and the pin are then unchanged.
        """
        return _rollback.rollback(self.walk, seq, then)

    def admin_status(self):
        """The operator's view: served version and base, pin, newest commit
        seen, rollbacks and their failures, the last rollback, the last error."""
        return {"version": self.version, "base": self.base, "pinned": self.pinned,
                "newest_committed": self.newest_committed, "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "failures": self.failures, "last_error": self.last_error, "serving_view": self.serving_view,
                **(self.gate.status() if self.gate is not None else {})}

    def apply_samples(self, wait=True):
        """(applied, freshness samples, apply-latency samples) as of one moment
        (taken under the walk's lock). With wait=False returns None instead of
        waiting while a checkpoint is being applied."""
        if not self.walk.lock.acquire(blocking=wait):
            return None
        try:
            return self.apply_metrics.samples()
        finally:
            self.walk.lock.release()

    def metrics(self):
        """A snapshot for monitoring: version, applied, failures, rows per table,
        freshness and apply latency samples (seconds)."""
        return {"version": self.version, "base": self.base, **self.apply_metrics.snapshot(), "rows": self.rows(),
                "pinned": self.pinned, "newest_committed": self.newest_committed, "serving_view": self.serving_view}

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
        try:
            with self.publisher.reading() as served:
                self._fill_rows(self.signature, tensors)
                out = self._fn(**tensors)
        except tf.errors.InvalidArgumentError as e:
            raise ValueError(f"the serving signature refused the inputs: {e.message}") from None
        return {k: v.numpy() for k, v in out.items()}, served.seq

    def run(self, signature, inputs):
        """Runs signature `signature` of the export on `inputs` ({input name:
        np.ndarray of the signature's dtype}) under the read lock: the answer
        comes from exactly one applied checkpoint. Returns ({output name:
        np.ndarray}, version). Raises KeyError for an unknown signature and
        TensorFlow's errors for inputs the signature refuses."""
        fn = self._fn if signature == self.signature else self._loaded.signatures[signature]
        with self.publisher.reading() as served:
            self._fill_rows(signature, inputs)
            flat = self._flat.get(signature, False)
            if flat is False:   # its probe compares two calls: no publish between them
                flat = self._flat[signature] = FlatCall.build(fn, signature)
            out = flat(inputs) if flat is not None else None
            if out is None:
                out = fn(**inputs)
        return {k: v.numpy() for k, v in out.items()}, served.seq

    def rows(self):
        """{EV name: rows in its serving table}."""
        return self.publisher.rows()

    def tier_stats(self):
        """{EV name: {"cache_hits", "cache_misses", "cache_rows", "cache_capacity",
        "disk_bytes"}} of tiered serving tables ({} for DRAM ones); cache_capacity
        is the rows the DRAM budget holds at the served precision."""
        if self.storage_tier is None:
            return {}
        return self.publisher.table_stats(TIER_STATS)

    def close(self):
        """Stops polling and drops evstore serving tables now (a tiered table's
        directory is removed); the model serves no more. Idempotent; also run
        at interpreter exit. Stock tables are freed with the model."""
        self.stop()
        self.publisher.close()
