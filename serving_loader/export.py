"""Serving export: a SavedModel that stock TensorFlow serves.

Each EmbeddingVariable (a ShardedEmbeddingVariable too: one table of all its
shards' rows, the same export as unsharded) becomes a `tf.lookup.experimental.DenseHashTable`
(key -> [dim] float32 row, the EV's default value for missing keys); dense
weights stay variables. The table's empty / deleted sentinel keys are the two
smallest values of the key dtype (for string keys, two fixed byte strings,
STRING_SENTINELS), which a DenseHashTable cannot hold; training
can, so their rows live beside the table in a [2, dim] variable
(`reserved_rows[i]`, row j for key `min + j`, with `reserved_present[i]` [2]
bool) and the traced lookup selects them: every key training holds is served. The
model's forward pass is traced with every EV lookup replaced by a lookup of
its table, so the graph holds no evstore op: TF Serving, or any process with
TensorFlow and without evstore, loads and runs it.

Next to the SavedModel, `assets.extra/evstore_serving.json` maps names to the
export's objects (the checkpoint names: EVs by `ev.name`, dense variables as
checkpoint.collect names them), so ServingModel can apply checkpoints to it:

    {"format": "evstore-serving", "version": 1,
     "evs": {"user": {"index": 0, "dim": 16, "key_dtype": "int64", "reserved": 0,
                      "empty_key": -9223372036854775808, "deleted_key": -9223372036854775807}},
     "dense": {"out/kernel": 0, "out/bias": 1},
     "inputs": [{"name": "users", "dtype": "int64", "shape": [null, 2]}],
     "signature": "serving_default"}
The loaded object exposes the tables as `tables[i]`, the sentinel keys' rows as
`reserved_rows[i]` / `reserved_present[i]` and the variables as `dense[i]`
(indices from the map; exports written before `reserved` existed cannot serve
the two sentinel keys, and ServingModel refuses checkpoints holding them).

`export_serving_model(..., tables="evstore")` writes the other kind
(serving_loader/ev_table.py): each EV stays an empty evstore table
(`tables[i]`, an ExportedTable, looked up with EvFind: every key servable, no
sentinels), its default value in `ev_defaults[i]`; the map says
`"tables": "evstore"` and each EV entry has `"default": i` instead of the
sentinel fields. It loads where evstore's op library is loaded. Such an export
also holds, for each signature `<key>`, a function `lookup_keys_<key>` (same
inputs, not a signature: TF Serving's metadata does not list it) answering
{EV name: the ids the signature looks up in that EV, flattened, in lookup
order, duplicates kept}: a sharded serving front (serving_loader/front.py)
runs it to know which rows to ask its shards for before it runs the signature.
Its EV lookups answer zeros, so ids computed from a lookup's rows are not
supported there.
"""
import json
import os
import shutil

import numpy as np
import tensorflow as tf

from checkpoint.collect import collect
from evstore.lazy_keras import isinstance_of
from evstore.substitution import substitute_lookups
from serving_loader.ev_table import EVSTORE, STOCK, TABLE_KINDS, ExportedTable

__all__ = ["export_serving_model", "ensure_serving_export", "MAP_FILE", "sentinels"]

MAP_FILE = os.path.join("assets.extra", "evstore_serving.json")
FORMAT = "evstore-serving"


# A string table's sentinels: two fixed byte strings (ASCII, so the serving map's JSON holds them as
# they are). Training may hold them as keys like any other string: their rows live beside the table.
STRING_SENTINELS = (b"\x00evstore:empty-key", b"\x00evstore:deleted-key")


def sentinels(key_dtype):
    """(empty_key, deleted_key) of a served table: the two smallest keys of an
    integer dtype; for string keys the two STRING_SENTINELS (bytes)."""
    if tf.as_dtype(key_dtype) == tf.string:
        return STRING_SENTINELS
    lo = int(np.iinfo(tf.as_dtype(key_dtype).as_numpy_dtype).min)
    return lo, lo + 1


def _json_key(k):
    return k.decode("ascii") if isinstance(k, bytes) else k


