"""The commit protocol (docs/ARCHITECTURE.md, "Checkpoints" and "Reliability"), in one place: used by
CheckpointManager saves and by `tools.write_full` (compact).

  1. under `lock`: `prepare()` (the caller's eviction, step and metadata),
     seal each EV's dirty and deleted sets into a snapshot, read the dense
     tensors, stream the bundle (and the serving view, encoded from the same
     chunks) into the checkpoint directory (local roots, fsyncing every
     file) or into the root through an object sink (remote roots: no local
     staging, checkpoint/object_sink.py);
  2. check the files' sizes and that the index lists every tensor; put the
     files in place (remote roots: renamed from their temporary keys);
  3. the commit point: MANIFEST.json written atomically, last;
  4. only then each EV commits its snapshot.
Any failure in 1-3 aborts the snapshots (the next save carries every change)
and removes the directory; a kill leaves at worst a directory without a
manifest, which readers ignore.
"""
import contextlib
import logging
import os
import time

import tensorflow as tf

from checkpoint import _failpoints
from checkpoint.bundle import GLOBAL_STEP, write_bundle, write_bundles
from checkpoint.errors import CheckpointError
from checkpoint.index import parse_index
from checkpoint.manifest import BUNDLE_PREFIX, MANIFEST, Manifest, dir_name
from checkpoint.object_sink import is_sink, read, sink_of
from checkpoint.remote_parts import discard_parts, publish_parts, write_parts
from checkpoint.serving_view import VIEW_PREFIX
from checkpoint.shards import device_groups
from evstore import quality as _quality
from evstore import schema

__all__ = ["commit_checkpoint"]

log = logging.getLogger("evstore.checkpoint")
_EV_TENSORS = schema.EV_TENSORS


def commit_checkpoint(storage, kind, seq, evs, dense_fn, prepare, parent=None, base=None, chunk_rows=65536,
                      lock=None, shard_info=None, parent_checksum=None, serving_view=None, stats=None):
    """Writes and commits checkpoint `seq` of `kind` ("full" / "delta"); returns its Manifest.

    Args:
      evs: {checkpoint name: EmbeddingVariable}.
      dense_fn: () -> {name: tensor-like}, read under `lock` after the seal.
      prepare: () -> (global_step, metadata dict, quality record or None), run
        under `lock` first (quality: evstore.quality, checked by normalize).
      parent, base: the delta's parent and base (a full is its own base).
      parent_checksum: the parent manifest's checksum (its content identity).
      lock: held for step 1 (a training loop holding it gets exact snapshots).
      shard_info: {name: shard entry} for the shards of sharded EVs (manifest
        "shard"; see checkpoint/shards.py). EVs on other tasks write their
        own bundle parts: into the directory itself on a local root (which
        every task must see), or on their own hosts, each uploading its
        own data files, on any other root (checkpoint/remote_parts.py).
      serving_view: None, or the dtype of a serving view written into the
        same commit (checkpoint/serving_view.py): the rows are encoded as
        they stream, in the same pass as the bundle (on an object-store root
        with EVs on other tasks, each task's part with its own view, merged
        into one `serving` bundle as the parts are).
      stats: None, or a dict that receives "bytes_sent_here": the bytes
        this process sent to the root (the rest were sent by their tasks).
    """
    shard_info = shard_info or {}
    groups = device_groups(evs)
    # EVs on other tasks with a root that is not one local filesystem: each
    # task uploads its own part (checkpoint/remote_parts.py).
    distributed = not storage.local and bool(set(groups) - {""})
    dirname = dir_name(kind, seq)
    sids, staging, manifest_sent, parts = {}, None, False, []
    try:
        with lock if lock is not None else contextlib.nullcontext():
            step, meta, quality = prepare()
            quality = None if quality is None else _quality.normalize(quality)
            for name, ev in evs.items():
                sids[name] = int(ev.begin_export(return_keys=False)[0])
            dense = {n: tf.convert_to_tensor(v) for n, v in dense_fn().items()}
            if GLOBAL_STEP in dense:
                raise ValueError(f"a dense tensor may not be named {GLOBAL_STEP!r}")
            dense[GLOBAL_STEP] = tf.constant(int(step), tf.int64)
            staging = storage.staging_dir(dirname)
            _failpoints.hit("before-bundle")
            if distributed:
                def write(directory, names, prefix, device, with_dense):
                    # Each part's serving view streams with its rows, beside it (merged by publish_parts).
                    return write_bundle(directory, {n: evs[n] for n in names}, sids, dense if with_dense else {},
                                        full=(kind == "full"), chunk_rows=chunk_rows, prefix=prefix, device=device,
                                        view=serving_view if names else None,
                                        view_prefix=VIEW_PREFIX + prefix[len(BUNDLE_PREFIX):])
                parts = write_parts(storage, dirname, staging, groups, write)
            else:
                files, counts = write_bundles(staging, evs, sids, dense, full=(kind == "full"),
                                              chunk_rows=chunk_rows, view=serving_view)
        if distributed:
            _failpoints.hit("before-upload")
            files, counts, sent, index = publish_parts(storage, dirname, staging, parts)
            _check_listed(index, storage.display(dirname), list(evs), list(dense))
        else:
            _check_written(staging, files, list(evs), list(dense))
            storage.upload(staging, dirname, list(files))
            sent = 0 if storage.local else sum(f["size"] for f in files.values())
        if stats is not None:
            stats["bytes_sent_here"] = sent
        manifest = Manifest(
            seq=seq, kind=kind, parent=None if kind == "full" else parent, base=seq if kind == "full" else base,
            global_step=int(step), wall_time=time.time(), files=files,
            evs={n: {"dim": ev.dim, "key_dtype": ev.key_dtype.name, **counts[n],
                     **({"shard": shard_info[n]} if n in shard_info else {})} for n, ev in evs.items()},
            dense={n: {"dtype": t.dtype.name, "shape": t.shape.as_list()} for n, t in dense.items()},
            metadata=dict(meta or {}), parent_checksum=None if kind == "full" else parent_checksum,
            quality=quality,
            serving_view=None if serving_view is None else {"dtype": serving_view},
            deleted_complete=True)   # the native table keeps re-inserted keys in the deleted set
        manifest.to_json()  # metadata must serialise before anything is committed
        _failpoints.hit("before-manifest")
        manifest_sent = True
        try:
            storage.write_manifest(dirname, manifest)
        except BaseException as e:
            if not _landed(storage, dirname, manifest):
                raise
            log.warning("the write of %s failed (%r) but the manifest is there, whole: committed",
                        storage.display(dirname, MANIFEST), e)
        _failpoints.hit("after-manifest")
    except BaseException:
        abort_snapshots(evs, sids)
        if manifest_sent:
            # Possibly visible (a lost acknowledgement): withdraw the manifest,
            # keep the directory so no writer reuses this sequence number (the
            # next save numbers past it, then removes it as a leftover).
            try:
                storage.remove_manifest(dirname)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.exception("could not withdraw %s; readers may see it: the next save numbers past it, and "
                              "readers that applied it reload from the newest full", storage.display(dirname))
        else:
            if staging:
                storage.remove_manifest(dirname)
            storage.remove_dir(dirname)
        raise
    finally:
        discard_parts(parts)
        if staging:
            storage.discard_staging(staging)
    for name, sid in sids.items():
        evs[name].commit_export(sid)
    return manifest


