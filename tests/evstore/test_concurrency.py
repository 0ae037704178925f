"""Concurrent lookups, applies and exports on one EmbeddingVariable (docs/ARCHITECTURE.md, "Table").

TensorFlow's eager ops release the GIL, so Python threads run the kernels at
once. Every apply adds the same exact constant to all `dim` entries of a row
(SGD, lr = 1, gradient -1 per occurrence, values exact in float32), so:
  * a row read or exported mid-run must differ from its initial row by the same
    whole number in every entry (anything else is a torn row);
  * SGD with summed gradients is order-free, so the final table must equal a
    serial run of the same batches.
"""
import concurrent.futures
import threading

import numpy as np
import pytest
import tensorflow as tf

import evstore
from evstore import ops

DIM = 8
OLD_KEYS = np.arange(1, 401, dtype=np.int64) * 7919            # preloaded; the only keys trained
NEW_KEYS = np.arange(20_000, dtype=np.int64) + 10**12          # inserted by lookups (index growth)
INIT = (OLD_KEYS[:, None] % 1000 + np.arange(DIM)[None, :] * 0.25).astype(np.float32)
BANK = np.random.default_rng(0).normal(size=(64, DIM)).astype(np.float32)
APPLY_THREADS, APPLY_ITERS, APPLY_BATCH = 3, 400, 256
LOOKUP_THREADS, LOOKUP_ITERS, LOOKUP_BATCH = 2, 200, 256
STEP = 7


def new_ev(name, num_segments):
    ev = evstore.EmbeddingVariable(name, DIM, initializer=tf.constant_initializer(BANK),
                                   initializer_bank_size=len(BANK), num_segments=num_segments)
    ev.load(OLD_KEYS, INIT)
    return ev


def apply_batches(seed):
    rng = np.random.default_rng(seed)
    return [rng.choice(OLD_KEYS, size=APPLY_BATCH) for _ in range(APPLY_ITERS)]   # with duplicates


def lookup_batches(seed):
    rng = np.random.default_rng(seed)
    new = NEW_KEYS[seed::LOOKUP_THREADS]
    per_iter = len(new) // LOOKUP_ITERS
    out = []
    for i in range(LOOKUP_ITERS):
        fresh = new[i * per_iter:(i + 1) * per_iter]
        old = rng.choice(OLD_KEYS, size=LOOKUP_BATCH - len(fresh))
        out.append(np.concatenate([fresh, old]))
    return out


APPLIES = [apply_batches(100 + t) for t in range(APPLY_THREADS)]
LOOKUPS = [lookup_batches(t) for t in range(LOOKUP_THREADS)]


def run_apply(ev, batches):
    one = tf.constant(1.0)
    step = tf.constant(STEP, tf.int64)
    for keys in batches:
        grads = -tf.ones([len(keys), DIM])          # + 1.0 to every entry, per occurrence
        ops.ev_apply_sgd(ev.resource_handle, tf.constant(keys), grads, step, one)


def run_lookup(ev, batches):
    for keys in batches:
        evstore.embedding_lookup(ev, tf.constant(keys))


def assert_untorn(keys, values, where):
    """Rows of OLD_KEYS must be INIT + a whole number, the same in every entry."""
    index = {int(k): i for i, k in enumerate(OLD_KEYS)}
    mask = np.array([int(k) in index for k in keys], bool)
    rows = np.array([index[int(k)] for k in keys[mask]], np.int64)
    delta = values[mask] - INIT[rows]
    torn = np.flatnonzero(np.any(delta != delta[:, :1], axis=1))
    assert torn.size == 0, f"{where}: torn rows for keys {keys[mask][torn][:5]}: {delta[torn][:2]}"
    assert np.all(delta == np.round(delta)) and np.all(delta >= 0), f"{where}: impossible deltas"


def run_readers(ev, stop, results):
    """Exports and read-only lookups in a loop until `stop`; checks every row it sees."""
    exports = reads = 0
    while not stop.is_set() or exports == 0:   # at least one full round, however threads interleave
        exp = ev.export()
        assert_untorn(exp["keys"].numpy(), exp["values"].numpy(), "export")
        exports += 1
        vals = evstore.embedding_lookup(ev, tf.constant(OLD_KEYS), training=False).numpy()
        assert_untorn(OLD_KEYS, vals, "read-only lookup")
        reads += 1
    results["exports"], results["reads"] = exports, reads


