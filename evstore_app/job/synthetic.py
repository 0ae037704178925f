"""The embedded synthetic click stream: seeded, reproducible, drifting.

Fields (each one id per event, ids spread over int64 as hashed ids are):
  user      60%: Zipf(1.1) over 100k regular users; 40%: Zipf(1.2) over a
            100k-wide window of new users that slides forward 4 ids a batch
            (new users arrive at the head, old ones fade to the tail and out);
  item      the same shape over 50k regular items and a 50k window (3 a batch);
  category  600 categories, Zipf(1.4), no drift;
  hour      a dense feature in [0, 1).
The click probability is sigmoid(u[user] + i[item] + c[category] + h(hour) - 1)
where u, i, c are fixed pseudo-random effects of each id (a hash of the id,
so unseen ids have effects too): a model learns them online, and one frozen
at an early checkpoint cannot know the users and items that arrive later.
Batch `b` is a pure function of (seed, b).
"""
import numpy as np

__all__ = ["ClickStream", "SPEC"]

_M = np.uint64(0x9E3779B97F4A7C15)

# The model spec the demo trains on this stream (see evstore_app.job.spec).
SPEC = {
    "label": {"column": "click"},
    "sparse": [
        {"name": "user", "column": "user", "dim": 16, "filter": {"counter": 2}, "evict": {"global_step": 1500}},
        {"name": "item", "column": "item", "dim": 16, "filter": {"counter": 2}, "evict": {"global_step": 1500}},
        {"name": "category", "column": "category", "dim": 8},
    ],
    "dense": ["hour"],
    "hidden": [64, 32],
    "optimizer": {"name": "adam", "learning_rate": 0.005},
    "batch_size": 512,
}


def _mix(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _effect(ids, salt, scale):
    """A fixed N(0, scale^2)-like effect per id (hash -> two uniforms -> Box-Muller)."""
    with np.errstate(over="ignore"):
        h1 = _mix(ids.astype(np.uint64) * _M + np.uint64(salt))
        h2 = _mix(h1 + np.uint64(salt * 7919 + 1))
    u1 = (h1 >> np.uint64(11)).astype(np.float64) / float(1 << 53) + 1e-12
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return scale * np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


class ClickStream:
    """Batches of click events: `batch(b)` -> ({column: np.ndarray}, labels)."""

    def __init__(self, seed=0, batch_size=512, users=100_000, items=50_000, user_drift=4, item_drift=3,
                 signal=None):
        """`signal`: batch index -> the weight of the id effects in the click
        logit (None: 1): below 1 a window is harder to predict, for any model."""
        self.seed, self.batch_size = seed, batch_size
        self.signal = signal
        self.users, self.items = users, items
        self.user_drift, self.item_drift = user_drift, item_drift

    def batch(self, b):
        rng = np.random.default_rng([self.seed, b])
        n = self.batch_size
        user = self._field(rng, n, b, self.users, self.user_drift, 1.1, 1.2)
        item = self._field(rng, n, b, self.items, self.item_drift, 1.1, 1.2)
        category = (np.minimum(rng.zipf(1.4, n), 600) - 1).astype(np.int64)
        hour = rng.random(n).astype(np.float32)
        w = 1.0 if self.signal is None else float(self.signal(b))
        logit = (w * (_effect(user, 1, 1.5) + _effect(item, 2, 1.5) + _effect(category, 3, 0.5))
                 + 0.8 * np.sin(2 * np.pi * hour) - 1.0)
        click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        with np.errstate(over="ignore"):
            cols = {"user": (user.astype(np.uint64) * np.uint64(1_000_003) + np.uint64(7)).astype(np.int64),
                    "item": (item.astype(np.uint64) * np.uint64(998_244_353) + np.uint64(11)).astype(np.int64),
                    "category": category, "hour": hour}
        return cols, click

    @staticmethod
    def _field(rng, n, b, size, drift, a_regular, a_new):
        # Regular ids 0..size-1 (rank r -> id r, permuted by the hash below);
        # the sliding window's rank r at batch b is id size + b*drift + size - r:
        # the newest ids are the most popular, each fades as the window moves.
        regular = np.minimum(rng.zipf(a_regular, n), size) - 1
        window = size + b * drift + size - np.minimum(rng.zipf(a_new, n), size)
        return np.where(rng.random(n) < 0.6, regular, window).astype(np.int64)

    def batches(self, start=0):
        b = start
        while True:
            yield b, self.batch(b)
            b += 1
