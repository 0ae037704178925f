"""A table's whole state in Keras's variable store (`.keras` files, `save_weights`).

Keras saves a layer by handing `save_own_variables` a store of named numpy
arrays (an HDF5 group inside the `.keras` zip). `evstore.keras.Embedding`
puts there, per table it holds (`prefix` names the table):

| entry | what |
| --- | --- |
| `<prefix>meta` | uint8: JSON {"format", "dim", "key_dtype", "slots", "files", "crc32c"} |
| `<prefix>bank` | float32 [rows, dim]: the initializer bank new keys start from |
| `<prefix>file<i>` | uint8: file i of a full checkpoint bundle of the table |

The bundle is the one a full checkpoint writes (docs/ARCHITECTURE.md,
"Checkpoints": rows, slots, versions, frequencies, filtered keys with their
counts and last sightings, the clock, Bloom counters), written by the same
native writer and read back by the same reader, so a loaded table equals the
saved one in every respect a checkpoint restore keeps. Saving reads the table
through an export snapshot that it then aborts: the dirty and deleted sets
are left as they were (a CheckpointManager's next delta still carries every
change), and no key is evicted. The bank makes keys first seen after a load
start from the rows they would have started from in the saved model.
"""
import json
import os
import tempfile

import numpy as np
import tensorflow as tf

from evstore._ops import gen

__all__ = ["save_table", "load_table", "FORMAT"]

FORMAT = 1                      # the layout above
_PREFIX = "ckpt"                # the bundle's prefix inside the temporary directory
_NAME = "ev"                    # the table's name inside the bundle


def _as_bytes(array):
    return np.asarray(array, dtype=np.uint8).tobytes()


def save_table(ev, store, prefix):
    """Writes the whole state of `ev` (an unsharded EmbeddingVariable) into
    Keras's `store` under `prefix` (see the module docstring).

    Raises:
      tf.errors.FailedPreconditionError: a checkpoint save holds the table's
        export snapshot at this moment (the store is not written).
    """
    bank = ev.initializer_bank()
    with tempfile.TemporaryDirectory(prefix="evstore-keras-") as d:
        snap, _, _ = ev.begin_export(return_keys=False)
        try:
            out = gen.ev_save_bundle(
                prefix=os.path.join(d, _PREFIX), handles=[ev.resource_handle],
                names=tf.constant([_NAME], tf.string), snapshot_ids=tf.reshape(snap, [1]),
                dense_names=tf.zeros([0], tf.string), dense=[], key_dtypes=[ev.key_dtype], full=True)
        finally:
            ev.abort_export(snap)
        files = [f.decode() for f in out.files.numpy()]
        crcs = [int(c) for c in out.file_crc32c.numpy()]
        slots = [s.decode().split("/", 1)[1] for s in out.slot_names.numpy()]
        contents = []
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                contents.append(np.frombuffer(fh.read(), np.uint8))
    meta = {"format": FORMAT, "dim": ev.dim, "key_dtype": ev.key_dtype.name, "slots": slots, "files": files,
            "crc32c": crcs}
    store[f"{prefix}meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    store[f"{prefix}bank"] = bank
    for i, c in enumerate(contents):
        store[f"{prefix}file{i}"] = c


def load_table(ev, store, prefix, where):
    """Replaces the state of `ev` (an unsharded EmbeddingVariable) by the one
    `save_table` wrote under `prefix`; `where` names the layer in errors.

    Raises:
      ValueError: the store holds no table under `prefix`, one of another
        format, width or key dtype, or a file whose crc32c differs from the
        one saved: the table is left unchanged.
    """
    if f"{prefix}meta" not in store:
        raise ValueError(f"{where}: the saved weights hold no evstore table '{prefix}' (saved by another layer?)")
    meta = json.loads(_as_bytes(store[f"{prefix}meta"]).decode())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: saved table format {meta.get('format')!r}, this evstore reads {FORMAT}")
    if meta["dim"] != ev.dim or meta["key_dtype"] != ev.key_dtype.name:
        raise ValueError(f"{where}: the saved table is dim={meta['dim']} key_dtype={meta['key_dtype']}, the "
                         f"layer's is dim={ev.dim} key_dtype={ev.key_dtype.name}")
    bank = np.asarray(store[f"{prefix}bank"], np.float32)
    with tempfile.TemporaryDirectory(prefix="evstore-keras-") as d:
        for i, f in enumerate(meta["files"]):
            if os.path.basename(f) != f:
                raise ValueError(f"{where}: bad file name {f!r} in the saved table")
            with open(os.path.join(d, f), "wb") as fh:
                fh.write(_as_bytes(store[f"{prefix}file{i}"]))
        paths = [os.path.join(d, f) for f in meta["files"]]
        crcs, _ = gen.ev_file_crc32c(tf.constant(paths, tf.string, shape=[len(paths)]))
        bad = [f for f, got, want in zip(meta["files"], crcs.numpy(), meta["crc32c"]) if int(got) != want]
        if bad:   # checked before the table is touched
            raise ValueError(f"{where}: the saved table's file {bad[0]} is corrupt (crc32c mismatch)")
        ev.replace_table(bank)
        gen.ev_load_bundle(ev.resource_handle, os.path.join(d, _PREFIX), _NAME,
                           tf.constant(meta["slots"], tf.string, shape=[len(meta["slots"])]),
                           key_dtype=ev.key_dtype, clear=True)
