"""The bundle inside a checkpoint directory: writing EVs and dense tensors with
the native streaming writer, and applying an EV's tensors back to a table.

Tensor names: defined by evstore/schema.py (mirror of evstore/native/core/schema.h,
which the native writer, evstore/native/tf/checkpoint_kernels.cc, uses) and tabled in
docs/reference/checkpoint-format.md; dense tensors keep their own names, plus
`global_step`.
"""
import concurrent.futures
import os

import tensorflow as tf

from checkpoint.fileio import fsync as _fsync
from checkpoint.manifest import BUNDLE_PREFIX
from checkpoint.object_source import is_source, source_of
from checkpoint.serving_view import VIEW_PREFIX, write_view
from evstore import schema

__all__ = ["write_bundle", "write_bundles", "merge_parts", "load_ev", "read_dense", "bundle_signature",
           "GLOBAL_STEP"]

GLOBAL_STEP = "global_step"
CHUNK_ROWS = 65536


def write_bundle(directory, evs, snapshot_ids, dense, full, chunk_rows=CHUNK_ROWS, prefix=BUNDLE_PREFIX,
                 device=None, view=None, view_prefix=VIEW_PREFIX):
    """Writes `directory/<prefix>.*` (the writer op runs on `device`, default: here).

    Args:
      evs: {name: EmbeddingVariable}, each with an open export snapshot.
      snapshot_ids: {name: id} from `ev.begin_export`.
      dense: {name: tf.Tensor} (global step included).
      full: every key (True) or the snapshots' changes (False).
      view: None, or a serving view dtype: the rows are also encoded into
        `directory/<view_prefix>.*` as they stream (checkpoint/serving_view.py).
    Returns:
      (files {basename: {"size", "crc32c"}} (the view's included),
       per-EV {"rows", "filtered", "deleted", "slots"}).
    """
    from evstore import ops
    names = list(evs)
    with tf.device(device):
        out = _save_op(ops, directory, prefix, evs, names, snapshot_ids, dense, full, chunk_rows, view, view_prefix)
    files = {f.decode(): {"size": int(s), "crc32c": int(c)}
             for f, s, c in zip(out.files.numpy(), out.file_sizes.numpy(), out.file_crc32c.numpy())}
    slots = {n: [] for n in names}
    for s in out.slot_names.numpy():
        ev_name, slot = s.decode().rsplit(schema.SLOT_SEPARATOR, 1)
        slots[ev_name].append(slot)
    counts = {}
    for i, n in enumerate(names):
        r, f, d = (int(x) for x in out.counts.numpy()[i])
        counts[n] = {"rows": r, "filtered": f, "deleted": d, "slots": slots[n]}
    return files, counts


def _save_op(ops, directory, prefix, evs, names, snapshot_ids, dense, full, chunk_rows, view=None,
             view_prefix=VIEW_PREFIX):
    return ops.ev_save_bundle(
        prefix=os.path.join(directory, prefix),
        handles=[evs[n].resource_handle for n in names],
        names=tf.constant(names, tf.string, shape=[len(names)]),
        snapshot_ids=tf.constant([snapshot_ids[n] for n in names], tf.int64, shape=[len(names)]),
        dense_names=tf.constant(list(dense), tf.string, shape=[len(dense)]),
        dense=list(dense.values()),
        key_dtypes=[evs[n].key_dtype for n in names], full=full, chunk_rows=chunk_rows, view=view or "",
        view_prefix=view_prefix)


def load_ev(directory, ev, name, slots, clear, chunk_rows=CHUNK_ROWS, shard_index=0, num_shards=1, view=""):
    """Applies EV `name` of the bundle in `directory` to `ev` (on the EV's
    device; with num_shards > 1 only the keys routed to `shard_index`);
    returns (rows, filtered, deleted) applied. `view`: a serving table in a
    view's precision reads its rows from the serving view of that dtype in
    `directory` (EvLoadBundle)."""
    from evstore import ops
    try:
        out = ops.ev_load_bundle(ev.resource_handle, os.path.join(directory, BUNDLE_PREFIX), name,
                                 tf.constant(list(slots), tf.string, shape=[len(slots)]),
                                 key_dtype=ev.key_dtype, clear=clear, chunk_rows=chunk_rows,
                                 shard_index=shard_index, num_shards=num_shards, view=view or "")
    except tf.errors.OpError as e:
        why = _source_error(directory)
        if why:   # the object store's answer (a source in this process), which the loader cannot name
            raise type(e)(e.node_def, e.op, f"{e.message} (object source: {why})") from None
        raise
    return tuple(int(x) for x in out.numpy())


