"""Tiered against all-DRAM through the EV API, both in one process, step by step
(bench_tiered.py's `ev-pair` mode).

Two EmbeddingVariables of --keys keys x --dim with evstore's Adam, one all-DRAM
and one over evstore.TieredStorage (--dram-fraction of the rows' bytes in
DRAM), populated alike with `ev.load`. Then the same Zipf batch (drawn once,
outside the timed windows) trains one side and then the other, alternating
which goes first, so that a shared machine's load falls on both alike. Each
window is timed by CPU (process time, user and system apart), wall time and
the process's page faults (getrusage: minor and major). The tier's cleaner
thread (named `evstore-cleaner`) runs beside both windows: its CPU
(/proc/self/task/<tid>/schedstat) is moved from wherever it ran to the tiered
side. Read-only lookups at batch 1,024 alternate the same way. Figures per key
and the ratios all-DRAM / tiered (higher is better for the tier; 1.0 = equal),
printed every --report steps and for the whole run.

The kernel's own work for the tier (its flusher threads writing dirty file
pages back) runs in no process's time and is not counted; the system time of
the training process is (faults on the mapped file, pwritev copying into the
page cache).

With --perf PREFIX, `perf record -g` samples this process during each side's
training windows, into PREFIX-tiered.data and PREFIX-dram.data (perf's control
FIFO enables each around its side's windows).

Both tables at once: about (1 + fraction) x the rows' bytes of RSS plus the
tier file in the page cache: a 10M x 64 run holds ~9 GiB of RSS, so run it
under the big-memory lock (BRIEF).
"""
import json
import os
import shutil
import statistics
import tempfile
import time

from bench.harness.perf import PerfRecord

FIND_BATCH = 1024


def _keys(nkeys):
    import numpy as np
    return (np.arange(nkeys, dtype=np.int64) * 0x9E3779B1) % (1 << 40)


def _zipf_ranks(rng, a, n, nkeys):
    import numpy as np
    return (rng.zipf(a, size=n).astype(np.int64) - 1) % nkeys


def _cleaner_ns():
    """CPU nanoseconds so far of this process's threads named evstore-cleaner (every tier's cleaner)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "evstore-cleaner":
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:   # a thread that ended meanwhile
            continue
    return total


class _Window:
    """CPU (user, system), wall, minor and major faults, and the cleaner's CPU of a timed block."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), _cleaner_ns()
        import resource
        self.u0 = resource.getrusage(resource.RUSAGE_SELF)
        return self

    def __exit__(self, *exc):
        import resource
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        self.wall = time.perf_counter() - self.t0
        self.user = u1.ru_utime - self.u0.ru_utime
        self.sys = u1.ru_stime - self.u0.ru_stime
        self.minflt = u1.ru_minflt - self.u0.ru_minflt
        self.majflt = u1.ru_majflt - self.u0.ru_majflt
        self.cleaner = (_cleaner_ns() - self.c0) * 1e-9


class _Tally:
    def __init__(self):
        self.cpu = self.user = self.sys = self.wall = 0.0
        self.minflt = self.majflt = self.keys = 0

    def add(self, w, keys, cleaner_in=0.0, cleaner_out=0.0):
        """A window's figures; `cleaner_out` of its CPU was the tier's cleaner (moved to the
        tiered side), `cleaner_in` the cleaner's CPU in the other side's window (moved here)."""
        self.user += w.user
        self.sys += w.sys
        self.cpu += w.user + w.sys - cleaner_out + cleaner_in
        self.wall += w.wall
        self.minflt += w.minflt
        self.majflt += w.majflt
        self.keys += keys

    def per_key(self):
        k = max(self.keys, 1)
        return dict(cpu_us_per_key=self.cpu / k * 1e6, user_us_per_key=self.user / k * 1e6,
                    sys_us_per_key=self.sys / k * 1e6, wall_us_per_key=self.wall / k * 1e6,
                    minflt_per_1k_keys=self.minflt / k * 1e3, majflt=self.majflt)


