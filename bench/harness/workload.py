"""The workloads every side of a comparison sees (project venv and peer venvs): numpy only.

Keys are (i * 0x9E3779B97F4A7C15) & (2^62 - 1) for i in [0, N): non-sequential,
non-negative (so DenseHashTable may reserve -1 / -2) and identical in both venvs.
Batch b of the "existing" stream draws --batch indices uniformly (with
repetition) from [0, N) with numpy's default_rng(seed); batch j of the "new"
stream is the never-filled indices [N + j*batch, N + (j+1)*batch).
"""
import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MASK = np.uint64(2**62 - 1)


def make_keys(idx):
    """Maps indices to int64 keys: (i * golden) & (2^62 - 1)."""
    with np.errstate(over="ignore"):
        return ((np.asarray(idx, dtype=np.uint64) * GOLDEN) & MASK).astype(np.int64)


class Batches:
    """The pre-generated batches every system sees (index i -> the same keys everywhere)."""

    def __init__(self, n, batch, count, seed):
        rng = np.random.default_rng(seed)
        self.count = count
        self.idx = [rng.integers(0, n, batch) for _ in range(count)]
        self.keys = [make_keys(i) for i in self.idx]
        self.new_keys = [make_keys(np.arange(n + j * batch, n + (j + 1) * batch)) for j in range(count)]


def fill_chunks(n, chunk):
    """Yields (start, stop, keys) covering [0, n) in chunks of `chunk` keys."""
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        yield s, e, make_keys(np.arange(s, e))


def zipf_stream(lookups, batch, window, shift, seed, a=1.1):
    """The filter benchmark's stream: ceil(lookups / batch) batches of int64 ids,
    id = step * shift + rank, rank ~ Zipf(a) truncated to [0, window) (rank 0
    the most popular). The window moves by `shift` ids per step, so popular ids
    fade and new ones arrive. Identical in every venv (numpy default_rng)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, window + 1) ** a
    cdf = np.cumsum(p / p.sum())
    steps = -(-lookups // batch)
    return [(s * shift + np.minimum(np.searchsorted(cdf, rng.random(batch)), window - 1)).astype(np.int64)
            for s in range(steps)]
