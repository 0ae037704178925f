"""A long-tailed stream: 2 M lookups of Zipf(1.1)-distributed IDs over a moving
window (popular IDs fade, new ones arrive), trained step by step.

With eviction on (and a checkpoint every few steps, which evicts first and
then clears the change tracking: dirty list and deleted set), rows and bytes
stop growing after warm-up; without eviction they grow with every new ID. With
CounterFilter(3), rows never exceed the number of IDs seen 3+ times."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

LOOKUPS = 2_000_000
BATCH = 8192
STEPS = LOOKUPS // BATCH + 1      # 245 steps
WINDOW = 100_000                  # ranks 0..WINDOW-1 of the Zipf law
SHIFT = 800                       # the window moves this many IDs per step
WARMUP = 80
TTL = 20
SAVE_EVERY = 10


def zipf_stream(seed=11):
    """Yields (step, ids): id = window offset + Zipf(1.1) rank (rank 0 most popular)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, WINDOW + 1) ** 1.1
    cdf = np.cumsum(p / p.sum())
    for step in range(STEPS):
        ranks = np.minimum(np.searchsorted(cdf, rng.random(BATCH)), WINDOW - 1)
        yield step, (step * SHIFT + ranks).astype(np.int64)


def run(ev):
    """Trains the whole stream (SGD, versions = step) with a checkpoint-like
    save every SAVE_EVERY steps (evict, seal and commit the changed keys);
    returns the stats after each save."""
    history = []
    for step, ids in zipf_stream():
        ids_t = tf.constant(ids)
        emb = evstore.embedding_lookup(ev, ids_t)
        evstore.training.sparse_apply_sgd(ev, tf.IndexedSlices(tf.ones_like(emb) * 1e-3, ids_t), 0.1, step)
        if step % SAVE_EVERY == 0:
            if ev.evict_policies:
                ev.evict(step)
            ev.commit_export(ev.begin_export()[0])
            history.append(ev.stats())
    return history


@pytest.fixture(scope="module")
def no_evict():
    return run(evstore.EmbeddingVariable("zipf_plain", 8))


def test_with_eviction_rows_and_bytes_stay_flat_after_warmup(no_evict):
    hist = run(evstore.EmbeddingVariable("zipf_evict", 8, evict=evstore.GlobalStepEvict(TTL)))
    w = WARMUP // SAVE_EVERY
    rows = [h["admitted"] for h in hist]
    arena = [h["row_bytes"] + h["meta_bytes"] for h in hist]
    mem = [h["bytes"] for h in hist]
    assert hist[-1]["evicted"] > 0 and hist[-1]["free_rows"] > 0
    # After warm-up the live set stays within a narrow band, the arena does
    # not grow at all (evicted rows are reused) and neither does the total.
    assert max(rows[w:]) <= 1.1 * rows[w]
    assert max(arena[w:]) == arena[w]
    assert max(mem[w:]) <= 1.1 * mem[w]
    # Without eviction the same stream keeps growing.
    plain = [h["bytes"] for h in no_evict]
    assert plain[-1] > 2 * plain[w] and plain[-1] > 2 * mem[-1]


def test_with_counter_filter_rows_are_at_most_the_ids_seen_three_times(no_evict):
    ev = evstore.EmbeddingVariable("zipf_filter", 8, filter=evstore.CounterFilter(3))
    run(ev)
    final = ev.stats()
    counts = {}
    for _, ids in zipf_stream():
        u, c = np.unique(ids, return_counts=True)
        for k, n in zip(u.tolist(), c.tolist()):
            counts[k] = counts.get(k, 0) + n
    seen3 = sum(1 for n in counts.values() if n >= 3)
    assert final["admitted"] == seen3                         # exactly those IDs own rows
    assert final["filtered"] == len(counts) - seen3           # the rest cost index entries only
    assert len(counts) > 1.2 * seen3                          # the long tail: many IDs are rare