def run(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import evstore
    keys = _keys(args.keys)
    dim = args.dim
    budget = int(args.dram_mib * 2**20) if args.dram_mib else int(args.dram_fraction * args.keys * dim * 3 * 4)
    work = tempfile.mkdtemp(prefix="tiered-ev-pair-", dir=args.dir)
    try:
        sides = {"dram": evstore.EmbeddingVariable("pair_dram", dim),
                 "tiered": evstore.EmbeddingVariable("pair_tiered", dim, storage=evstore.TieredStorage(
                     dram_bytes=budget, path=os.path.join(work, "tier")))}
        opts = {k: evstore.optimizers.Adam(0.001) for k in sides}
        step = 1 << 18
        block = np.random.default_rng(12345).standard_normal((step, dim), dtype=np.float32) * np.float32(0.01)
        zeros = np.zeros((step, dim), np.float32)
        for name, ev in sides.items():
            t0 = time.perf_counter()
            for i, lo in enumerate(range(0, args.keys, step)):
                k = keys[lo:lo + step]
                ev.load(k, block[:len(k)] + np.float32(i * 1e-4), slots={"m": zeros[:len(k)], "v": zeros[:len(k)]})
            print(json.dumps(dict(populated=name, s=round(time.perf_counter() - t0, 1), load=os.getloadavg()[0])),
                  flush=True)
        rng = np.random.default_rng(0)

        def train(name, ids):
            ev = sides[name]
            with tf.GradientTape() as tape:
                e = evstore.embedding_lookup(ev, ids)
                loss = tf.reduce_sum(e * e)
            opts[name].apply_gradients(zip(tape.gradient(loss, ev.trainable_variables), ev.trainable_variables))

        def find(name, ids):
            evstore.embedding_lookup(sides[name], ids, training=False).numpy()

        perf = {k: PerfRecord(f"{args.perf}-{k}.data") for k in sides} if args.perf else {}
        tiered = sides["tiered"]

        def alternate(fn, batch, steps, tallies, report=0, label=""):
            s0 = tiered.stats()
            part = {k: _Tally() for k in sides}
            for s in range(steps):
                ids = keys[_zipf_ranks(rng, args.zipf, batch, args.keys)]
                order = ("dram", "tiered") if s % 2 == 0 else ("tiered", "dram")
                windows = {}
                for name in order:
                    if name in perf:
                        perf[name].on()
                    with _Window() as w:
                        fn(name, ids)
                    if name in perf:
                        perf[name].off()
                    windows[name] = w
                moved = windows["dram"].cleaner   # the cleaner's CPU inside the all-DRAM window
                for t in (tallies, part):
                    if t is None:
                        continue
                    t["dram"].add(windows["dram"], batch, cleaner_out=moved)
                    t["tiered"].add(windows["tiered"], batch, cleaner_in=moved)
                if report and (s + 1) % report == 0:
                    _print(label + f" steps {s + 1 - report}-{s + 1}", part, tiered.stats(), s0)
                    part = {k: _Tally() for k in sides}
                    s0 = tiered.stats()

        for _ in range(args.warmup):
            ids = keys[_zipf_ranks(rng, args.zipf, args.batch, args.keys)]
            for name in sides:
                train(name, ids)
        total = {k: _Tally() for k in sides}
        s0 = tiered.stats()
        alternate(train, args.batch, args.steps, total, report=args.report, label="train")
        train_fig = _print("train, whole run", total, tiered.stats(), s0)
        finds = {k: _Tally() for k in sides}
        s0 = tiered.stats()
        for p in perf.values():   # lookups unprofiled: the profiles are the training steps'
            p.close()
        perf = {}
        alternate(find, FIND_BATCH, args.find_calls, finds)
        find_fig = _print(f"read-only lookups, batch {FIND_BATCH}", finds, tiered.stats(), s0)
        st = tiered.stats()
        print(json.dumps(dict(result=dict(train=train_fig, find1k=find_fig), keys=args.keys, dim=dim,
                              budget_mib=budget / 2**20, cache_rows=st["cache_rows"],
                              disk_mib=st["disk_bytes"] / 2**20, load_end=os.getloadavg())), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _print(label, tallies, s1, s0):
    hits = s1["cache_hits"] - s0["cache_hits"]
    acc = hits + s1["cache_misses"] - s0["cache_misses"]
    d, t = tallies["dram"].per_key(), tallies["tiered"].per_key()
    fig = dict(label=label, dram=d, tiered=t, hit_rate=hits / acc if acc else 1.0,
               misses=s1["cache_misses"] - s0["cache_misses"],
               ratio_cpu=d["cpu_us_per_key"] / t["cpu_us_per_key"] if t["cpu_us_per_key"] else 0.0,
               ratio_wall=d["wall_us_per_key"] / t["wall_us_per_key"] if t["wall_us_per_key"] else 0.0,
               load=os.getloadavg()[0])
    misses = fig["misses"]
    if misses:
        fig["extra_cpu_us_per_miss"] = (t["cpu_us_per_key"] - d["cpu_us_per_key"]) * tallies["tiered"].keys / misses
    print(json.dumps(fig), flush=True)
    return fig


def add_arguments(ap):
    ap.add_argument("--report", type=int, default=0, help="ev-pair: print the figures of every N steps too")
    ap.add_argument("--find-calls", type=int, default=200, help="ev-pair: read-only lookups of 1,024 ids per side")
    ap.add_argument("--perf", default=None, help="ev-pair: perf record -g each side's training windows into "
                                                 "PREFIX-tiered.data and PREFIX-dram.data; ev: each child's "
                                                 "training steps into PREFIX-<side>-<round>.data")