def _served_lookup(ids, table, rows, present, sentinel, default, dim):
    """Rows of `ids` from the table, the two sentinel keys from their side rows.

    The side rows are read only when the batch holds a sentinel key (a tf.cond),
    so a batch without one costs two small ops over a bare table lookup."""
    flat = tf.reshape(ids, [-1])
    if flat.dtype == tf.string:
        special = tf.logical_or(tf.equal(flat, sentinel[0]), tf.equal(flat, sentinel[1]))
        out = table.lookup(tf.where(special, tf.constant(b"", tf.string), flat))   # any key but the sentinels
    else:   # the sentinels are the dtype's two smallest values (sentinels())
        special = tf.less_equal(flat, sentinel[1])
        out = table.lookup(tf.maximum(flat, sentinel[0] + 2))   # the sentinels' rows are replaced below

    def with_side_rows():
        side = tf.where(present[:, None], rows, default[None, :])              # [2, dim]
        which = tf.cast(tf.equal(flat, sentinel[1]), tf.int32)                 # side row 0 or 1
        return tf.where(special[:, None], tf.gather(side, which), out)

    out = tf.cond(tf.reduce_any(special), with_side_rows, lambda: out)
    return _shaped(out, ids, dim)


def _shaped(rows, ids, dim):
    rows = tf.reshape(rows, tf.concat([tf.shape(ids), [dim]], 0))
    rows.set_shape(ids.shape.concatenate([dim]))
    return rows


def _input_specs(model, input_signature):
    if input_signature is not None:
        specs = list(tf.nest.flatten(input_signature))
    elif isinstance_of(model, "Model"):
        specs = [tf.TensorSpec(i.shape, i.dtype, name=i.name) for i in model.inputs]
    else:
        raise ValueError("input_signature is required for a model that is not a functional keras.Model")
    names = [s.name for s in specs]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"every serving input needs a distinct name, got {names}")
    return specs


# TF Serving's signature method names (tensorflow/cc/saved_model/signature_constants.h)
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
EXAMPLE_SIGNATURES = {"classify": ("classification", CLASSIFY_METHOD), "regress": ("regression", REGRESS_METHOD)}


def _feature_spec(spec):
    if not spec.shape[1:].is_fully_defined():
        raise ValueError(f"input {spec.name!r} has shape {spec.shape}: a tf.Example signature needs every dimension "
                         "but the batch one fixed")
    kind = tf.string if spec.dtype == tf.string else tf.float32 if spec.dtype.is_floating else tf.int64
    return tf.io.FixedLenFeature(spec.shape[1:], kind)


def _example_signature(kind, specs, forward):
    """TF Serving's classification / regression signature over `forward`: one
    string input "inputs" (serialized tf.Example protos, a feature per model
    input named as the input) and "scores" [batch, n] / "outputs" [batch]."""
    features = {s.name: _feature_spec(s) for s in specs}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def fn(serialized):
        parsed = tf.io.parse_example(serialized, features)
        out = forward([tf.cast(parsed[s.name], s.dtype) for s in specs])
        if len(out) != 1:
            raise ValueError(f"a {kind} signature needs a model with one output, got {sorted(out)}")
        (y,) = out.values()
        y = tf.cast(y, tf.float32)
        if kind == "classify":
            return {"scores": tf.reshape(y, [tf.shape(y)[0], -1])}
        if y.shape.rank is not None and (y.shape.rank > 2 or (y.shape.rank == 2 and y.shape[1] != 1)):
            raise ValueError(f"a regress signature needs one value per example, the model answers {y.shape}")
        return {"outputs": tf.reshape(y, [-1])}

    return fn


def _key_recorder(names, dims):
    """({ev: fn(ids)}, recorded): substitutes that record each lookup's ids
    (flattened) in `recorded` {EV name: [ids]} and answer zero rows."""
    recorded = {}

    def fn(ids, name, dim):
        recorded.setdefault(name, []).append(tf.reshape(ids, [-1]))
        return _shaped(tf.zeros(tf.stack([tf.size(ids), dim]), tf.float32), ids, dim)

    return {ev: (lambda ids, n=n, d=dims[n]: fn(ids, n, d)) for ev, n in names.items()}, recorded


def _lookup_keys_function(specs, model, names, dims, key_dtypes, output_name, parse=None):
    """The `lookup_keys_<signature>` function of an evstore export (module docstring)."""
    def keys_of(args):
        fns, recorded = _key_recorder(names, dims)
        with substitute_lookups(fns):
            x = list(args) if len(args) > 1 else args[0]
            _ = model(x, training=False) if isinstance_of(model, "Model") else model(x)
        return {n: tf.concat(recorded[n], 0) if n in recorded else tf.zeros([0], key_dtypes[n])
                for n in dims}

    if parse is None:
        @tf.function(input_signature=specs)
        def fn(*args):
            return keys_of(args)
    else:
        features = {s.name: _feature_spec(s) for s in specs}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
        def fn(serialized):
            parsed = tf.io.parse_example(serialized, features)
            return keys_of([tf.cast(parsed[s.name], s.dtype) for s in specs])
    return fn