def train_concurrently(ev, side_task):
    """Runs every apply and lookup thread at once with `side_task(stop)` beside
    them; `stop` is set when training is done. Re-raises any thread's error."""
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(APPLY_THREADS + LOOKUP_THREADS + 1) as pool:
        side = pool.submit(side_task, stop)
        workers = [pool.submit(run_apply, ev, b) for b in APPLIES]
        workers += [pool.submit(run_lookup, ev, b) for b in LOOKUPS]
        try:
            for w in workers:
                w.result()
        finally:
            stop.set()
        side.result()


def table(ev):
    exp = ev.export()
    order = np.argsort(exp["keys"].numpy())
    return {f: exp[f].numpy()[order] for f in ("keys", "values", "versions", "freqs")}


def serial_table(num_segments):
    ev = new_ev("serial", num_segments)
    for batches in APPLIES:
        run_apply(ev, batches)
    for batches in LOOKUPS:
        run_lookup(ev, batches)
    return table(ev)


def concurrent_table(num_segments):
    """Runs the apply and lookup threads at once, with a reader exporting in flight."""
    ev = new_ev("concurrent", num_segments)
    reader_results = {}
    train_concurrently(ev, lambda stop: run_readers(ev, stop, reader_results))
    assert reader_results["exports"] >= 1
    return ev, reader_results


@pytest.mark.parametrize("num_segments", [1, 64])
def test_concurrent_lookups_applies_and_exports_equal_a_serial_run(num_segments):
    ev, _ = concurrent_table(num_segments)
    got, want = table(ev), serial_table(num_segments)
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["freqs"], want["freqs"])
    # Never-updated keys store their admission step (-2 - step), which depends
    # on whether an apply ran before their lookup; compare the public versions.
    np.testing.assert_array_equal(np.where(got["versions"] < 0, -1, got["versions"]),
                                  np.where(want["versions"] < 0, -1, want["versions"]))
    np.testing.assert_array_equal(got["values"], want["values"])


def test_serial_run_gives_every_old_key_its_occurrence_count():
    """The oracle itself: + 1.0 per occurrence, freqs = training lookups, versions = STEP."""
    got = serial_table(64)
    counts = {int(k): 0 for k in OLD_KEYS}
    looks = {int(k): 0 for k in OLD_KEYS}
    for batches in APPLIES:
        for b in batches:
            for k in b:
                counts[int(k)] += 1
    for batches in LOOKUPS:
        for b in batches:
            for k in b:
                if int(k) in looks:
                    looks[int(k)] += 1
    old = np.isin(got["keys"], OLD_KEYS)
    assert old.sum() == len(OLD_KEYS) and (~old).sum() == len(NEW_KEYS)
    idx = np.searchsorted(OLD_KEYS, got["keys"][old])
    expect = INIT[idx] + np.array([counts[int(k)] for k in got["keys"][old]], np.float32)[:, None]
    np.testing.assert_array_equal(got["values"][old], expect)
    np.testing.assert_array_equal(got["freqs"][old], [looks[int(k)] for k in got["keys"][old]])
    # Exported versions < 0 mean "never updated" (-2 - s: admitted at step s).
    public = np.where(got["versions"] < 0, -1, got["versions"])
    assert set(public[old].tolist()) <= {STEP, -1}
    np.testing.assert_array_equal(public[~old], -1)
    np.testing.assert_array_equal(got["freqs"][~old], 1)


def test_rows_seen_by_readers_during_concurrent_training_are_never_torn():
    _, results = concurrent_table(4)   # assert_untorn runs inside the reader thread
    assert results["reads"] >= 1


def test_two_phase_exports_in_flight_lose_no_dirty_key():
    """A saver thread seals, then commits or (every third time) aborts, while training
    runs: the committed snapshots plus the final open set cover every changed key."""
    ev = new_ev("sealing", 64)
    sid, _, _ = ev.begin_export()          # the preload counts as saved
    ev.commit_export(sid)
    committed, rounds = set(), [0]

    def saver(stop):
        while not stop.is_set() or rounds[0] < 3:   # commits and an abort, whatever the timing
            sid, dirty, _ = ev.begin_export()
            rounds[0] += 1
            if rounds[0] % 3 == 0:
                ev.abort_export(sid)        # a failed save: its keys must come back
            else:
                committed.update(dirty.numpy().tolist())
                ev.commit_export(sid)

    train_concurrently(ev, saver)
    sid, dirty, deleted = ev.begin_export()
    ev.commit_export(sid)
    changed = {int(k) for b in APPLIES for batch in b for k in batch}
    changed |= {int(k) for b in LOOKUPS for batch in b for k in batch}
    seen = committed | set(dirty.numpy().tolist())
    assert rounds[0] >= 3
    assert changed <= seen, f"{len(changed - seen)} changed keys were never exported"
    assert deleted.numpy().size == 0
