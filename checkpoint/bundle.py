"""The bundle inside a checkpoint directory: writing EVs and dense tensors with
the native streaming writer, and applying an EV's tensors back to a table.

Tensor names (DESIGN section 4): per EV `<name>-keys`, `-values`, `-versions`,
`-freqs`, `-keys_filtered`, `-freqs_filtered`, `<name>/<slot>-values`, and in
deltas `<name>-deleted_keys`; dense tensors under their own names; `global_step`.
"""
import os

import tensorflow as tf

from checkpoint.manifest import BUNDLE_PREFIX

__all__ = ["write_bundle", "load_ev", "read_dense", "GLOBAL_STEP"]

GLOBAL_STEP = "global_step"
CHUNK_ROWS = 65536


def write_bundle(directory, evs, snapshot_ids, dense, full, chunk_rows=CHUNK_ROWS):
    """Writes `directory/ckpt.*`.

    Args:
      evs: {name: EmbeddingVariable}, each with an open export snapshot.
      snapshot_ids: {name: id} from `ev.begin_export`.
      dense: {name: tf.Tensor} (global step included).
      full: every key (True) or the snapshots' changes (False).
    Returns:
      (files {basename: {"size", "crc32c"}}, per-EV {"rows", "filtered", "deleted", "slots"}).
    """
    from evstore._ops import gen
    names = list(evs)
    out = gen.ev_save_bundle(
        prefix=os.path.join(directory, BUNDLE_PREFIX),
        handles=[evs[n].resource_handle for n in names],
        names=tf.constant(names, tf.string, shape=[len(names)]),
        snapshot_ids=tf.constant([snapshot_ids[n] for n in names], tf.int64, shape=[len(names)]),
        dense_names=tf.constant(list(dense), tf.string, shape=[len(dense)]),
        dense=list(dense.values()),
        key_dtypes=[evs[n].key_dtype for n in names], full=full, chunk_rows=chunk_rows)
    files = {f.decode(): {"size": int(s), "crc32c": int(c)}
             for f, s, c in zip(out.files.numpy(), out.file_sizes.numpy(), out.file_crc32c.numpy())}
    slots = {n: [] for n in names}
    for s in out.slot_names.numpy():
        ev_name, slot = s.decode().rsplit("/", 1)
        slots[ev_name].append(slot)
    counts = {}
    for i, n in enumerate(names):
        r, f, d = (int(x) for x in out.counts.numpy()[i])
        counts[n] = {"rows": r, "filtered": f, "deleted": d, "slots": slots[n]}
    return files, counts


def load_ev(directory, ev, name, slots, clear, chunk_rows=CHUNK_ROWS):
    """Applies EV `name` of the bundle in `directory` to `ev`; returns (rows, filtered, deleted)."""
    from evstore._ops import gen
    out = gen.ev_load_bundle(ev.resource_handle, os.path.join(directory, BUNDLE_PREFIX), name,
                             tf.constant(list(slots), tf.string, shape=[len(slots)]),
                             key_dtype=ev.key_dtype, clear=clear, chunk_rows=chunk_rows)
    return tuple(int(x) for x in out.numpy())


def read_dense(directory, names):
    """{name: np.ndarray} of whole tensors of the bundle in `directory`."""
    reader = tf.train.load_checkpoint(os.path.join(directory, BUNDLE_PREFIX))
    return {n: reader.get_tensor(n) for n in names}
