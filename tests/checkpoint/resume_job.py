"""A training job with an admission filter and GlobalStepEvict, run as a real
process by test_ckpt_resume.py: `python resume_job.py ROOT OUT FILTER STOP`.

It restores the newest checkpoint under ROOT if there is one (continuing from
the input position saved with it), else starts fresh; trains batches up to
STOP, saving a full at batch 4 and a delta every 2 batches after it (each
save evicts at the global step), printing "saved <pos>" after each; then
writes its final state (every key's row, version, frequency, filtered keys
and their counts) to OUT. Batch i is a pure function of i, so an interrupted
and resumed job must end exactly where an uninterrupted one does.
FILTER is "counter" (CounterFilter(3)), "bloom" (BloomFilter(3)) or "string"
(CounterFilter(3) on string keys: the same ids written as b"u<id>").
"""
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import evstore  # noqa: E402

import checkpoint  # noqa: E402

BATCH = 48


def make_model(kind, optimizer=None):
    """The job's model; `optimizer` (default Adam(0.05)) an evstore optimizer."""
    flt = evstore.BloomFilter(3, capacity=20000) if kind == "bloom" else evstore.CounterFilter(3)
    key_dtype = "string" if kind == "string" else "int64"
    users = keras.Input(shape=(3,), dtype=key_dtype, name="users")
    bank = np.random.default_rng(7).normal(0, 0.1, size=(64, 4)).astype(np.float32)
    emb = evstore.keras.Embedding(4, key_dtype=key_dtype, filter=flt, evict=evstore.GlobalStepEvict(3), name="user",
                                  initializer_bank_size=64, embeddings_initializer=tf.constant_initializer(bank))
    x = keras.layers.Flatten()(emb(users))
    out = keras.layers.Dense(1, activation="sigmoid", name="out",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=1))(x)
    model = keras.Model(users, out)
    model.compile(optimizer=optimizer or evstore.optimizers.Adam(0.05), loss="binary_crossentropy")
    return model, emb.ev


def batch(i, kind):
    # Zipf keys drifting with i: many keys are seen once or twice and then
    # not again, so they sit counted-but-not-admitted until eviction ages them.
    r = np.random.default_rng(500 + i)
    users = (np.minimum(r.zipf(1.2, size=(BATCH, 3)), 3000) + 37 * i).astype(np.int64)
    y = (users[:, :1] % 3 == 0).astype(np.float32)
    if kind == "string":
        users = np.array([b"u%d" % u for u in users.reshape(-1)], object).reshape(users.shape)
    return users, y


def final_state(ev):
    x = {n: (np.array(t.numpy().tolist(), "S") if t.dtype == tf.string else t) if n != "slots" else t
         for n, t in ev.export().items()}   # string keys as fixed-width bytes: savez without pickle
    k, f = np.argsort(np.asarray(x["keys"])), np.argsort(np.asarray(x["filtered_keys"]))
    out = {n: np.asarray(x[n])[k] for n in ("keys", "values", "versions", "freqs")}
    out.update({n: np.asarray(x[n])[f] for n in ("filtered_keys", "filtered_freqs")})
    out.update({f"slot:{s}": v.numpy()[k] for s, v in x["slots"].items()})
    return out


def main(root, out, kind, stop):
    model, ev = make_model(kind)
    mgr = checkpoint.CheckpointManager(root, model)
    pos = mgr.restore()["pos"] if mgr.latest() is not None else 0
    for i in range(pos, stop):
        x, y = batch(i, kind)
        model.train_on_batch(x, y)
        done = i + 1
        if done == 4:
            mgr.save_full(metadata={"pos": done})
        elif done > 4 and done % 2 == 0:
            mgr.save_delta(metadata={"pos": done})
        else:
            continue
        print("saved", done, flush=True)
        if os.environ.get("RESUME_JOB_SLOW"):
            time.sleep(float(os.environ["RESUME_JOB_SLOW"]))
    x = final_state(ev)
    x.update({f"dense:{v.path}": np.asarray(v) for v in model.variables})
    np.savez(out, **x)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