def abort_snapshots(evs, sids):
    """Aborts every sealed snapshot {name: id} of `evs` (their keys merge back
    into the open sets, so the next save carries them), logging failures."""
    for name, sid in sids.items():
        try:
            evs[name].abort_export(sid)
        except Exception:  # noqa: BLE001 - keep aborting the others
            log.exception("aborting the export of %s failed", name)


def _landed(storage, dirname, manifest):
    """After a failed manifest write: is exactly this manifest there (the write
    happened, its acknowledgement was lost)? False when it cannot be told."""
    try:
        with storage.fs.open(storage.join(dirname, MANIFEST), "rb") as f:
            return f.read() == manifest.to_json().encode()
    except Exception:  # noqa: BLE001 - unknown counts as not landed: withdraw it
        return False


def _check_written(staging, files, ev_names, dense_names):
    """Step 2: sizes on disk (in the sink) match what was written; the index lists every tensor."""
    sink = sink_of(staging) if is_sink(staging) else None
    for name, f in files.items():
        size = sink.sizes.get(name) if sink else os.path.getsize(os.path.join(staging, name))
        if size != f["size"]:
            raise CheckpointError(f"{os.path.join(staging, name)}: wrote {f['size']} bytes, found {size}")
    _check_listed(read(staging, BUNDLE_PREFIX + ".index"), staging, ev_names, dense_names)


def _check_listed(index, where, ev_names, dense_names):
    """Bundle index `index` (bytes, of the bundle in `where`) lists every tensor of the EVs and dense variables."""
    _, listed = parse_index(index, os.path.join(where, BUNDLE_PREFIX + ".index"))
    missing = [w for w in [n + s for n in ev_names for s in _EV_TENSORS] + list(dense_names) if w not in listed]
    if missing:
        raise CheckpointError(f"checkpoint bundle in {where} lacks tensors {missing}")