def _set_method_names(export_dir, methods):
    from tensorflow.core.protobuf import saved_model_pb2

    path = os.path.join(export_dir, "saved_model.pb")
    sm = saved_model_pb2.SavedModel()
    with open(path, "rb") as f:
        sm.ParseFromString(f.read())
    for key, method in methods.items():
        sm.meta_graphs[0].signature_def[key].method_name = method
    with open(path, "wb") as f:
        f.write(sm.SerializeToString())


def export_serving_model(model, export_dir, input_signature=None, output_name="outputs", example_signatures=(),
                         tables=STOCK):
    """Writes a stock-TensorFlow SavedModel of `model` to `export_dir`.

    Args:
      model: a functional keras.Model (its inputs give the signature), or a
        callable (Keras model or tf.Module `__call__`) with `input_signature`.
      export_dir: a new or empty directory.
      input_signature: list of named tf.TensorSpec, one per model input.
      output_name: the signature's output key (a dict output keeps its keys).
      example_signatures: any of "classify", "regress": also write TF
        Serving's tf.Example signatures ("classification" with method
        tensorflow/serving/classify answering "scores" [batch, n];
        "regression" with tensorflow/serving/regress answering "outputs"
        [batch]), for its :classify / :regress APIs. They take serialized
        tf.Example protos ("inputs") with one feature per model input, named
        as the input and shaped as it without the batch dimension; the model
        must have one output.
      tables: "stock" (default): each EV becomes a DenseHashTable holding
        its current rows, and any TensorFlow loads the export. "evstore":
        each EV stays an evstore table (serving_loader/ev_table.py), empty
        in the export (its rows come from the checkpoint root; nothing is
        materialised, so a table larger than memory exports): a process
        loads it with evstore's op library, and `ServingModel(...,
        storage=evstore.TieredStorage(...))` / `evstore serve
        --tiered-dram-bytes` keeps its rows in a DRAM cache over a disk tier.
    The stock tables start with the EVs' current rows (materialised once here).
    Returns the serving map (see the module docstring).

    Raises:
      ValueError: unnamed / duplicate inputs, a non-empty export_dir, an
        unknown `tables`.
    """
    if tables not in TABLE_KINDS:
        raise ValueError(f"tables must be one of {list(TABLE_KINDS)}, got {tables!r}")
    unknown = sorted(set(example_signatures) - set(EXAMPLE_SIGNATURES))
    if unknown or isinstance(example_signatures, str):
        raise ValueError(f"example_signatures takes a list of {sorted(EXAMPLE_SIGNATURES)}, got {example_signatures!r}")
    if os.path.exists(export_dir) and os.listdir(export_dir):
        raise ValueError(f"export_dir {export_dir!r} is not empty; export into a new directory")
    specs = _input_specs(model, input_signature)
    col = collect(model)
    module = tf.Module()
    module.tables = []
    module.reserved_rows = []
    module.reserved_present = []
    module.dense = []
    mapping = {"format": FORMAT, "version": 1, "evs": {}, "dense": {}, "signature": "serving_default",
               "inputs": [{"name": s.name, "dtype": s.dtype.name, "shape": s.shape.as_list()} for s in specs]}
    if tables == EVSTORE:
        mapping["tables"] = EVSTORE
        module.ev_defaults = []
    served = {}
    for name, ev in col.logical_evs().items():   # a sharded EV is one table, like an unsharded one
        default = ev.default_value if ev.default_value is not None else np.zeros([ev.dim], np.float32)
        if tables == EVSTORE:
            i = len(module.tables)
            module.tables.append(ExportedTable(ev.key_dtype, ev.dim, default))
            module.ev_defaults.append(tf.Variable(np.asarray(default, np.float32), trainable=False,
                                                  name=f"ev_{i}_default"))
            mapping["evs"][name] = {"index": i, "dim": ev.dim, "key_dtype": ev.key_dtype.name, "default": i}
            served[ev] = lambda ids, t=module.tables[i], d=ev.dim: _shaped(t.lookup(tf.reshape(ids, [-1])), ids, d)
            continue
        empty, deleted = sentinels(ev.key_dtype)
        table = tf.lookup.experimental.DenseHashTable(
            key_dtype=ev.key_dtype, value_dtype=tf.float32, default_value=tf.constant(default),
            empty_key=empty, deleted_key=deleted, name=f"ev_{len(module.tables)}")
        rows = ev.export()
        keys, values = rows["keys"].numpy(), rows["values"].numpy()   # string keys: an object array of bytes
        res_rows = np.zeros([2, ev.dim], np.float32)
        res_present = np.zeros([2], bool)
        for j, k in enumerate((empty, deleted)):
            hit = np.flatnonzero(keys == k)
            if hit.size:
                res_rows[j], res_present[j] = values[hit[0]], True
        keep = (keys != empty) & (keys != deleted)
        if keep.any():
            table.insert(tf.constant(keys[keep]), tf.constant(values[keep]))
        i = len(module.tables)
        mapping["evs"][name] = {"index": i, "dim": ev.dim, "key_dtype": ev.key_dtype.name, "reserved": i,
                                "empty_key": _json_key(empty), "deleted_key": _json_key(deleted)}
        module.tables.append(table)
        module.reserved_rows.append(tf.Variable(res_rows, trainable=False, name=f"ev_{i}_reserved_rows"))
        module.reserved_present.append(tf.Variable(res_present, trainable=False, name=f"ev_{i}_reserved_present"))
        served[ev] = (lambda ids, t=table, r=module.reserved_rows[i], p=module.reserved_present[i],
                      sk=(empty, deleted), dv=tf.constant(default, tf.float32), d=ev.dim:
                      _served_lookup(ids, t, r, p, sk, dv, d))
    for name, v in col.dense.items():
        if name.startswith("optimizer/"):
            continue
        mapping["dense"][name] = len(module.dense)
        module.dense.append(v.value if isinstance_of(v, "Variable") else v)

    def forward(args):
        with substitute_lookups(served):
            x = list(args) if len(args) > 1 else args[0]
            out = model(x, training=False) if isinstance_of(model, "Model") else model(x)
        return dict(out) if isinstance(out, dict) else {output_name: out}

    @tf.function(input_signature=specs)
    def serve(*args):
        return forward(args)

    module.serve = serve
    signatures = {"serving_default": serve.get_concrete_function()}
    methods = {}
    for kind in example_signatures:
        key, method = EXAMPLE_SIGNATURES[kind]
        fn = _example_signature(kind, specs, forward)
        setattr(module, f"serve_{kind}", fn)
        signatures[key] = fn.get_concrete_function()
        methods[key] = method
    if tables == EVSTORE:   # what a sharded front asks its shards for (module docstring)
        names = {ev: n for n, ev in col.logical_evs().items()}
        dims = {n: e["dim"] for n, e in mapping["evs"].items()}
        key_dtypes = {n: tf.as_dtype(e["key_dtype"]) for n, e in mapping["evs"].items()}
        for key in signatures:
            setattr(module, f"lookup_keys_{key}",
                    _lookup_keys_function(specs, model, names, dims, key_dtypes, output_name,
                                          parse=None if key == "serving_default" else key))
    tf.saved_model.save(module, export_dir, signatures=signatures)
    if methods:
        _set_method_names(export_dir, methods)
    os.makedirs(os.path.join(export_dir, "assets.extra"), exist_ok=True)
    with open(os.path.join(export_dir, MAP_FILE), "w") as f:
        json.dump(mapping, f, indent=1, sort_keys=True)
    return mapping


def ensure_serving_export(model, export_dir, input_signature=None, output_name="outputs", tables=STOCK):
    """Makes `export_dir` (a local path) hold `model`'s serving export.

    An absent or empty `export_dir` gets a new export, written to a sibling
    temporary directory and renamed into place (a reader never sees half an
    export). If it already holds an export of the same model (the same serving
    map: tables, dims, dense weights, inputs), it is kept: a resumed job does
    not rewrite it under a running server. Its tables' initial rows do not
    matter to a server with a checkpoint root: it serves the root's chain.
    `tables`: export_serving_model's. Returns (serving map, True if written now).

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
        mapping = export_serving_model(model, tmp, input_signature=input_signature, output_name=output_name,
                                       tables=tables)
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
