"""Checkpoints of synchronous training (evstore/collective.py): every worker
saves its own shards into the same chain.

One save, called by every worker at the same point of its program (after
the same step), in order:
  1. worker 0 (the chief) takes (or checks) the root's writer lease for the
     whole job (checkpoint/lease.py: one writer per root), removes dead saves
     and picks the sequence number; an all-gather gives every worker the
     number and the lease's outcome (a refused or lost lease fails the save on
     every worker, nothing written) and is the barrier that keeps a worker
     from writing before the chief cleaned up;
  2. each worker, under its manager's lock: eviction at the global step, seal
     of its shards' dirty and deleted sets, its part bundle `ckpt_part<rank>`
     streamed into the checkpoint directory (the chief's part also holds the
     dense variables, which are mirrored, and the global step), and a small
     `part<rank>.json` listing its files, counts and shard entries;
  3. an all-gather of every worker's outcome: the chief, when every part was
     written, joins the parts into one `ckpt` bundle (MergeV2Checkpoints, as
     the parameter-server save does), checks it and writes MANIFEST.json: one
     manifest naming every shard (`<ev>/part_<r>`, "shard": {index r, count W});
     A commit's quality (evstore.quality) is measured by the chief over
     every worker's scored examples (`quality=` is each worker's
     `evstore.quality.Scored`, carried in its part report): AUC is not an
     average of the workers' AUCs; or the sum of the workers' quality
     histograms (each worker's record with `hist`, e.g. from a Keras metric);
  4. an all-gather of the commit outcome: each worker commits its snapshots
     when the manifest is written, and aborts them otherwise (their changes
     go into the next save).
A worker that dies fails the collectives of the others (the save raises, its
directory stays without a manifest and the next save removes it); a kill
after the manifest leaves a committed checkpoint.

The root: a local path every worker sees (local workers, a shared
filesystem): the parts go into the checkpoint directory and are merged there.
Any other root (an object store, the only storage the workers share): each
worker streams its part into the root through an object sink
(checkpoint/object_sink.py: no byte on the worker's disk), the all-gather of
step 3 also tells every worker how many data files each part has, and each
worker renames its data files to their names in the merged bundle
(checkpoint/remote_parts.py) and uploads its part index and its report from
memory; after an all-gather of the uploads the chief merges the part
indexes, checks every object in the root and writes the manifest.

Restores need no coordination: each worker reads the chain and keeps the keys
its shard owns (checkpoint/shards.py), so a chain saved by W workers restores
into any number of workers, into a ShardedEmbeddingVariable or into one EV.
"""
import json
import logging
import os
import time

import tensorflow as tf

from checkpoint import _failpoints
from checkpoint.bundle import GLOBAL_STEP, merge_parts, write_bundle
from checkpoint.chain import scan
from checkpoint.collect import collect
from checkpoint.commit import _check_listed, abort_snapshots
from checkpoint.index import data_file, parse_index
from checkpoint.errors import CheckpointError
from checkpoint.lease import LeaseHeldError, LeaseLostError
from checkpoint.manager import CheckpointManager
from checkpoint.manifest import BUNDLE_PREFIX, Manifest, dir_name
from checkpoint.remote_parts import check_uploaded, crc32c_bytes, merge_indexes
from checkpoint.object_sink import read, sink_of
from evstore import quality as _quality
from evstore.collective import all_gather_ints

__all__ = ["SyncCheckpointManager"]

log = logging.getLogger("evstore.checkpoint")


