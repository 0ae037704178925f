"""`evstore demo`: a small end-to-end run on a synthetic click stream.

Two sparse fields (user, item) with power-law id frequencies; the click
probability depends on a hidden per-user and per-item effect, so embeddings
have something to learn. A two-EV model with a dense head trains with
evstore.optimizers.Adam in a tf.function, and the loss is printed falling.
(The full streaming job with checkpoints and serving comes with the
streaming-job issue; this is the foundation's end-to-end check.)
"""
import time

import numpy as np
import tensorflow as tf

import evstore


def synthetic_clicks(batch_size, seed=0, n_users=200_000, n_items=50_000):
    """Infinite generator of (user_ids, item_ids, labels) batches."""
    rng = np.random.default_rng(seed)
    user_effect = rng.normal(0, 1.5, n_users).astype(np.float32)
    item_effect = rng.normal(0, 1.5, n_items).astype(np.float32)
    while True:
        u = np.minimum(rng.zipf(1.2, batch_size), n_users) - 1
        i = np.minimum(rng.zipf(1.3, batch_size), n_items) - 1
        p = 1 / (1 + np.exp(-(user_effect[u] + item_effect[i] - 0.5)))
        y = (rng.random(batch_size) < p).astype(np.float32)
        # Spread ids over the int64 range, as hashed feature ids are.
        yield (u.astype(np.int64) * 1_000_003 + 7, i.astype(np.int64) * 998_244_353 + 11, y)


def run(steps=2000, batch_size=512, dim=16, report_every=200, seed=0, out=print):
    tf.random.set_seed(seed)
    users = evstore.EmbeddingVariable("user", dim=dim, initializer=tf.random_normal_initializer(0, 0.01, seed=1))
    items = evstore.EmbeddingVariable("item", dim=dim, filter=evstore.CounterFilter(min_freq=2),
                                      initializer=tf.random_normal_initializer(0, 0.01, seed=2))
    dense = tf.keras.layers.Dense(1)
    dense.build((None, 2 * dim))
    opt = evstore.optimizers.Adam(learning_rate=0.01)
    trainable = [users, items] + dense.trainable_variables

    @tf.function
    def train_step(u, i, y):
        with tf.GradientTape() as tape:
            x = tf.concat([evstore.embedding_lookup(users, u), evstore.embedding_lookup(items, i)], axis=1)
            logits = tf.squeeze(dense(x), 1)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
        opt.apply_gradients(zip(tape.gradient(loss, trainable), trainable))
        return loss

    stream = synthetic_clicks(batch_size, seed)
    out(f"evstore demo: {steps} steps of {batch_size} examples, two EVs of dim {dim}, Adam")
    t0 = time.time()
    window, first, last = [], None, None
    for step in range(1, steps + 1):
        u, i, y = next(stream)
        window.append(float(train_step(u, i, y)))
        if step % report_every == 0:
            avg = sum(window) / len(window)
            first = avg if first is None else first
            last = avg
            out(f"  step {step:5d}  loss {avg:.4f}  users {int(users.size()):7d}  items {int(items.size()):6d}")
            window = []
    secs = time.time() - t0
    st = items.stats()
    out(f"done in {secs:.1f}s ({steps * batch_size / secs:,.0f} examples/s); "
        f"loss {first:.4f} -> {last:.4f}; item ids admitted {st['admitted']}, "
        f"still filtered (seen once) {st['filtered']}")
    return first, last
