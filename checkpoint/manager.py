"""CheckpointManager: full and delta checkpoints of a training model, chained,
crash-safe, on any fsspec root.

Commit protocol (docs/ARCHITECTURE.md, "Checkpoints" and "Reliability"). One save, in order:
  1. eviction: every EV with eviction policies runs `ev.evict(global_step)`,
     so the keys it drops are in this checkpoint's deleted set (then the
     caller's metadata and quality callables run, seeing the evicted state);
  2. seal: each EV's dirty and deleted sets are sealed into a snapshot
     (`begin_export`); changes from now on go to fresh sets;
  3. write: the native writer streams the bundle (rows in chunks, never a copy
     of the table) into the checkpoint directory (local roots) or a local
     staging directory (remote roots), fsyncing every file;
  4. verify the bundle's index lists every tensor; upload (remote roots);
  5. commit point: MANIFEST.json (sizes and crc32c of every file, counts,
     steps, parent/base, caller metadata) written atomically, last;
  6. only then each EV commits its snapshot.
Any failure in 1-5 aborts the snapshots (their keys merge back into the open
sets, so the next save carries every change) and removes the directory. A kill
anywhere leaves at worst a directory without a manifest, which readers ignore
and the next save removes; a kill between 5 and 6 leaves a committed
checkpoint whose changes the restarted job restores.

Exactness: steps 1-3 run under `manager.lock`. A training loop that holds the
same lock around each step (`with manager.lock: train_step()`) gets
checkpoints that are exactly the state after a step, matching the global step
and the caller's metadata (the input position); without it every row is still
a value it had during the save and the chain never misses a change.
One writer per root, enforced by a lease file (checkpoint/lease.py).
"""
import logging
import threading

import tensorflow as tf

from checkpoint.bundle import GLOBAL_STEP, bundle_signature, load_ev, load_ev_routed, read_dense
from checkpoint.chain import WITHDRAWN_RESCANS, resolve_chain, scan, withdrawn
from checkpoint.collect import collect
from checkpoint.commit import commit_checkpoint
from checkpoint.errors import ChainError, CheckpointError, CorruptCheckpointError
from checkpoint.fetch import fetch
from checkpoint.lease import LeaseHeldError, process_lease
from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.remote_parts import bundle_subset, entry_tensors, release_on_tasks, reread_files, stage_on_tasks
from checkpoint.serving_view import codec
from checkpoint.shards import device_groups, load_plan, load_units, logical_name
from checkpoint.object_source import damaged
from checkpoint.slots import slot_initial_values, slots_to_load
from checkpoint.storage import Storage
from checkpoint.tensor_read import read_index
from evstore import quality as _quality
from evstore import schema
from evstore.staging import StagingTable, adopt, can_stage, check_room, place

__all__ = ["CheckpointManager"]

log = logging.getLogger("evstore.checkpoint")


