"""Shared by bench_lookup.py (project venv) and peer_tfra.py (TFRA venv): numpy only.

Keys are (i * 0x9E3779B97F4A7C15) & (2^62 - 1) for i in [0, N): non-sequential,
non-negative (so DenseHashTable may reserve -1 / -2) and identical in both venvs.
Batch b of the "existing" stream draws --batch indices uniformly (with
repetition) from [0, N) with numpy's default_rng(seed); batch j of the "new"
stream is the never-filled indices [N + j*batch, N + (j+1)*batch).
"""
import os
import statistics
import time

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


def timed(fn, *a):
    """Seconds taken by fn(*a)."""
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def rate(batch, times):
    """Median keys/s of a list of per-batch seconds (None if no times)."""
    return batch / statistics.median(times) if times else None


def rss_mib():
    """Resident set size of this process in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mem_available_mib():
    """MemAvailable from /proc/meminfo in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def add_size_args(ap, fill_help="keys per insert while filling"):
    """The size and sampling flags both sides of a comparison must agree on."""
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys in the table (default 1M)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    ap.add_argument("--batch", type=int, default=65536, help="keys per batch (default 65536)")
    ap.add_argument("--batches", type=int, default=20, help="timed rounds per workload (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before each workload (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed for batch key indices (default 0)")
    ap.add_argument("--fill-chunk", type=int, default=1 << 20, help=fill_help)


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


def add_stream_args(ap):
    """The stream flags both sides of the filter comparison must agree on."""
    ap.add_argument("--lookups", type=int, default=2_000_000, help="ids in the stream (default 2M)")
    ap.add_argument("--batch", type=int, default=8192, help="ids per step (default 8192)")
    ap.add_argument("--window", type=int, default=200_000, help="Zipf ranks (default 200k)")
    ap.add_argument("--shift", type=int, default=800, help="ids the window moves per step (default 800)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    ap.add_argument("--save-every", type=int, default=10, help="steps between saves: evict / restrict (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")


def open_loop(seconds, hz, make_request, send):
    """Open-loop requests for `seconds`: request i is due at t0 + i/hz, built by
    make_request() and sent by send(request). Returns (latency from each due
    time, time in send) lists, in seconds."""
    lat, call = [], []
    period = 1.0 / hz
    t0 = time.perf_counter()
    i = 0
    while True:
        due = t0 + i * period
        if due - t0 > seconds:
            break
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        req = make_request()
        t = time.perf_counter()
        send(req)
        end = time.perf_counter()
        lat.append(end - due)
        call.append(end - t)
        i += 1
    return lat, call
