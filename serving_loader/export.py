"""Serving export: a SavedModel that stock TensorFlow serves.

Each EmbeddingVariable (a ShardedEmbeddingVariable too: one table of all its
shards' rows, the same export as unsharded) becomes a `tf.lookup.experimental.DenseHashTable`
(key -> [dim] float32 row, the EV's default value for missing keys; the
table's empty / deleted sentinel keys are the two smallest values of the key
dtype, which therefore cannot be served); dense weights stay variables. The
model's forward pass is traced with every EV lookup replaced by a lookup of
its table, so the graph holds no evstore op: TF Serving, or any process with
TensorFlow and without evstore, loads and runs it.

Next to the SavedModel, `assets.extra/evstore_serving.json` maps names to the
export's objects (the checkpoint names: EVs by `ev.name`, dense variables as
checkpoint.collect names them), so ServingModel can apply checkpoints to it:

    {"format": "evstore-serving", "version": 1,
     "evs": {"user": {"index": 0, "dim": 16, "key_dtype": "int64",
                      "empty_key": -9223372036854775808, "deleted_key": -9223372036854775807}},
     "dense": {"out/kernel": 0, "out/bias": 1},
     "inputs": [{"name": "users", "dtype": "int64", "shape": [null, 2]}],
     "signature": "serving_default"}
The loaded object exposes the tables as `tables[i]` and the variables as
`dense[i]` (indices from the map).
"""
import json
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from checkpoint.collect import collect
from evstore.substitution import substitute_lookups

__all__ = ["export_serving_model", "ensure_serving_export", "MAP_FILE", "sentinels"]

MAP_FILE = os.path.join("assets.extra", "evstore_serving.json")
FORMAT = "evstore-serving"


def sentinels(key_dtype):
    """(empty_key, deleted_key) of a served table: the two smallest keys of the dtype."""
    lo = int(np.iinfo(tf.as_dtype(key_dtype).as_numpy_dtype).min)
    return lo, lo + 1


def _shaped(rows, ids, dim):
    rows = tf.reshape(rows, tf.concat([tf.shape(ids), [dim]], 0))
    rows.set_shape(ids.shape.concatenate([dim]))
    return rows


def _input_specs(model, input_signature):
    if input_signature is not None:
        specs = list(tf.nest.flatten(input_signature))
    elif isinstance(model, keras.Model):
        specs = [tf.TensorSpec(i.shape, i.dtype, name=i.name) for i in model.inputs]
    else:
        raise ValueError("input_signature is required for a model that is not a functional keras.Model")
    names = [s.name for s in specs]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"every serving input needs a distinct name, got {names}")
    return specs


def export_serving_model(model, export_dir, input_signature=None, output_name="outputs"):
    """Writes a stock-TensorFlow SavedModel of `model` to `export_dir`.

    Args:
      model: a functional keras.Model (its inputs give the signature), or a
        callable (Keras model or tf.Module `__call__`) with `input_signature`.
      export_dir: a new or empty directory.
      input_signature: list of named tf.TensorSpec, one per model input.
      output_name: the signature's output key (a dict output keeps its keys).
    The tables start with the EVs' current rows (materialised once here).
    Returns the serving map (see the module docstring).

    Raises:
      ValueError: unnamed / duplicate inputs, a non-empty export_dir.
    """
    if os.path.exists(export_dir) and os.listdir(export_dir):
        raise ValueError(f"export_dir {export_dir!r} is not empty; export into a new directory")
    specs = _input_specs(model, input_signature)
    col = collect(model)
    module = tf.Module()
    module.tables = []
    module.dense = []
    mapping = {"format": FORMAT, "version": 1, "evs": {}, "dense": {}, "signature": "serving_default",
               "inputs": [{"name": s.name, "dtype": s.dtype.name, "shape": s.shape.as_list()} for s in specs]}
    served = {}
    for name, ev in col.logical_evs().items():   # a sharded EV is one table, like an unsharded one
        empty, deleted = sentinels(ev.key_dtype)
        default = ev.default_value if ev.default_value is not None else np.zeros([ev.dim], np.float32)
        table = tf.lookup.experimental.DenseHashTable(
            key_dtype=ev.key_dtype, value_dtype=tf.float32, default_value=tf.constant(default),
            empty_key=empty, deleted_key=deleted, name=f"ev_{len(module.tables)}")
        rows = ev.export()
        if int(tf.size(rows["keys"])):
            table.insert(rows["keys"], rows["values"])
        mapping["evs"][name] = {"index": len(module.tables), "dim": ev.dim, "key_dtype": ev.key_dtype.name,
                                "empty_key": empty, "deleted_key": deleted}
        module.tables.append(table)
        served[ev] = (lambda ids, t=table, d=ev.dim: _shaped(t.lookup(tf.reshape(ids, [-1])), ids, d))
    for name, v in col.dense.items():
        if name.startswith("optimizer/"):
            continue
        mapping["dense"][name] = len(module.dense)
        module.dense.append(v.value if isinstance(v, keras.Variable) else v)

    @tf.function(input_signature=specs)
    def serve(*args):
        with substitute_lookups(served):
            x = list(args) if len(args) > 1 else args[0]
            out = model(x, training=False) if isinstance(model, keras.Model) else model(x)
        return dict(out) if isinstance(out, dict) else {output_name: out}

    module.serve = serve
    tf.saved_model.save(module, export_dir, signatures={"serving_default": serve.get_concrete_function()})
    os.makedirs(os.path.join(export_dir, "assets.extra"), exist_ok=True)
    with open(os.path.join(export_dir, MAP_FILE), "w") as f:
        json.dump(mapping, f, indent=1, sort_keys=True)
    return mapping


def ensure_serving_export(model, export_dir, input_signature=None, output_name="outputs"):
    """Makes `export_dir` (a local path) hold `model`'s serving export.

    An absent or empty `export_dir` gets a new export, written to a sibling
    temporary directory and renamed into place (a reader never sees half an
    export). If it already holds an export of the same model (the same serving
    map: tables, dims, dense weights, inputs), it is kept: a resumed job does
    not rewrite it under a running server. Its tables' initial rows do not
    matter to a server with a checkpoint root: it serves the root's chain.
    Returns (serving map, True if written now).

    Raises:
      ValueError: `export_dir` holds something else (another model's export,
        or files that are not an export).
    """
    export_dir = os.path.abspath(export_dir)
    existing = None
    if os.path.isdir(export_dir) and os.listdir(export_dir):
        try:
            with open(os.path.join(export_dir, MAP_FILE)) as f:
                existing = json.load(f)
        except (FileNotFoundError, ValueError):
            raise ValueError(f"export directory {export_dir} is not empty and holds no evstore serving export; "
                             "give a new or empty directory") from None
    elif os.path.exists(export_dir) and not os.path.isdir(export_dir):
        raise ValueError(f"export directory {export_dir} is a file")
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(export_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        mapping = export_serving_model(model, tmp, input_signature=input_signature, output_name=output_name)
        if existing is not None:
            if existing != mapping:
                raise ValueError(f"export directory {export_dir} holds the export of another model (its tables "
                                 f"{sorted(existing.get('evs', {}))}, inputs "
                                 f"{[i.get('name') for i in existing.get('inputs', [])]}); give a new directory")
            return existing, False
        if os.path.isdir(export_dir):
            os.rmdir(export_dir)     # empty (checked above)
        os.rename(tmp, export_dir)
        return mapping, True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