class CheckpointManager:
    """Saves and restores `model` as full and delta checkpoints under `root`.

    Args:
      root: a local path or any fsspec URL (`memory://job`, `s3://bucket/p`).
      model: a Keras model, a tf.Module, an optimizer, EmbeddingVariables and
        variables, or a list / dict of them (see checkpoint.collect).
      global_step: an integer variable stamped into every checkpoint and
        restored; default: the Keras optimizer's `iterations` if one is found.
      keep_chains: chains (a full and its deltas) kept; older ones are deleted
        after each full. None keeps everything.
      storage_options: passed to fsspec for remote roots.
      chunk_rows: keys per streamed chunk (memory of a save ~ chunk_rows x row bytes).
      lease: take the root's writer lease (checkpoint/lease.py) at the first
        save: a second writer process on the root is refused with
        LeaseHeldError naming the holder. Managers of one process share it.
        A refused manager stays refused: every later save raises the same
        LeaseHeldError (make a new manager, and restore, to write there).
      lease_timeout: seconds without a heartbeat after which a lease is
        stale and taken over (the holder renews it every lease_timeout / 3).
      take_over: take the lease even from a holder that looks alive (say so
        only when it is gone).
      serving_view: None (default), or "bfloat16", "float16" or "int8": every
        commit also holds the served rows in that precision, for serving
        replicas (checkpoint/serving_view.py). The trainer's state and
        restore stay float32.
      on_evict: None, or a callable `on_evict(ev, keys, embeddings)` that
        each save calls under `lock`, once per EV with eviction policies,
        with the keys its eviction removed and their embeddings (numpy),
        before anything else of the save reads the model: for a caller that
        keeps values the table drops (the trainer's reference model,
        evstore_app/job/reference.py).

    Raises:
      ValueError / TypeError: bad arguments, or names that collide.
    """

    def __init__(self, root, model, global_step=None, keep_chains=3, storage_options=None, chunk_rows=65536,
                 lease=True, lease_timeout=60.0, take_over=False, serving_view=None, on_evict=None):
        if keep_chains is not None and (isinstance(keep_chains, bool) or not isinstance(keep_chains, int)
                                        or keep_chains < 1):
            raise ValueError(f"keep_chains must be an int >= 1 or None, got {keep_chains!r}")
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
        if serving_view is not None:
            codec(serving_view)   # ValueError naming the choices
        self.serving_view = serving_view
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be callable or None, got {type(on_evict).__name__}")
        self.on_evict = on_evict
        self.storage = Storage(root, storage_options)
        if isinstance(lease_timeout, bool) or not isinstance(lease_timeout, (int, float)) or lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be a positive number of seconds, got {lease_timeout!r}")
        self._lease_args = (lease_timeout, take_over) if lease else None
        self._lease = None
        self._lease_refused = None           # the LeaseHeldError that refused this manager, kept
        self.model = model
        self.keep_chains = keep_chains
        self.chunk_rows = chunk_rows
        self._global_step = global_step
        collect(model)  # validate names now, not at the first save
        self.lock = threading.RLock()        # training steps and saves' seal + write
        self._save_lock = threading.Lock()   # one save or restore at a time
        self._last = None                    # last committed Manifest of this process's chain
        self.history = []                    # every Manifest this manager committed, in order (kept
                                             # when retention later deletes the checkpoint)
        self._slot_filter = None             # slots a restore loads (None: all)
        self._burned = 0                     # highest sequence number a failed save used
        self._sched = None
        self._metadata_fn = None
        self._quality_fn = None
        self.failures = 0
        self.last_error = None
        self.last_save_stats = {}            # {"bytes_sent_here": bytes this process sent to the root} of the last save
        self.last_restore_stats = {}         # {"bytes_read": bytes every process read from the root} of the last restore

    # ---- queries -------------------------------------------------------------
    @property
    def root(self):
        return self.storage.url

    @property
    def last_committed(self):
        """Manifest of the last checkpoint this manager saved or restored (None before)."""
        return self._last

    def latest(self):
        """The newest committed checkpoint's Manifest under the root, or None."""
        sc = scan(self.storage)
        return sc.manifests[max(sc.manifests)] if sc.manifests else None

    def chain(self, seq=None):
        """Manifests [full, deltas...] that restore(seq) would apply ([] if the root is empty)."""
        sc = scan(self.storage)
        if not sc.manifests:
            return []
        return resolve_chain(sc, seq, where=self.root)

    # ---- saving --------------------------------------------------------------
    def save_full(self, metadata=None, quality=None):
        """Writes every key of every EV, every dense variable and the global
        step as a new chain. Returns its sequence number.

        `quality`: the progressive-validation quality of the data trained
        since the previous commit (an evstore.quality record, or a callable
        returning one, called under `lock` at the seal), stored in the
        manifest, where a gated server (serving_loader.gate) reads it.
        None: the commit carries none (a gate never holds it back).

        Raises:
          TypeError / ValueError: a malformed quality record (nothing is written).
        """
        return self._save("full", metadata, quality)

    def save_delta(self, metadata=None, quality=None):
        """Writes what changed since the last committed checkpoint of this
        chain: changed rows (values, slots, versions, freqs), newly counted
        filtered keys, deleted keys, and all dense variables. Returns its
        sequence number. `quality`: as for save_full.

        Raises:
          CheckpointError: no full was saved or restored by this manager yet.
          TypeError / ValueError: a malformed quality record (nothing is written).
        """
        return self._save("delta", metadata, quality)

    def _step_value(self, col):
        gs = self._global_step
        if gs is None:
            for opt in col.optimizers:
                gs = opt.iterations
                break
        return 0 if gs is None else int(tf.convert_to_tensor(gs).numpy())

    def _save(self, kind, metadata, quality=None):
        if metadata is not None and not isinstance(metadata, dict) and not callable(metadata):
            raise TypeError(f"metadata must be a dict (JSON-serialisable), got {type(metadata).__name__}")
        if quality is not None and not callable(quality):
            _quality.normalize(quality)   # refused before anything is sealed
        with self._save_lock:
            # A manager refused the root's lease is a second writer: it never
            # writes, even once the holder is gone (its model did not start from
            # the holder's chain), and every save says so, not a later symptom.
            if self._lease_refused is not None:
                raise LeaseHeldError(*self._lease_refused.args)
            if kind == "delta" and self._last is None:
                raise CheckpointError("save_delta() needs a chain to extend: call save_full() or restore() first")
            self._hold_lease()
            sc = scan(self.storage)
            # Never a sequence number a failed save used: its manifest may have
            # become visible (a lost acknowledgement) and been applied by a reader.
            seq = max(sc.max_seq, self._last.seq if self._last else 0, self._burned) + 1
            self._remove_leftovers(sc)
            col = collect(self.model)

            def prepare():
                step = self._step_value(col)
                for ev in col.evs.values():
                    if getattr(ev, "evict_policies", ()):
                        if self.on_evict is None:
                            ev.evict(step)
                        else:
                            _, keys, values = ev.evict(step, return_rows=True)
                            self.on_evict(ev, keys.numpy(), values.numpy())
                meta = metadata() if callable(metadata) else metadata
                q = quality() if callable(quality) else quality
                return step, meta, q

            stats = {}
            try:
                manifest = commit_checkpoint(
                    self.storage, kind, seq, col.evs, dense_fn=lambda: dict(col.dense), prepare=prepare,
                    parent=self._last.seq if self._last else None, base=self._last.base if self._last else None,
                    chunk_rows=self.chunk_rows, lock=self.lock, shard_info=col.shard_info,
                    parent_checksum=self._last.checksum if self._last else None, serving_view=self.serving_view,
                    stats=stats)
            except BaseException:
                self._burned = max(self._burned, seq)
                raise
            self._last = manifest
            self.last_save_stats = stats
            self.history.append(manifest)
            if kind == "full":
                self._apply_retention()
            log.info("committed %s (step %d, %d bytes)", manifest.dir, manifest.global_step, manifest.total_bytes)
            return seq

    def _hold_lease(self):
        """Takes the root's writer lease, or checks it is still held (with
        lease=True). Raises LeaseHeldError (and keeps refusing every later
        save) when another writer holds it, LeaseLostError when it was taken
        over."""
        if self._lease_refused is not None:
            raise LeaseHeldError(*self._lease_refused.args)
        if self._lease_args is None:
            return
        if self._lease is None or not self._lease.held:
            self._lease = process_lease(self.storage, *self._lease_args)
            try:
                self._lease.acquire()
            except LeaseHeldError as e:
                self._lease_refused = e
                raise
        self._lease.check()

    def close(self):
        """Releases this process's writer lease on the root (shared by its managers there); a later save
        takes it again. A process that ends releases it too; a killed one leaves it to be taken over."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _remove_leftovers(self, sc):
        """Directories without a manifest below the next sequence are dead saves (one writer per root)."""
        for seq, dirname in sc.uncommitted.items():
            log.info("removing uncommitted checkpoint directory %s", dirname)
            self.storage.remove_dir(dirname)

    def _apply_retention(self):
        if self.keep_chains is None:
            return
        try:
            sc = scan(self.storage)
            fulls = sorted(q for q, m in sc.manifests.items() if m.kind == "full")
            if len(fulls) <= self.keep_chains:
                return
            oldest_kept = fulls[-self.keep_chains]
            doomed = sorted((q for q, m in sc.manifests.items() if m.base < oldest_kept), reverse=True)
            doomed += sorted(q for q in list(sc.corrupt) + list(sc.uncommitted) if q < oldest_kept)
            for q in doomed:
                m = sc.manifests.get(q)
                dirname = m.dir if m else self.storage.list_dirs()[q][1]
                self.storage.remove_manifest(dirname)  # readers stop seeing it first
                self.storage.remove_dir(dirname)
        except Exception:  # noqa: BLE001 - retention is best effort; the save is committed
            log.exception("checkpoint retention failed (the new checkpoint is committed)")

    # ---- restoring -------------------------------------------------------------
    def restore(self, seq=None, verify=True, drop_unused_slots=False):
        """Restores the newest chain (or the chain ending at `seq`) into the model.

        Applies the full then every delta in order: EV rows, slots, versions,
        frequencies, filtered counts and last-seen steps, the EVs' clocks and
        Bloom counters, dense variables and the global step, bit for bit.

        Stage, check, publish: a refused restore changes nothing in the model.
        Checked before anything is loaded: every manifest against its schema
        and checksum, every bundle index against its manifest (size and
        crc32c), every file's size, every tensor the load reads (name, dtype,
        shape, row count), the model's compatibility. The files are opened
        privately (a local root's hard-linked; an object store's read through
        an object source, nothing written locally). Then every EV's rows
        stream into a staging table of its own (evstore/staging.py: on the
        EV's task, nothing reads it; a tiered EV's is tiered, in a tier
        directory of its own), each tensor's crc32c checked as it loads, each
        byte read once; only when every EV of every task loaded does each EV
        adopt its staging table (one swap each; the replaced table is
        dropped), and a failure drops them all. While it loads, a process
        holds its tables and their staging tables (a rollback of a running
        process: a second copy of every restored table, for a tiered EV a
        second DRAM cache and tier file, whose disk room is checked first;
        a fresh process's tables are empty);
        no training step may run on the model meanwhile (steps under `lock`
        wait for it). A part of another shard count is loaded once into the
        shards of one process that share a device and table kind, each key to
        its shard. Read more than once: a part loaded into shards of one
        process on several devices (or of both table kinds), once per place
        (on an object store, beyond what fits EVSTORE_SOURCE_KEEP_MIB, 512 MiB
        per process, where it is read once and kept). `verify=False` skips the checks before the load
        (the loader still checks each tensor's crc32c). Eager only: an EV
        built in a graph (tf.compat.v1) is refused (ValueError).
        A checkpoint removed by a concurrent writer's retention while this
        restore reads it is retried with a fresh scan (up to 3 times).

        Optimizer slots: when the model has evstore optimizers, a checkpoint
        whose EVs hold slots none of them uses (an Adam checkpoint restored into
        an SGD model) is refused with a ValueError naming them, unless
        `drop_unused_slots=True`, which loads only the slots the model's
        optimizers use. Slots the checkpoint lacks start from their initial
        values at the first update. Without an optimizer every slot is loaded.
        A loaded slot's initial value (where it starts in keys admitted later)
        comes from the checkpoint; a checkpoint written before those were saved
        lacks it, and the model's optimizers declare it instead
        (`ev_slot_initial_values()`; a generic-path Keras optimizer's once
        built), so keys admitted before the first update start from it.

        Returns the caller metadata saved with the restored checkpoint (e.g.
        the input position).

        Raises:
          NoCheckpointError: nothing committed (at or before `seq`).
          ChainError: a delta of the chain is missing or names a wrong parent.
          CorruptCheckpointError: a manifest or file is missing, truncated,
            corrupt or does not match the schema.
          ValueError: the checkpoint does not match the model (EV names, dims,
            key dtypes, optimizer slots, dense variable names or shapes), or
            an EV was built in a graph.
          evstore.storage.TierSpaceError: the tier directory of a tiered EV (on its task) lacks the
            free space the staging table's tier file needs for the full's rows beyond its DRAM budget
            (an OSError, ENOSPC; evstore/staging.py, "Disk"), found before anything is read.
        """
        with self._save_lock, self.lock:
            for attempt in range(WITHDRAWN_RESCANS):
                sc = scan(self.storage)
                chain = resolve_chain(sc, seq, where=self.root)
                col = collect(self.model)
                self._check_compatible(chain, col)
                self._slot_filter = slots_to_load(chain, col.optimizers, drop_unused_slots, self.root)
                groups = device_groups(col.evs)
                # A tiered staging table's tier file must fit its disk beside the live one's: refused here,
                # before anything is read, when the full's rows alone cannot (evstore/staging.py, "Disk").
                check_room(self._staging_loads(chain[0], col, list(col.evs)),
                           what=f"the restore of {self.storage.display(chain[-1].dir)}")
                # Shards on other tasks of a root that is not one local filesystem:
                # each task opens a source over the files it loads (checkpoint/remote_parts.py).
                remote = {} if self.storage.local else {t: names for t, names in groups.items() if t}
                # Every EV loads into a staging table nobody reads, its files checked as they load (each
                # byte read once; fetch's verify="index"), and adopts it once all loaded.
                check = "index" if verify else False
                fetched, broken, on_tasks, tables, loaded, read = [], None, {}, {}, {}, 0
                try:
                    try:   # the main bundle of each, opened privately and checked (checkpoint/fetch.py)
                        indexes = ([read_index(self.storage, m) for m in chain] if not self.storage.local
                                   else [None] * len(chain))
                        read += sum(len(i) for i in indexes if i is not None)
                        for m, idx in zip(chain, indexes):
                            files, again = None, ()
                            if idx is not None:   # only what this process loads
                                here = self._plan_entries(m, col, groups.get("", []))
                                files = bundle_subset(m, idx, entry_tensors(m, idx, here)
                                                      + list(col.dense) + [GLOBAL_STEP])
                                # a part loaded into several shards here (a changed shard count) is kept in memory
                                again = reread_files(m, idx, self._loads(m, col, groups.get("", [])))
                            fetched.append(fetch(self.storage, m, verify=check, files=files, index=idx, reread=again))
                        if remote:
                            on_tasks = stage_on_tasks(self.storage, chain, indexes, {
                                t: [self._plan_entries(m, col, names) for m in chain] for t, names in remote.items()},
                                verify=check, reread={t: [reread_files(m, idx, self._loads(m, col, names))
                                                          for m, idx in zip(chain, indexes)]
                                                      for t, names in remote.items()})
                        staged = [f.dir for f in fetched]
                        task_of = {n: t for t, names in remote.items() for n in names}
                        dirs_of = {n: on_tasks[task_of[n]] if n in task_of else staged for n in col.evs}
                        values, initial_values_held = self._check_staged(chain, staged, col)
                        loaded = self._load_staging(chain, dirs_of, col, tables)   # any failure drops them all
                    except (CorruptCheckpointError, tf.errors.OpError) as e:
                        broken = e
                    gone = withdrawn(self.storage, chain)
                    if gone:   # retention (manifest first, then files) removed a checkpoint meanwhile
                        if attempt < WITHDRAWN_RESCANS - 1:
                            log.warning("checkpoints %s were removed while staging them; rescanning", gone)
                            continue
                        raise ChainError(f"cannot restore from {self.root}: checkpoints {gone} were removed while "
                                         "this restore read them (a writer's retention); retry")
                    if isinstance(broken, tf.errors.OpError):   # a load into the staging tables failed
                        broken = damaged(broken, self._source_names(chain, fetched, on_tasks))
                    if broken is not None:
                        if isinstance(broken, CorruptCheckpointError):
                            raise CorruptCheckpointError(f"cannot restore: {broken}") from None
                        raise broken
                    # Publish: everything was checked; from here on the model changes.
                    for name, ev in col.evs.items():
                        adopt(ev, tables.pop(name))
                        # A slot's initial value is in the checkpoint beside it. One written before that
                        # lacks it: the model's optimizer states it now, before a training lookup admits keys.
                        unknown = loaded[name] - initial_values_held.get(name, set())
                        inits = slot_initial_values(col.optimizers, ev) if unknown else {}
                        if unknown & set(inits):
                            ev.set_slot_initial_values({s: inits[s] for s in unknown if s in inits})
                    for name, v in col.dense.items():
                        v.assign(values[name])
                    if self._global_step is not None:
                        self._global_step.assign(values[GLOBAL_STEP])
                finally:
                    for t in tables.values():
                        t.close()
                    for f in fetched:
                        f.close()
                    read += sum(f.bytes_read for f in fetched) + release_on_tasks(on_tasks)
                # Bytes this restore read from the root, this process's and each task's (docs/ARCHITECTURE.md,
                # "Restoring: each byte read once").
                self.last_restore_stats = {"bytes_read": read}
                last = chain[-1]
                self._last = last
                log.info("restored %s (chain of %d, step %d)", last.dir, len(chain), last.global_step)
                return dict(last.metadata)

    @staticmethod
    def _units(m, col, names):
        """The loads of checkpoint `m` into EVs `names` (shards.load_units: a part of another shard count
        once into the shards of one place)."""
        return load_units(m, names, col.shard_info, lambda n: place(col.evs[n]))

    @classmethod
    def _loads(cls, m, col, names):
        """The entry of checkpoint `m` each load into EVs `names` reads, one per load."""
        return [src for src, _, _ in cls._units(m, col, names)]

    @classmethod
    def _plan_entries(cls, m, col, names):
        """The entries of checkpoint `m` that EVs `names` load."""
        return sorted(set(cls._loads(m, col, names)))

    def _load_staging(self, chain, dirs_of, col, tables):
        """Loads the chain into a staging table per EV (into `tables`, {EV name: StagingTable}, which the
        caller closes); returns {EV name: slots loaded}. Raises the loader's tf.errors.OpError."""
        for name, ev in col.evs.items():
            tables[name] = StagingTable(ev)
        loaded = {name: set() for name in col.evs}
        started = set()
        for i, m in enumerate(chain):
            for src, targets, n in self._units(m, col, list(col.evs)):
                slots = [s for s in m.evs[src]["slots"] if self._slot_filter is None or s in self._slot_filter]
                names = [t for t, _ in targets]
                d, clear = dirs_of[names[0]][i], names[0] not in started   # one place: one directory
                if len(targets) == 1:
                    load_ev(d, tables[names[0]], src, slots, clear=clear, chunk_rows=self.chunk_rows,
                            shard_index=targets[0][1], num_shards=n)
                else:   # the part read once, each key to its shard
                    load_ev_routed(d, [tables[t] for t in names], src, slots, clear, [j for _, j in targets], n,
                                   chunk_rows=self.chunk_rows)
                for t in names:
                    loaded[t].update(slots)
                started.update(names)
        # A chain holding nothing for an EV (a new shard count with no rows) leaves its table empty.
        return loaded

    def _staging_loads(self, full, col, names):
        """[(EV, rows, slot names)]: what the chain's full brings into the staging table of each EV `names`
        (staging.check_room); a part of another shard count brings its even share."""
        out = []
        for name in names:
            rows, slots = 0, set()
            for src, _, n in load_plan(full, name, col.shard_info.get(name)):
                rows += full.evs[src]["rows"] // n
                slots.update(s for s in full.evs[src]["slots"] if self._slot_filter is None or s in self._slot_filter)
            out.append((col.evs[name], rows, slots))
        return out

    def _source_names(self, chain, fetched, on_tasks):
        """{object source directory: the root's display of its checkpoint directory}, for error messages."""
        out = {f.dir: self.storage.display(m.dir) for m, f in zip(chain, fetched)}
        for dirs in on_tasks.values():
            out.update({d: self.storage.display(m.dir) for m, d in zip(chain, dirs)})
        return out

    def _check_staged(self, chain, staged, col):
        """The check step of restore after the files' (fetch): tensors, shapes. Returns the dense values to
        assign and {EV name: slots whose initial value a loaded bundle holds}."""
        held_by = {}
        for m, d in zip(chain, staged):
            where = self.storage.display(m.dir, BUNDLE_PREFIX + ".index")
            try:
                shapes, dtypes = bundle_signature(d)
            except (tf.errors.OpError, ValueError) as e:
                raise CorruptCheckpointError(f"{where}: cannot read the bundle index ({e})") from None
            for name, ev in col.evs.items():
                for src, _, _ in load_plan(m, name, col.shard_info.get(name)):
                    held = _check_ev_tensors(where, m, src, ev, shapes, dtypes)
                    held_by.setdefault(name, set()).update(held)
        values = read_dense(staged[-1], list(col.dense) + [GLOBAL_STEP])
        for name, v in col.dense.items():
            if list(values[name].shape) != list(v.shape):
                raise CorruptCheckpointError(f"{self.storage.display(chain[-1].dir)}: tensor {name!r} has shape "
                                             f"{list(values[name].shape)}, the model's variable {list(v.shape)}")
        return values, held_by

    def _check_compatible(self, chain, col):
        for name, ev in col.evs.items():
            if not can_stage(ev):
                raise ValueError(f"EmbeddingVariable {name!r} was built in a graph: restore() loads eagerly, into "
                                 "a staging table made like it; restore a graph's EVs with tf.compat.v1.train.Saver")
        full, last = chain[0], chain[-1]
        saved = {}
        for name, e in full.evs.items():
            saved.setdefault(logical_name(name, e), e)
        for name, ev in col.logical_evs().items():
            info = saved.get(name)
            if info is None:
                raise ValueError(f"EmbeddingVariable {name!r} is not in checkpoint {full.dir} of {self.root} "
                                 f"(it holds {sorted(saved)})")
            if info["dim"] != ev.dim or info["key_dtype"] != ev.key_dtype.name:
                raise ValueError(f"EmbeddingVariable {name!r} has dim {ev.dim} / {ev.key_dtype.name} keys, but "
                                 f"checkpoint {full.dir} holds dim {info['dim']} / {info['key_dtype']}")
        extra = sorted(set(saved) - set(col.logical_evs()))
        if extra:
            raise ValueError(f"checkpoint {full.dir} of {self.root} holds EmbeddingVariables {extra} that the model "
                             "lacks; restore into a model that has them")
        for name, v in col.dense.items():
            info = last.dense.get(name)
            if info is None:
                raise ValueError(f"variable {name!r} is not in checkpoint {last.dir} of {self.root}")
            if list(info["shape"]) != list(v.shape):
                raise ValueError(f"variable {name!r} has shape {list(v.shape)}, checkpoint {last.dir} holds "
                                 f"{info['shape']}")

    # ---- schedules -------------------------------------------------------------
    def start(self, delta_every=60.0, full_every=None, metadata=None, quality=None):
        """Saves on a schedule (apscheduler, background thread) while training goes on.

        Args:
          delta_every: seconds between deltas (> 0).
          full_every: seconds between fulls (None: only the first save is a full).
          metadata: a callable returning the caller metadata of each save
            (called under `manager.lock`, e.g. the input position).
          quality: a callable returning each save's quality record (called
            under `manager.lock`; see save_full), or None.
        A failed scheduled save is logged and counted (`failures`,
        `last_error`); its changes go into the next save.
        """
        for nm, v in (("delta_every", delta_every), ("full_every", full_every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{nm} must be a positive number of seconds, got {v!r}")
        if metadata is not None and not callable(metadata):
            raise TypeError("metadata must be a callable returning a dict")
        if quality is not None and not callable(quality):
            raise TypeError("quality must be a callable returning a quality record (evstore.quality)")
        if self._sched is not None:
            raise RuntimeError("this CheckpointManager's schedule is already running; stop() it first")
        from checkpoint.schedule import background_scheduler
        self._metadata_fn = metadata
        self._quality_fn = quality
        self._sched = background_scheduler("checkpoint")
        self._sched.add_job(self._scheduled, "interval", seconds=delta_every, args=["delta"], id="delta",
                            max_instances=1, coalesce=True)
        if full_every is not None:
            self._sched.add_job(self._scheduled, "interval", seconds=full_every, args=["full"], id="full",
                                max_instances=1, coalesce=True)
        self._sched.start()

    def _scheduled(self, kind):
        try:
            if kind == "delta" and self._last is None:
                kind = "full"
            self._save(kind, self._metadata_fn, self._quality_fn)
        except Exception as e:  # noqa: BLE001 - a scheduler thread must not die
            self.failures += 1
            self.last_error = e
            log.exception("scheduled %s checkpoint failed; the next save carries its changes", kind)

    def stop(self, final_delta=True):
        """Stops the schedule (waiting for a running save) and, by default,
        commits a final delta so nothing trained is lost. Returns its seq or None."""
        if self._sched is not None:
            self._sched.shutdown(wait=True)
            self._sched = None
        if final_delta:
            return self._save("delta" if self._last is not None else "full", self._metadata_fn, self._quality_fn)
        return None


def _check_ev_tensors(where, m, src, ev, shapes, dtypes):
    """Every tensor EvLoadBundle reads for entry `src` of checkpoint `m` is in
    the bundle with the dtype, shape and row count the manifest and `ev` expect.
    Returns the slots whose initial value the bundle holds (older ones hold none)."""
    info = m.evs[src]
    kd, n = ev.key_dtype, info["rows"]
    t, nf = schema.tensor, info["filtered"]
    want = {t(src, schema.KEYS): (kd, [n]), t(src, schema.VALUES): (tf.float32, [n, ev.dim]),
            t(src, schema.VERSIONS): (tf.int64, [n]), t(src, schema.FREQS): (tf.int64, [n]),
            t(src, schema.KEYS_FILTERED): (kd, [nf]), t(src, schema.FREQS_FILTERED): (tf.int64, [nf])}
    held = set()
    for slot in info["slots"]:
        want[schema.slot_tensor(src, slot)] = (tf.float32, [n, ev.dim])
        if schema.slot_initial_value_tensor(src, slot) in shapes:   # absent in older checkpoints
            want[schema.slot_initial_value_tensor(src, slot)] = (tf.float32, [1])
            held.add(slot)
    if m.kind == "delta":
        want[t(src, schema.DELETED_KEYS)] = (kd, [info["deleted"]])
    for name, (dtype, shape) in want.items():
        if name not in shapes:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is missing (the manifest and the bundle disagree)")
        if dtypes[name] != dtype or list(shapes[name]) != shape:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is {dtypes[name].name} {list(shapes[name])}, "
                                         f"expected {dtype.name} {shape} (the manifest and the bundle disagree)")
    return held