def load_ev_routed(directory, evs, name, slots, clear, shard_indices, num_shards, chunk_rows=CHUNK_ROWS):
    """Applies EV `name` of the bundle in `directory` to the tables `evs` (shards of one EV on one device,
    all tiered or all in DRAM) at once, each key to evs[i] when it routes to shard shard_indices[i] of
    `num_shards` (EvLoadBundleRouted): the bundle's tensors are read once for all of them. Returns
    [(rows, filtered, deleted)] per table."""
    from evstore import ops
    try:
        out = ops.ev_load_bundle_routed([e.resource_handle for e in evs], os.path.join(directory, BUNDLE_PREFIX),
                                        name, tf.constant(list(slots), tf.string, shape=[len(slots)]),
                                        key_dtype=evs[0].key_dtype, clear=clear, chunk_rows=chunk_rows,
                                        shard_indices=list(shard_indices), num_shards=num_shards)
    except tf.errors.OpError as e:
        why = _source_error(directory)
        if why:   # the object store's answer (a source in this process), which the loader cannot name
            raise type(e)(e.node_def, e.op, f"{e.message} (object source: {why})") from None
        raise
    return [tuple(int(x) for x in row) for row in out.numpy()]


def _source_error(directory):
    """Why the reads of an object source in this process failed ('' if none, or not one here)."""
    try:
        return source_of(directory).error() if is_source(directory) else ""
    except KeyError:
        return ""


def read_dense(directory, names):
    """{name: np.ndarray} of whole tensors of the bundle in `directory` (a local directory, or an object
    source's: checkpoint/object_source.py)."""
    if is_source(directory):
        return source_of(directory).tensors(names)
    reader = tf.train.load_checkpoint(os.path.join(directory, BUNDLE_PREFIX))
    return {n: reader.get_tensor(n) for n in names}


def bundle_signature(directory):
    """({name: shape list}, {name: tf.DType}) of every tensor of the bundle in `directory` (a local
    directory, or an object source's). Raises tf.errors.OpError / ValueError (local) or
    CorruptCheckpointError (a source) for an unreadable index."""
    if is_source(directory):
        return source_of(directory).signature()
    reader = tf.train.load_checkpoint(os.path.join(directory, BUNDLE_PREFIX))
    return reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()


def write_bundles(directory, evs, snapshot_ids, dense, full, chunk_rows=CHUNK_ROWS, view=None):
    """`write_bundle`, with every task writing the EVs it holds (checkpoint/shards.py).

    EVs all in this process: one `write_bundle`. Otherwise one part bundle per
    task, written concurrently by the native writer on that task (the dense
    tensors and the global step in a part written here), then merged by
    TensorFlow's MergeV2Checkpoints into `<directory>/ckpt` (index merged,
    data files renamed, not copied). Same return value as write_bundle, with
    the merged file names. `view`: a serving view, streamed with the rows
    (EVs all here) or, after a merge, written from the merged bundle's rows
    (checkpoint/serving_view.py write_view).
    """
    from checkpoint.shards import device_groups
    groups = device_groups(evs)
    if set(groups) <= {""}:
        return write_bundle(directory, evs, snapshot_ids, dense, full, chunk_rows, view=view)
    local = groups.pop("", [])
    jobs = [(f"{BUNDLE_PREFIX}_part{k}", task + "/device:CPU:0", names, {})
            for k, (task, names) in enumerate(sorted(groups.items()))]
    jobs.append((f"{BUNDLE_PREFIX}_part{len(jobs)}", None, local, dense))

    def run(job):
        prefix, device, names, d = job
        return write_bundle(directory, {n: evs[n] for n in names}, snapshot_ids, d, full, chunk_rows,
                            prefix=prefix, device=device)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    files, counts = merge_parts(directory, [j[0] for j in jobs], results)
    if view is not None:
        files.update(write_view(directory, list(evs), view, BUNDLE_PREFIX))
    return files, counts


def merge_parts(directory, prefixes, results):
    """Joins the part bundles `<directory>/<prefix>.*` (each written by
    `write_bundle`, whose (files, counts) are `results`) into one
    `<directory>/ckpt` bundle; returns its (files, counts)."""
    # MergeV2Checkpoints renumbers the data files it keeps (those an index
    # entry points to) in its own order; a rename keeps the inode, which maps
    # each merged file back to the size and crc32c its writer reported.
    by_inode, counts = {}, {}
    for part_files, part_counts in results:
        counts.update(part_counts)
        for f, info in part_files.items():
            if ".data-" in f:
                by_inode[os.stat(os.path.join(directory, f)).st_ino] = info
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=[os.path.join(directory, p) for p in prefixes],
                                  destination_prefix=os.path.join(directory, BUNDLE_PREFIX), delete_old_dirs=False)
    files = {}
    for f in os.listdir(directory):
        path = os.path.join(directory, f)
        if f.startswith(BUNDLE_PREFIX + "_part"):
            os.remove(path)   # a part's data file no tensor uses (not merged)
        elif f.startswith(BUNDLE_PREFIX + ".data-"):
            files[f] = by_inode[os.stat(path).st_ino]
    index = os.path.join(directory, BUNDLE_PREFIX + ".index")
    _fsync(index)
    _fsync(directory)
    from evstore import ops
    crc, size = ops.ev_file_crc32c(index)
    files[BUNDLE_PREFIX + ".index"] = {"size": int(size), "crc32c": int(crc)}
    return files, counts

