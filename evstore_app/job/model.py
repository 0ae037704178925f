"""The job's model: one evstore.keras.Embedding per sparse field (its filter
and eviction from the spec), dense features, an MLP head, a sigmoid output.
Inputs are `<field>_ids` (`[None, 1]` int64 ids, or string ids for a field
with "keys": "string": `[None, 1]`, or `[None, max_ids]` padded with "" for a
split field, whose rows are averaged; the EV is named after the field) and `dense`
(`[None, n]` float32) when the spec has dense columns."""
import keras
import tensorflow as tf

import evstore

__all__ = ["build_model", "field_ev", "model_inputs", "OPTIMIZERS"]

OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "ftrl": "Ftrl", "adamw": "AdamW",
              "group_adam": "GroupAdam", "group_adagrad": "GroupAdagrad"}


def _filter(f):
    if not f:
        return None
    if "counter" in f:
        return evstore.CounterFilter(int(f["counter"]))
    return evstore.BloomFilter(int(f["bloom"]), capacity=int(f.get("capacity", 1_000_000)),
                               fp_rate=float(f.get("fp_rate", 0.01)))


def _evict(e):
    if not e:
        return None
    out = []
    if "global_step" in e:
        out.append(evstore.GlobalStepEvict(int(e["global_step"])))
    if "l2" in e:
        out.append(evstore.L2WeightEvict(float(e["l2"])))
    return out


class MeanOfIds(keras.layers.Layer):
    """The mean row of each example's ids ([batch, max_ids] string ids padded
    with b""): only the real ids are looked up (padding never becomes a key),
    an example without ids gets zeros. Wraps the field's Embedding layer."""

    def __init__(self, embedding, **kw):
        super().__init__(**kw)
        self.embedding = embedding

    def call(self, ids, training=None):
        present = tf.not_equal(ids, "")
        rows = self.embedding(tf.boolean_mask(ids, present), training=training)
        which = tf.cast(tf.where(present)[:, 0], tf.int32)
        return tf.math.unsorted_segment_mean(rows, which, tf.shape(ids)[0])

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.embedding.dim)


def field_ev(model, name):
    """The EmbeddingVariable of sparse field `name` of a build_model model."""
    for layer in model.layers:
        if isinstance(layer, MeanOfIds) and layer.embedding.name == name:
            return layer.embedding.ev
        if layer.name == name:
            return layer.ev
    raise KeyError(f"the model has no sparse field {name!r}")


def _key_dtype(f):
    return "string" if f.get("keys") == "string" else "int64"


def build_model(spec, seed=0):
    """A compiled keras.Model for `spec` (see evstore_app.job.spec)."""
    inputs, parts = [], []
    for f in spec["sparse"]:
        width = f.get("max_ids", 1)
        inp = keras.Input(shape=(width,), dtype=_key_dtype(f), name=f"{f['name']}_ids")
        extra = {"evict": _evict(f["evict"])} if f.get("evict") else {}
        layer = evstore.keras.Embedding(
            f["dim"], key_dtype=_key_dtype(f), name=f["name"], filter=_filter(f.get("filter")),
            embeddings_initializer=tf.random_normal_initializer(0.0, 0.01, seed=seed), **extra)
        inputs.append(inp)
        if "split" in f:
            parts.append(MeanOfIds(layer, name=f"{f['name']}_mean")(inp))
        else:
            parts.append(keras.layers.Flatten()(layer(inp)))
    if spec["dense"]:
        dense_in = keras.Input(shape=(len(spec["dense"]),), dtype="float32", name="dense")
        inputs.append(dense_in)
        parts.append(dense_in)
    x = keras.layers.Concatenate()(parts) if len(parts) > 1 else parts[0]
    for i, width in enumerate(spec["hidden"]):
        x = keras.layers.Dense(width, activation="relu", name=f"hidden_{i}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i))(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 100))(x)
    model = keras.Model(inputs, out)
    opt = dict(spec["optimizer"])
    name = opt.pop("name").lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"spec: optimizer {name!r} is not one of {sorted(OPTIMIZERS)}")
    model.compile(optimizer=getattr(evstore.optimizers, OPTIMIZERS[name])(**opt), loss="binary_crossentropy")
    # Built now, not at the first step: its variables (the dense layers' slots, the iteration count) exist
    # before a restore, which loads them, so a resumed job continues with the optimizer state it saved.
    model.optimizer.build(model.trainable_variables)
    return model


def model_inputs(spec, cols):
    """Model inputs {input name: array} from a batch's columns."""
    import numpy as np
    x = {}
    for f in spec["sparse"]:
        ids = np.asarray(cols[f["column"]])
        if f.get("keys") == "string":   # tf.string tensors ([N, 1] or a split field's [N, max_ids]): Keras takes no object arrays
            x[f"{f['name']}_ids"] = tf.constant(ids.reshape(len(ids), -1))
        else:
            x[f"{f['name']}_ids"] = np.asarray(ids, np.int64).reshape(-1, 1)
    if spec["dense"]:
        x["dense"] = np.stack([np.asarray(cols[c], np.float32) for c in spec["dense"]], axis=1)
    return x