class SyncCheckpointManager(CheckpointManager):
    """A CheckpointManager for synchronous training on `num_workers` workers.

    Every worker creates one over the same `root` and calls `save_full` /
    `save_delta` at the same step (the calls are collective); `restore` is
    per worker. Arguments are CheckpointManager's, plus:
      rank, num_workers: this worker's index and the number of workers
        (default: those of the model's CollectiveEmbeddingVariables).
      lease, lease_timeout, take_over: CheckpointManager's; the chief holds
        the root's lease for the whole job.

    `save_full` / `save_delta` take `quality=` as this worker's scored
    examples since the previous commit: an `evstore.quality.Scored`, or a
    callable returning one (called under the manager's lock). The chief
    measures the commit's quality record over every worker's part; every
    worker passes one, or none does. Instead of scored examples every worker
    may pass its own quality record with `hist` (evstore.quality.from_hist,
    e.g. a Keras metric's histograms): the chief adds the histograms
    (evstore.quality.merge), so the commit's record covers every worker's
    examples.

    Raises:
      ValueError: rank / num_workers that
        disagree with the model's tables; (saves) a quality record without
        `hist` instead of `Scored`: it cannot be added to the other
        workers' records.
      RuntimeError (start): scheduled saves, which cannot be collective.
    """

    def __init__(self, root, model, global_step=None, keep_chains=3, storage_options=None, chunk_rows=65536,
                 rank=None, num_workers=None, lease=True, lease_timeout=60.0, take_over=False):
        super().__init__(root, model, global_step, keep_chains, storage_options, chunk_rows, lease=lease,
                         lease_timeout=lease_timeout, take_over=take_over)
        tables = list(collect(model).sharded.values())
        known = {(t.rank, t.num_workers) for t in tables if hasattr(t, "rank")}
        if len(known) > 1:
            raise ValueError(f"the model's tables disagree on this worker's rank / worker count: {sorted(known)}")
        r, w = known.pop() if known else (0, 1)
        self.rank = r if rank is None else int(rank)
        self.num_workers = w if num_workers is None else int(num_workers)
        if known and (self.rank, self.num_workers) != (r, w):
            raise ValueError(f"rank / num_workers {self.rank}/{self.num_workers} disagree with the model's "
                             f"tables ({r}/{w})")

    def start(self, *args, **kwargs):
        raise RuntimeError("a synchronous checkpoint is collective: call save_full / save_delta on every worker "
                           "after the same step (scheduled saves would not line up)")

    def _gather(self, values):
        return all_gather_ints(values, self.num_workers)

    def _save(self, kind, metadata, quality=None):
        if metadata is not None and not isinstance(metadata, dict) and not callable(metadata):
            raise TypeError(f"metadata must be a dict (JSON-serialisable), got {type(metadata).__name__}")
        if quality is not None and not callable(quality):
            _worker_quality(quality)
        with self._save_lock:
            seq, leased, refusal = 0, 1, None
            if self.rank == 0:
                try:
                    self._hold_lease()
                except (LeaseHeldError, LeaseLostError) as e:
                    leased, refusal = 0, e
                else:
                    sc = scan(self.storage)
                    seq = max(sc.max_seq, self._last.seq if self._last else 0) + 1
                    self._remove_leftovers(sc)
            has_chain = int(kind == "full" or self._last is not None)
            agreed = self._gather([seq, has_chain, leased])
            if refusal is not None:
                raise refusal
            if not agreed[:, 2].all():
                raise LeaseHeldError(f"{self.storage.url}: the chief (worker 0) does not hold the root's writer "
                                     "lease (another job writes there, or took it over); nothing is written")
            seq = int(agreed[:, 0].max())
            if not agreed[:, 1].all():
                raise CheckpointError("save_delta() needs a chain to extend on every worker: call save_full() or "
                                      "restore() first")
            manifest = self._commit(kind, seq, collect(self.model), metadata, quality)
            self._last = manifest
            if kind == "full" and self.rank == 0:
                self._apply_retention()
            log.info("worker %d committed %s (step %d)", self.rank, manifest.dir, manifest.global_step)
            return seq

    def _commit(self, kind, seq, col, metadata, quality=None):
        dirname = dir_name(kind, seq)
        # A local root: every part straight into the checkpoint directory. Any
        # other: streamed into the root through an object sink.
        directory = self.storage.join(dirname) if self.storage.local else self.storage.staging_dir(dirname)
        evs = col.evs
        sids, wrote, committed = {}, False, False
        try:
            try:
                with self.lock:
                    step = self._step_value(col)
                    meta = metadata() if callable(metadata) else metadata
                    scored = _worker_quality(quality() if callable(quality) else quality)
                    for ev in evs.values():
                        if getattr(ev, "evict_policies", ()):
                            ev.evict(step)
                    for name, ev in evs.items():
                        sids[name] = int(ev.begin_export(return_keys=False)[0])
                    dense = {}
                    if self.rank == 0:
                        dense = {n: tf.convert_to_tensor(v) for n, v in col.dense.items()}
                        if GLOBAL_STEP in dense:
                            raise ValueError(f"a dense tensor may not be named {GLOBAL_STEP!r}")
                        dense[GLOBAL_STEP] = tf.constant(int(step), tf.int64)
                    if self.storage.local:
                        self.storage.makedirs(directory)
                    _failpoints.hit("before-bundle")
                    files, counts = write_bundle(directory, evs, sids, dense, full=(kind == "full"),
                                                 chunk_rows=self.chunk_rows, prefix=_part(self.rank))
                report = {"files": files, "counts": counts, "step": int(step), "meta": meta or {},
                          # floats as JSON round-trip exactly (repr)
                          "scored": ([scored.labels.tolist(), scored.scores.tolist()]
                                     if isinstance(scored, _quality.Scored) else None),
                          "record": None if isinstance(scored, _quality.Scored) else scored,
                          "evs": {n: {"dim": ev.dim, "key_dtype": ev.key_dtype.name,
                                      **({"shard": col.shard_info[n]} if n in col.shard_info else {})}
                                  for n, ev in evs.items()}}
                if self.storage.local:
                    _write_json(os.path.join(directory, f"part{self.rank}.json"), report)
                else:
                    sink_of(directory).memory[f"part{self.rank}.json"] = json.dumps(report).encode()
                wrote = True
            finally:
                # also when this worker failed: the others must not hang
                everyone = self._gather([int(wrote), len(_data_files(files)) if wrote else 0])
            if not everyone[:, 0].all():
                raise CheckpointError(f"checkpoint {dirname}: workers {[i for i, ok in enumerate(everyone[:, 0]) if not ok]} "
                                      "failed to write their parts; nothing is committed")
            if not self.storage.local:
                self._upload_part(dirname, directory, files, [int(n) for n in everyone[:, 1]])
            manifest = None
            try:
                if self.rank == 0:
                    manifest = (self._join(kind, seq, dirname, directory) if self.storage.local
                                else self._join_remote(kind, seq, dirname, directory))
                committed = True
            finally:
                decided = self._gather([int(committed)])
            if not decided.all():
                raise CheckpointError(f"checkpoint {dirname}: the chief could not commit it")
            if manifest is None:
                manifest = self.storage.read_manifest(dirname)
        except BaseException:
            abort_snapshots(evs, sids)
            if self.rank == 0 and not committed:
                self.storage.remove_manifest(dirname)
                self.storage.remove_dir(dirname)
            raise
        finally:
            if not self.storage.local:
                self.storage.discard_staging(directory)
        for name, sid in sids.items():
            evs[name].commit_export(sid)
        return manifest

    def _upload_part(self, dirname, directory, files, data_counts):
        """Object-store root: this worker uploads its data files under the names
        the merged bundle gives them (remote_parts.merge_indexes: worker r's
        file s is `ckpt.data-<files of workers before r + s>-of-<all files>`),
        and its part index and report for the chief to merge; then an
        all-gather of every worker's outcome."""
        ok = False
        try:
            offset, total = sum(data_counts[:self.rank]), sum(data_counts)
            mine = _data_files(files)
            sink = sink_of(directory)
            self.storage.makedirs(self.storage.join(dirname))
            _failpoints.hit("before-upload")
            sink.publish({f: data_file(BUNDLE_PREFIX, offset + s, total) for s, f in enumerate(mine)})
            for n in (_part(self.rank) + ".index", f"part{self.rank}.json"):
                self.storage.fs.pipe_file(self.storage.join(dirname, n), sink.memory[n])
            ok = True
        finally:
            everyone = self._gather([int(ok)])
        if not everyone.all():
            raise CheckpointError(f"checkpoint {dirname}: workers {[i for i, v in enumerate(everyone[:, 0]) if not v]} "
                                  "failed to upload their parts; nothing is committed")

    def _join_remote(self, kind, seq, dirname, directory):
        """Chief, object-store root: merges the part indexes into the commit's
        `ckpt.index` (the data files are already in place under their merged
        names), checks every object's size, and writes the manifest."""
        reports, indexes = [], []
        for r in range(self.num_workers):
            index, report = (self.storage.fs.cat_file(self.storage.join(dirname, n))
                             for n in (_part(r) + ".index", f"part{r}.json"))
            reports.append(json.loads(report))
            indexes.append(index)
        index, renames = merge_indexes(indexes, [_part(r) for r in range(self.num_workers)],
                                       self.storage.display(dirname))
        files, counts = {}, {}
        for rep, names in zip(reports, renames):
            counts.update(rep["counts"])
            files.update({merged: rep["files"][local] for local, merged in names.items()})
        self.storage.fs.pipe_file(self.storage.join(dirname, BUNDLE_PREFIX + ".index"), index)
        files[BUNDLE_PREFIX + ".index"] = {"size": len(index), "crc32c": crc32c_bytes(index)}
        for r in range(self.num_workers):
            for n in (_part(r) + ".index", f"part{r}.json"):
                self.storage.fs.rm_file(self.storage.join(dirname, n))
        check_uploaded(self.storage, dirname, files)
        return self._manifest(kind, seq, dirname, index, files, counts, reports)

    def _join(self, kind, seq, dirname, directory):
        """Chief: the parts into one bundle, checked, and the manifest (the commit point)."""
        reports = []
        for r in range(self.num_workers):
            with open(os.path.join(directory, f"part{r}.json")) as f:
                reports.append(json.load(f))
        files, counts = merge_parts(directory, [_part(r) for r in range(self.num_workers)],
                                    [(rep["files"], rep["counts"]) for rep in reports])
        for r in range(self.num_workers):
            os.remove(os.path.join(directory, f"part{r}.json"))
        for name, f in files.items():
            size = os.path.getsize(os.path.join(directory, name))
            if size != f["size"]:
                raise CheckpointError(f"{os.path.join(directory, name)}: wrote {f['size']} bytes, found {size}")
        return self._manifest(kind, seq, dirname, read(directory, BUNDLE_PREFIX + ".index"), files, counts, reports)

    def _manifest(self, kind, seq, dirname, index, files, counts, reports):
        """Chief: checks the merged index (bytes) and writes the manifest (the commit point)."""
        evs = {}
        for rep in reports:
            for n, info in rep["evs"].items():
                evs[n] = {"dim": info["dim"], "key_dtype": info["key_dtype"], **counts[n],
                          **({"shard": info["shard"]} if "shard" in info else {})}
        names = list(collect(self.model).dense) + [GLOBAL_STEP]
        _check_listed(index, self.storage.display(dirname), list(evs), names)
        _, listed = parse_index(index, self.storage.display(dirname, BUNDLE_PREFIX + ".index"))
        dense = {n: {"dtype": tf.as_dtype(listed[n].dtype).name, "shape": list(listed[n].shape)} for n in names}
        chief = reports[0]
        parts = [rep["scored"] for rep in reports]
        records = [rep.get("record") for rep in reports]
        for given, what in ((parts, "scored examples"), (records, "a quality record with `hist`")):
            if any(p is None for p in given) and not all(p is None for p in given):
                raise CheckpointError(f"checkpoint {dirname}: workers {[r for r, p in enumerate(given) if p is None]} "
                                      f"gave no {what} while the others did; every worker passes the same kind of "
                                      "quality=, or none does")
        if parts[0] is not None:
            quality = _quality.Scored.concat(_quality.Scored.of(*p) for p in parts).measure()
        else:   # histograms add up: the record of every worker's examples together
            quality = None if records[0] is None else _quality.merge(records)
        manifest = Manifest(
            seq=seq, kind=kind, parent=None if kind == "full" else self._last.seq,
            base=seq if kind == "full" else self._last.base, global_step=chief["step"], wall_time=time.time(),
            files=files, evs=evs, dense=dense, metadata=dict(chief["meta"]), quality=quality,
            deleted_complete=True)   # each shard is a native table: re-inserted keys stay in its deleted set
        manifest.to_json()
        _failpoints.hit("before-manifest")
        self.storage.write_manifest(dirname, manifest)
        _failpoints.hit("after-manifest")
        return manifest


def _worker_quality(q):
    """A worker's `quality=` checked: None, its evstore.quality.Scored, or its
    quality record with `hist` (normalized; the chief merges the workers'
    records by adding their histograms)."""
    if q is None or isinstance(q, _quality.Scored):
        return q
    if hasattr(q, "keys") and q.get("hist") is not None:
        return _quality.normalize(q)
    raise ValueError("a synchronous commit's quality covers every worker's examples: pass this worker's "
                     "evstore.quality.Scored (or a callable returning it), or its quality record with `hist` "
                     f"(histograms add up across workers), got {type(q).__name__}"
                     + (" without `hist`" if hasattr(q, "keys") and q.get("hist") is None else ""))


def _part(rank):
    return f"ckpt_part{rank}"


def _data_files(files):
    """The data files of a part's `files`, in shard order."""
    return sorted(f for f in files if ".data-" in f)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
