"""The job's model: one evstore.keras.Embedding per sparse field (its filter
and eviction from the spec), dense features, an MLP head, a sigmoid output.
Inputs are `<field>_ids` (`[None, 1]` int64 ids; the EV is named after the
field) and `dense`
(`[None, n]` float32) when the spec has dense columns."""
import keras
import tensorflow as tf

import evstore

__all__ = ["build_model", "OPTIMIZERS"]

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


def build_model(spec, seed=0):
    """A compiled keras.Model for `spec` (see evstore_app.job.spec)."""
    inputs, parts = [], []
    for f in spec["sparse"]:
        inp = keras.Input(shape=(1,), dtype="int64", name=f"{f['name']}_ids")
        extra = {"evict": _evict(f["evict"])} if f.get("evict") else {}
        emb = evstore.keras.Embedding(
            f["dim"], name=f["name"], filter=_filter(f.get("filter")),
            embeddings_initializer=tf.random_normal_initializer(0.0, 0.01, seed=seed), **extra)(inp)
        inputs.append(inp)
        parts.append(keras.layers.Flatten()(emb))
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
    return model


def model_inputs(spec, cols):
    """Model inputs {input name: array} from a batch's columns."""
    import numpy as np
    x = {f"{f['name']}_ids": np.asarray(cols[f["column"]], np.int64).reshape(-1, 1) for f in spec["sparse"]}
    if spec["dense"]:
        x["dense"] = np.stack([np.asarray(cols[c], np.float32) for c in spec["dense"]], axis=1)
    return x
