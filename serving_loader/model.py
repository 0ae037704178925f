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
"""
import json
import logging
import os
import threading
import time

import numpy as np
import tensorflow as tf

from checkpoint.chain import WITHDRAWN_RESCANS, resolve_chain, scan, withdrawn
from checkpoint.errors import CheckpointError
from checkpoint.fetch import fetch
from checkpoint.shards import logical_entries
from checkpoint.storage import Storage
from serving_loader import served_tensors
from serving_loader.export import FORMAT, MAP_FILE, sentinels
from serving_loader.gate import Gate, GateState

__all__ = ["ServingModel", "NothingToServeError", "RollbackError"]

log = logging.getLogger("evstore.serving")

class _Withdrawn(Exception):
    """A checkpoint stopped being committed while it was staged."""


def _read_signature_defs(export_dir):
    """{signature key: SignatureDef proto} of the export's (only) meta graph, as
    saved_model.pb holds them (TF Serving's metadata answers with these,
    including the `__saved_model_init_op` entry of a TF2 SavedModel)."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    return dict(sm.meta_graphs[0].signature_def)


class _RWLock:
    """Many readers or one writer; a waiting writer blocks new readers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class NothingToServeError(ValueError):
    """The checkpoint root has nothing the export can serve (it does not exist,
    holds no committed checkpoint, none of the export's tables, or its newest
    chain cannot be applied). The message is one line."""


class RollbackError(Exception):
    """A rollback that was refused or failed; the served state is unchanged.
    `status`: the HTTP status an admin endpoint answers with (400 bad request,
    404 commit not retained, 409 no checkpoint root or the commit cannot be
    served)."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class _Table:
    """A loaded DenseHashTable (a restored resource) driven through TF's table ops."""

    def __init__(self, resource, key_dtype):
        self._h = resource.resource_handle
        self._kd = tf.as_dtype(key_dtype)

    def size(self):
        return tf.raw_ops.LookupTableSizeV2(table_handle=self._h)

    def export(self):
        return tf.raw_ops.LookupTableExportV2(table_handle=self._h, Tkeys=self._kd, Tvalues=tf.float32)

    def insert(self, keys, values):
        tf.raw_ops.LookupTableInsertV2(table_handle=self._h, keys=keys, values=values)

    def erase(self, keys):
        tf.raw_ops.LookupTableRemoveV2(table_handle=self._h, keys=keys)


def zero_example(inputs):
    """One example of zeros (empty strings for string inputs) for a
    signature's `inputs`: {name: (np dtype, or None for strings; shape as a
    list, None for any size)}. Returns {name: ndarray}, unknown sizes 1."""
    return {n: np.full([1 if d is None else d for d in shape], *((b"", object) if dtype is None else (0, dtype)))
            for n, (dtype, shape) in inputs.items()}


class _FlatCall:
    """A signature called on its flat inputs, without ConcreteFunction.__call__'s
    per-call argument binding, a large share of a one-row call's cost
    (docs/history/benchmarks-log.md).

    Built once per signature: its parameter order, specs and captured inputs
    (the variables and tables) do not change while a model is served, since
    applies write variables in place. It uses TensorFlow internals
    (`_inference_function.call_preflattened`; the TF minor version is pinned),
    so `build` checks it against the public call on a probe batch and returns
    None (the public call is used) when it is missing or answers otherwise.
    `__call__` returns None for inputs it does not take as they are (names,
    dtypes, shapes); the public call then runs and raises its usual error.
    """

    def __init__(self, fn):
        kw = fn.structured_input_signature[1]
        self.names = list(fn.function_type.parameters)
        self.specs = [kw[n] for n in self.names]
        self.captured = list(fn.captured_inputs)
        self._call = fn._inference_function.call_preflattened

    @classmethod
    def build(cls, fn, name):
        try:
            flat = cls(fn)
            if any(s.shape.rank is None for s in flat.specs):
                raise ValueError("an input of unknown rank")
            probe = zero_example({n: (None if s.dtype == tf.string else s.dtype.as_numpy_dtype, s.shape.as_list())
                                  for n, s in zip(flat.names, flat.specs)})
            want, got = fn(**probe), flat(probe)
            if got is None or set(got) != set(want) or not all(
                    np.array_equal(got[k].numpy(), want[k].numpy()) for k in want):
                raise ValueError("its answer differs from the public call's")
            return flat
        except Exception as e:  # noqa: BLE001 - any doubt: the public call
            log.info("signature %r is called through ConcreteFunction.__call__ (%s)", name, e)
            return None

    def __call__(self, inputs):
        if len(inputs) != len(self.names):
            return None
        flat = []
        for n, spec in zip(self.names, self.specs):
            a = inputs.get(n)
            if a is None:
                return None
            try:
                t = tf.convert_to_tensor(a, spec.dtype)
            except (TypeError, ValueError):
                return None
            if not spec.shape.is_compatible_with(t.shape):
                return None
            flat.append(t)
        return self._call(flat + self.captured)


class _Staged:
    """A checkpoint read into memory, ready to publish."""

    def __init__(self, manifest, evs, dense, view="float32", bytes_read=0):
        self.manifest = manifest
        self.evs = evs        # name -> (erase_keys, upsert_keys, upsert_values)
        self.dense = dense    # name -> np.ndarray
        self.view = view      # the precision its rows were read in
        self.bytes_read = bytes_read


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
        replica reads only what it serves (checkpoint/fetch.py).

    Attributes: `version` (sequence number served; None before the first
    checkpoint), `base` (its full), `pinned`, `serving_view` (precision of
    the served rows: "float32", "bfloat16", "float16" or "int8"),
    `metrics()` for monitoring.

    Raises:
      ValueError: `export_dir` is not a serving export.
      NothingToServeError: (allow_empty=False) nothing of the root can be served.
      serving_loader.gate.GateError (a ValueError): a malformed gate.
    """

    def __init__(self, export_dir, checkpoint_root=None, storage_options=None, allow_empty=False, gate=None,
                 use_serving_view=True):
        map_path = os.path.join(export_dir, MAP_FILE)
        try:
            with open(map_path) as f:
                self.mapping = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"{export_dir} is not an evstore serving export (no {MAP_FILE}); write it with "
                             "serving_loader.export_serving_model") from None
        if self.mapping.get("format") != FORMAT:
            raise ValueError(f"{map_path} is not an evstore serving map")
        self.export_dir = export_dir
        # The quality gate (serving_loader/gate.py): parsed first, so a malformed one is refused at once.
        self.gate = GateState(gate if isinstance(gate, Gate) else Gate.parse(gate)) if gate is not None else None
        self.served_quality = None     # quality record of the served commit (None: not recorded)
        self.storage = Storage(checkpoint_root, storage_options) if checkpoint_root is not None else None
        if self.storage is not None and not allow_empty:
            why = self._nothing_to_serve(scan(self.storage))   # before the (slow) SavedModel load
            if why:
                raise NothingToServeError(why)
        self._loaded = tf.saved_model.load(export_dir)
        self.signature = self.mapping["signature"]
        self._fn = self._loaded.signatures[self.signature]
        self._flat = {}   # signature key -> _FlatCall or None (built on first use)
        self.signature_defs = _read_signature_defs(export_dir)
        self._tables = {n: _Table(self._loaded.tables[e["index"]], e["key_dtype"])
                        for n, e in self.mapping["evs"].items()}
        self._dense = {n: self._loaded.dense[i] for n, i in self.mapping["dense"].items()}
        # The two sentinel keys' rows (export.py); absent in exports older than them.
        self._reserved = {n: (self._loaded.reserved_rows[e["reserved"]], self._loaded.reserved_present[e["reserved"]])
                          for n, e in self.mapping["evs"].items() if "reserved" in e}
        self.inputs = {i["name"]: i for i in self.mapping["inputs"]}
        self._lock = _RWLock()
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
        self.use_serving_view = bool(use_serving_view)
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
    # ---- predictions ---------------------------------------------------------
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
            flat = self._flat.get(signature, False)
            if flat is False:   # its probe compares two calls: no publish between them
                flat = self._flat[signature] = _FlatCall.build(fn, signature)
            out = flat(inputs) if flat is not None else None
            if out is None:
                out = fn(**inputs)
            version = self.version
        finally:
            self._lock.release_read()
        return {k: v.numpy() for k, v in out.items()}, version

    def rows(self):
        """{EV name: rows in its serving table}."""
        return {n: int(t.size()) for n, t in self._tables.items()}

    # ---- applying checkpoints ------------------------------------------------
    def poll(self):
        """Applies every checkpoint committed since the served one; returns `version`."""
        if self.storage is None:
            return self.version
        with self._poll_lock:
            # A checkpoint the writer's retention withdraws while this server
            # stages it is not a failure: scan again and serve what is committed.
            for _ in range(WITHDRAWN_RESCANS):
                sc = scan(self.storage)
                if not sc.manifests:
                    return self.version
                self.newest_committed = max(sc.manifests)
                if self.pinned:
                    return self.version
                try:
                    if self.version is not None and self._served_is_committed(sc):
                        self._follow_chain(sc)
                    self._maybe_reload(sc)
                except _Withdrawn as e:
                    log.info("%s was withdrawn while this server staged it (retention of its writer); "
                             "scanning again", e)
                    continue
                break
            return self.version

    def _still_committed(self, ms, error):
        """After staging `ms` failed with `error`: raises _Withdrawn when one
        of them is no longer committed (its manifest is gone: a writer removes
        the manifest before the files), else returns and the error counts."""
        try:
            gone = withdrawn(self.storage, ms)
        except OSError:
            return   # cannot tell: the staging error stands
        if gone:
            raise _Withdrawn(", ".join(gone)) from error

    def _served_is_committed(self, sc):
        m = sc.manifests.get(self.version)
        return m is not None and m.checksum == self._served_checksum

    def _follow_chain(self, sc):
        children = _children(sc)
        while True:
            # Without a gate, one commit at a time; with one, up to the first commit that passes it.
            pending = self._after_served(children, limit=None if self.gate else 1)
            if not pending:
                if self.gate is not None:
                    self.gate.clear()   # nothing newer in the served chain: nothing held back
                return
            run = pending
            if self.gate is not None:
                run, failed = self.gate.gate.admit(pending, self.gate.reference)
                self.gate.note(self.version, pending, failed)   # held until the commit that passed is published
                if not run:
                    return   # held: the gate's status says why
            t0 = time.time()
            staged = []
            for m in run:
                try:
                    staged.append(self._stage(m))
                except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
                    self._still_committed([m], e)
                    self._refuse(m, f"cannot apply {m.dir}: {e}", retry=isinstance(e, OSError))
                    return
            self._lock.acquire_write()
            try:
                for s in staged:   # a held stretch is published with the commit that passed, in one step
                    self._publish(s)
            finally:
                self._lock.release_write()
            for m in run:
                self._record(m, t0)
            if self.gate is not None:
                self.gate.clear(serving=run[-1].seq)

    def _after_served(self, children, limit=None):
        """The served chain's commits after the served one, in order (at most
        `limit`), stopping before one refused already (it waits for a new full)."""
        out, seq, checksum = [], self.version, self._served_checksum
        while limit is None or len(out) < limit:
            nxt = [m for m in children.get((self.base, seq), ())
                   if m.parent_checksum is None or m.parent_checksum == checksum]
            if not nxt:
                break
            m = min(nxt, key=lambda x: x.seq)
            if (m.seq, m.checksum) in self._bad:
                break
            out.append(m)
            seq, checksum = m.seq, m.checksum
        return out

    def _maybe_reload(self, sc):
        try:
            chain = resolve_chain(sc, where=self.storage.url)
        except CheckpointError as e:
            if self.version is None or max(sc.manifests) > self.version:
                self._refuse(None, f"newest chain cannot be served: {e}", key=("chain", str(e)))
            return
        served = (self.version, self._served_checksum)
        if any((m.seq, m.checksum) == served for m in chain):
            return  # the served checkpoint is in the newest chain: _follow_chain applies the rest
        if (chain[-1].seq, chain[-1].checksum) in self._bad:
            return  # this chain was refused already: wait for a newer one
        if self.gate is not None:
            chain = chain[:self._gated_end(sc, chain)]
            if not chain:
                return   # held on the served version: the gate's status says why
        if self.version is not None:
            log.warning("served %s is not in the newest chain (%s..%s): it was withdrawn or the chain was "
                        "replaced; reloading", self.version, chain[0].dir, chain[-1].dir)
        t0 = time.time()
        before = self.version
        try:
            self._load_chain(chain)
        except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
            self._still_committed(chain, e)
            self._refuse(chain[-1], f"cannot reload from {chain[0].dir}: {e}", retry=isinstance(e, OSError))
            return
        for m in chain:   # every checkpoint this reload newly serves counts as applied
            if before is None or m.seq > before or m.seq == chain[-1].seq:
                self._record(m, t0)
        log.info("serving %s (reloaded chain of %d)", chain[-1].dir, len(chain))

    def _gated_end(self, sc, chain):
        """How much of the newest `chain` a gated reload serves: up to the last
        commit the gate admits. The full always loads when the served chain
        cannot go on (nothing served yet; the served commit withdrawn; a
        commit after it refused or missing): a full is never held back from
        repairing a broken chain. 0: hold the served version."""
        gate = self.gate.gate
        start, ref, holding = 0, self.gate.reference, self.gate.held is not None
        if self.version is None or not self._served_chain_intact(sc):
            start, ref, holding = 1, gate.reference_after(None, chain[0].quality), False
        end = start
        while end < len(chain):
            run, failed = gate.admit(chain[end:], ref, holding=holding and end == 0)
            self.gate.note(chain[end - 1].seq if end else self.version, chain[end:], failed,
                           extend=holding and end == 0)
            if not run:
                break
            self.gate.clear(serving=run[-1].seq)
            end += len(run)
            for m in run:
                ref = gate.reference_after(ref, m.quality)
        return end

    def _served_chain_intact(self, sc):
        """The served commit is still committed (or its whole chain was removed
        by the writer's retention: it was committed) and every later commit of
        its chain follows from it."""
        if not self._served_is_committed(sc):
            fulls = [q for q, m in sc.manifests.items() if m.kind == "full"]
            return bool(fulls) and self.base < min(fulls)
        reachable = {m.seq for m in self._after_served(_children(sc))}
        return all(q in reachable for q, m in sc.manifests.items() if m.base == self.base and q > self.version)

    def _load_chain(self, chain):
        """Stages every checkpoint of `chain` (raising before any change if one
        fails), then under the write lock replaces the served state with it."""
        staged = [self._stage(m) for m in chain]
        self._lock.acquire_write()
        try:
            for name, table in self._tables.items():  # drop the previous chain's rows
                keys, _ = table.export()
                empty, deleted = sentinels(self.mapping["evs"][name]["key_dtype"])
                keys = tf.boolean_mask(keys, tf.logical_and(tf.not_equal(keys, empty), tf.not_equal(keys, deleted)))
                if int(tf.size(keys)):
                    table.erase(keys)
            for _, present_var in self._reserved.values():
                present_var.assign(tf.zeros_like(present_var))
            for s in staged:
                self._publish(s)
        finally:
            self._lock.release_write()

    # ---- hold and roll back --------------------------------------------------
    def pin(self):
        """Stops applying new commits (waits for an apply in progress); returns `version`."""
        with self._poll_lock:
            self.pinned = True
            return self.version

    def resume(self):
        """Applies new commits again, starting now (catches up before
        returning; a failure is reported as by any poll). Returns `version`."""
        with self._poll_lock:
            self.pinned = False
        return self.poll()

    def retained(self):
        """Sequence numbers of the root's committed checkpoints, ascending (the
        commits `rollback` can serve, if their chain is intact)."""
        if self.storage is None:
            return []
        return sorted(scan(self.storage).manifests)

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
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 1:
            raise RollbackError(400, f"a rollback names a commit by its sequence number (an integer >= 1), "
                                     f"got {seq!r}")
        if then not in ("pin", "resume"):
            raise RollbackError(400, f'then must be "pin" or "resume", got {then!r}')
        if self.storage is None:
            raise RollbackError(409, "no checkpoint root: this server serves its export as it is")
        seq = int(seq)
        with self._poll_lock:
            sc = scan(self.storage)
            if seq not in sc.manifests:
                kept = sorted(sc.manifests)
                raise RollbackError(404, f"commit {seq} is not retained in {self.storage.url} (retained: "
                                         f"{_ranges(kept) or 'none'})")
            t0 = time.time()
            before = self.version
            try:
                self._load_chain(resolve_chain(sc, upto=seq, where=self.storage.url))
            except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
                self.rollback_failures += 1
                msg = " ".join(f"rollback to {seq} failed, still serving {before}: {e}".split())
                self._fail(msg)
                raise RollbackError(409, msg) from None
            self.rollbacks += 1
            if self.gate is not None:
                self.gate.clear()   # the operator's choice; the gate judges the commits after it
            self.last_rollback = {"from": before, "to": seq, "then": then, "seconds": round(time.time() - t0, 6),
                                  "wall_time": time.time()}
            self.pinned = then == "pin"
            log.info("rolled back from %s to %s (%s)", before, seq, "pinned" if self.pinned else "resuming")
        return self.poll() if then == "resume" else self.version

    def admin_status(self):
        """The operator's view: served version and base, pin, newest commit
        seen, rollbacks and their failures, the last rollback, the last error."""
        return {"version": self.version, "base": self.base, "pinned": self.pinned,
                "newest_committed": self.newest_committed, "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "failures": self.failures, "last_error": self.last_error, "serving_view": self.serving_view,
                **(self.gate.status() if self.gate is not None else {})}

    def _stage(self, m):
        """Reads and checks what checkpoint `m` changes in the served state,
        nothing else (checkpoint/fetch.py: keys, values or the serving view,
        filtered and deleted keys, the served dense weights; never optimizer
        state). Raises CheckpointError for anything that cannot be served."""
        parts = logical_entries(m)   # a sharded EV's parts apply to its one table
        missing = sorted(set(self._tables) - set(parts))
        if missing:
            raise CheckpointError(f"{m.dir} holds no EV {missing} that the export serves")
        plan = served_tensors.plan(m, {n: parts[n] for n in self._tables}, list(self._dense), self.use_serving_view)
        with fetch(self.storage, m, plan.tensors) as t:
            evs = {}
            for name in self._tables:
                try:
                    keys, values, erase = plan.ev_arrays(t, name, self.mapping["evs"][name]["dim"])
                except ValueError as e:
                    raise CheckpointError(f"{m.dir}: EV {name!r}: {e}") from None
                evs[name] = self._checked(m, name, erase, keys, values)
            dense = {n: t[n] for n in self._dense}
            bytes_read = t.bytes_read
        for n, v in dense.items():
            if tuple(v.shape) != tuple(self._dense[n].shape) or v.dtype != self._dense[n].dtype.as_numpy_dtype:
                raise CheckpointError(f"{m.dir}: dense {n!r} is {v.dtype} {list(v.shape)}, the export serves "
                                      f"{self._dense[n].dtype.name} {self._dense[n].shape.as_list()}")
        return _Staged(m, evs, dense, view=plan.view, bytes_read=bytes_read)

    def _checked(self, m, name, erase, keys, values):
        """Validates an EV's staged tensors completely (publish must not fail
        half-way): dtypes, dim, row counts; splits off the sentinel keys, which
        live beside the table. Returns (erase, keys, values, reserved) with
        reserved = {j: row or None (erased)} for sentinel key j (sentinels())."""
        info = self.mapping["evs"][name]
        kd = tf.as_dtype(info["key_dtype"]).as_numpy_dtype
        if keys.dtype != kd or erase.dtype != kd:
            raise CheckpointError(f"{m.dir}: EV {name!r} has {keys.dtype} keys, the export serves {info['key_dtype']}")
        if values.dtype != np.float32 or values.ndim != 2 or values.shape != (len(keys), info["dim"]):
            raise CheckpointError(f"{m.dir}: EV {name!r} has rows of shape {values.shape[1:]} for {len(keys)} keys, "
                                  f"the export serves dim {info['dim']}")
        empty, deleted = sentinels(info["key_dtype"])
        reserved = {}
        for j, k in enumerate((empty, deleted)):
            if (erase == k).any():
                reserved[j] = None
            hit = np.flatnonzero(keys == k)
            if hit.size:
                reserved[j] = values[hit[-1]]
        if reserved:
            if name not in self._reserved:
                raise CheckpointError(f"{m.dir}: EV {name!r} holds key {(empty, deleted)[min(reserved)]!r}, which this export "
                                      "cannot serve (written before sentinel keys were served): re-export it "
                                      "with export_serving_model")
            keep = (keys != empty) & (keys != deleted)
            keys, values = keys[keep], values[keep]
            erase = erase[(erase != empty) & (erase != deleted)]
        return erase, keys, values, reserved

    def _publish(self, s):
        """Under the write lock: make the staged checkpoint the served state.
        Everything was validated by _stage, so no step here fails on content."""
        for name, (erase, keys, values, reserved) in s.evs.items():
            table = self._tables[name]
            if erase.size:
                table.erase(tf.constant(erase))
            if keys.size:
                table.insert(tf.constant(keys), tf.constant(values))
            if reserved:
                rows_var, present_var = self._reserved[name]
                rows, present = rows_var.numpy(), present_var.numpy()
                for j, row in reserved.items():
                    present[j] = row is not None
                    if row is not None:
                        rows[j] = row
                rows_var.assign(rows)
                present_var.assign(present)
        for name, value in s.dense.items():
            self._dense[name].assign(value)
        self.version = s.manifest.seq
        self.base = s.manifest.base
        self.serving_view = s.view
        self.fetched_bytes_total += s.bytes_read
        self.last_fetched_bytes = s.bytes_read
        self._served_checksum = s.manifest.checksum
        self.served_quality = s.manifest.quality
        if self.gate is not None:
            self.gate.served(s.manifest.quality)

    def _record(self, m, t0):
        now = time.time()
        self.applied += 1
        self.applied_seqs = (self.applied_seqs + [m.seq])[-10000:]
        self.apply_latency_s = (self.apply_latency_s + [now - t0])[-1000:]
        self.freshness_s = (self.freshness_s + [max(0.0, now - m.wall_time)])[-1000:]
        self.last_lag_s, self.last_apply_s = self.freshness_s[-1], self.apply_latency_s[-1]
        self.last_applied_wall = now

    def _refuse(self, m, msg, key=None, retry=False):
        """A checkpoint (or chain) that cannot be served: counted once; not
        retried unless the cause may pass (`retry`: an I/O error)."""
        key = key or (m.seq, m.checksum)
        if key in self._bad:
            return
        if not retry:
            self._bad[key] = msg
        if key in self._counted:
            self.last_error = msg
            return
        self._counted.add(key)
        self._fail(msg)

    def _fail(self, msg):
        self.failures += 1
        self.last_error = msg
        log.warning("%s (still serving %s)", msg, self.version)

    # ---- background polling --------------------------------------------------
    def start(self, every_s=1.0):
        """Polls the checkpoint root every `every_s` seconds (apscheduler)."""
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0:
            raise ValueError(f"every_s must be a positive number of seconds, got {every_s!r}")
        if self.storage is None:
            raise ValueError("no checkpoint_root to poll")
        if self._sched is not None:
            raise RuntimeError("already polling; stop() first")
        from checkpoint.schedule import background_scheduler
        self._sched = background_scheduler("serving")
        self._sched.add_job(self._poll_quietly, "interval", seconds=every_s, id="poll", max_instances=1,
                            coalesce=True)
        self._sched.start()

    def _poll_quietly(self):
        try:
            self.poll()
        except Exception as e:  # noqa: BLE001 - the poller must survive
            self._refuse(None, f"poll failed: {e!r}", key=("poll", repr(e)), retry=True)  # counted once

    def stop(self):
        if self._sched is not None:
            self._sched.shutdown(wait=True)
            self._sched = None

    def apply_samples(self, wait=True):
        """(applied, freshness samples, apply-latency samples) as of one moment
        (taken under the poll lock). With wait=False returns None instead of
        waiting while a checkpoint is being applied."""
        if not self._poll_lock.acquire(blocking=wait):
            return None
        try:
            return self.applied, list(self.freshness_s), list(self.apply_latency_s)
        finally:
            self._poll_lock.release()

    def metrics(self):
        """A snapshot for monitoring: version, applied, failures, rows per table,
        freshness and apply latency samples (seconds)."""
        return {"version": self.version, "base": self.base, "applied": self.applied,
                "applied_seqs": list(self.applied_seqs), "failures": self.failures,
                "last_error": self.last_error, "rows": self.rows(), "freshness_s": list(self.freshness_s),
                "apply_latency_s": list(self.apply_latency_s), "pinned": self.pinned,
                "newest_committed": self.newest_committed, "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "serving_view": self.serving_view, "fetched_bytes_total": self.fetched_bytes_total,
                "last_fetched_bytes": self.last_fetched_bytes, "last_lag_s": self.last_lag_s,
                "last_apply_s": self.last_apply_s}


def _children(sc):
    """{(base, parent seq): [deltas naming it]} of a scan."""
    out = {}
    for m in sc.manifests.values():
        if m.kind == "delta":
            out.setdefault((m.base, m.parent), []).append(m)
    return out


def _ranges(seqs):
    """"1-3, 7, 9-12" for [1, 2, 3, 7, 9, 10, 11, 12]."""
    out, start = [], None
    for i, q in enumerate(seqs):
        if start is None:
            start = q
        if i + 1 == len(seqs) or seqs[i + 1] != q + 1:
            out.append(str(start) if start == q else f"{start}-{q}")
            start = None
    return ", ".join(out)
