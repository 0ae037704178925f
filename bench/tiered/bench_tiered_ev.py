"""Tiered storage through the EV API, at production size (bench_tiered.py's `ev`
and `beyond` modes).

What a user runs: `EmbeddingVariable(..., storage=evstore.TieredStorage(...))`,
evstore's Adam, `CheckpointManager`. Ids are Zipf(a) ranks over the table
(rank r is the r-th of the populated keys; ranks past the table wrap around,
so the tail spreads over the cold keys instead of piling onto one). Each side
runs in its own process (`child`), so RSS is that side's own.

`ev` (both sides, tiered and all-DRAM, one after the other per round): in
  one process (`train-save`) populate the table with `ev.load` in big
  batches (rows and Adam slots), a full save (timed), training lookup + Adam
  apply on Zipf batches (rate, CPU per key, DRAM hit rate), read-only lookups
  at batch 1 and 1,024 (keys/s, p99), RSS, a delta save (bytes); then in a
  fresh process (`restore`) a restore of the full (timed, RSS) that must give
  back sampled rows bit for bit.

`beyond` (tiered only, a table bigger than this machine's memory): the same
steps split over processes, so that the tier file of the trained table is
gone before the restore builds a new one: `train-save` (populate, train,
save a full, record sampled rows, exit: the tier is removed), then `restore`
in a new process (restore the full, check the sampled rows bit for bit),
then with --serve a server process (serving_loader.ServingModel on a
`tables="evstore"` export, tiered with 10% of the values in DRAM) loads the
full and is timed predicting one example at a time, idle and while the
chain's deltas land one a second. Everything is deleted at the end.
With --rounds N, `beyond` saves N fulls in the training process and restores
N times, each in a new process, and every save and restore is followed by the
disk's sequential write + fsync and cold read of the full's bytes (a probe
child at the same niceness as the sides: --child-nice), so each ratio is
against the disk's rate of that moment on a shared disk. Disk use stays at the
tier plus one full (or the probe's file).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness.disk import drop_cache, sequential_rate
from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd
from bench.harness.perf import PerfRecord
from bench.harness.rss import malloc_trim, smaps_rollup_kib, status_kib
from bench.harness.vmstat import vmstat, vmstat_delta

SAMPLE = 4096          # rows checked bit for bit after a restore
FIELDS = ["populate_keys_per_s", "populate_cpu_us_per_key", "save_full_s", "restore_full_s", "save_full_cpu_s", "restore_full_cpu_s",
          "seq_read_s", "seq_write_s",
          "save_vs_sequential", "restore_vs_sequential", "train_keys_per_s", "train_cpu_us_per_key",
          "train_user_us_per_key", "train_sys_us_per_key", "train_wall_us_per_key",
          "train_write_bytes_per_key", "train_write_calls_per_1k_keys", "train_file_growth_bytes_per_key",
          "hit_rate", "train_majflt", "train_minflt_per_1k_keys", "find1_keys_per_s", "find1_p99_us", "find1k_keys_per_s", "find1k_cpu_us_per_key",
          "find1k_majflt", "find1k_p99_ms", "rss_base_mb",
          "rss_populated_mb", "rss_saved_mb", "rss_train_mb", "rss_train_file_mb", "rss_train_anon_huge_mb",
          "rss_train_file_pmd_mb", "rss_peak_mb", "rss_restored_base_mb", "rss_restored_mb",
          "rss_restored_peak_mb", "delta_mb", "full_mb", "cache_rows", "disk_mb"]


# ---- the child: one side in one process ----------------------------------------
def _zipf_ranks(rng, a, n, nkeys):
    import numpy as np
    return (rng.zipf(a, size=n).astype(np.int64) - 1) % nkeys


def _keys(nkeys):
    import numpy as np
    return (np.arange(nkeys, dtype=np.int64) * 0x9E3779B1) % (1 << 40)


def _status_mib(field):
    """VmRSS / VmHWM of this process in MiB; freed heap goes back to the OS first."""
    malloc_trim()
    return status_kib(field) / 1024


def _proc_io():
    """This process's I/O counters (/proc/self/io: wchar, bytes handed to write calls; syscw, the calls)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return {}


def _tier_file_bytes(tier_dir):
    """The apparent size of the tier's record file(s) under `tier_dir` (row_file.h: <dir>/evstore-tier-*/rows):
    what the log has grown to. A growing file takes new page-cache pages for its writes."""
    total = 0
    for d, _, fs in os.walk(tier_dir):
        for f in fs:
            if f == "rows":
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except OSError:
                    pass
    return total


def _dir_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


class Side:
    """One EV (tiered or all-DRAM) with Adam, and the steps the benchmark times."""

    def __init__(self, cfg):
        import numpy as np
        import tensorflow as tf

        import evstore
        self.np, self.tf, self.evstore, self.cfg = np, tf, evstore, cfg
        self.rng = np.random.default_rng(cfg["seed"])
        self.keys = _keys(cfg["keys"])
        self.opt = evstore.optimizers.Adam(0.001)
        self.ev = self.make_ev()

    def make_ev(self):
        c = self.cfg
        storage = (self.evstore.TieredStorage(dram_bytes=c["dram_bytes"], path=c["tier_dir"])
                   if c["kind"] == "tiered" else None)
        return self.evstore.EmbeddingVariable("t", c["dim"], storage=storage)

    def populate(self):
        """Every key with a row and zero Adam slots, `ev.load` in batches of 2^18 rows
        (one random block, shifted per batch: generating normals would cost more than the load)."""
        np, n, dim = self.np, self.cfg["keys"], self.cfg["dim"]
        step = 1 << 18
        block = np.random.default_rng(12345).standard_normal((step, dim), dtype=np.float32) * np.float32(0.01)
        zeros = np.zeros((step, dim), np.float32)
        t0 = time.perf_counter()
        for i, lo in enumerate(range(0, n, step)):
            k = self.keys[lo:lo + step]
            self.ev.load(k, block[:len(k)] + np.float32(i * 1e-4), slots={"m": zeros[:len(k)], "v": zeros[:len(k)]})
        return n / (time.perf_counter() - t0)

    def train_step(self):
        tf, ev = self.tf, self.ev
        ids = self.keys[_zipf_ranks(self.rng, self.cfg["zipf"], self.cfg["batch"], self.cfg["keys"])]
        with tf.GradientTape() as tape:
            e = self.evstore.embedding_lookup(ev, ids)
            loss = tf.reduce_sum(e * e)
        self.opt.apply_gradients(zip(tape.gradient(loss, ev.trainable_variables), ev.trainable_variables))

    def train(self, steps, perf=None):
        """Timed Zipf training steps: keys/s, CPU microseconds per key (and its user / system split),
        DRAM hit rate, page faults (major: read from disk; minor per 1,000 keys), the machine's
        memory-management counters over the steps (train_vm: harness/vmstat.py). `perf`: a
        PerfRecord switched on around the steps."""
        import resource
        s0 = self.ev.stats()
        v0 = vmstat()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        io0, f0 = _proc_io(), _tier_file_bytes(self.cfg["tier_dir"])
        if perf:
            perf.on()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            self.train_step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if perf:
            perf.off()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        io1, f1 = _proc_io(), _tier_file_bytes(self.cfg["tier_dir"])
        vm = vmstat_delta(v0)
        s1 = self.ev.stats()
        hits = s1["cache_hits"] - s0["cache_hits"]
        acc = hits + s1["cache_misses"] - s0["cache_misses"]
        keys = steps * self.cfg["batch"]
        return dict(train_keys_per_s=keys / wall, train_cpu_us_per_key=cpu / keys * 1e6,
                    train_user_us_per_key=(r1.ru_utime - r0.ru_utime) / keys * 1e6,
                    train_sys_us_per_key=(r1.ru_stime - r0.ru_stime) / keys * 1e6,
                    train_wall_us_per_key=wall / keys * 1e6,
                    hit_rate=hits / acc if acc else 1.0, train_majflt=r1.ru_majflt - r0.ru_majflt,
                    train_minflt_per_1k_keys=(r1.ru_minflt - r0.ru_minflt) / keys * 1e3, train_vm=vm,
                    train_write_bytes_per_key=(io1.get("wchar", 0) - io0.get("wchar", 0)) / keys,
                    train_write_calls_per_1k_keys=(io1.get("syscw", 0) - io0.get("syscw", 0)) / keys * 1e3,
                    train_file_growth_bytes_per_key=(f1 - f0) / keys)

    def lookups(self, batch, calls):
        """Read-only lookups of Zipf batches: keys/s (wall, the calls alone), p99 seconds, CPU
        microseconds a key (the whole loop, id drawing included) and the major faults meanwhile (tier
        records read from the disk: the file's pages gone from the page cache). The two sides run in
        different processes at different moments, so on a busy machine only the CPU figure compares."""
        import resource
        lat = []
        r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        for _ in range(calls):
            ids = self.keys[_zipf_ranks(self.rng, self.cfg["zipf"], batch, self.cfg["keys"])]
            a = time.perf_counter()
            self.evstore.embedding_lookup(self.ev, ids, training=False).numpy()
            lat.append(time.perf_counter() - a)
        cpu, r1 = time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
        return (batch * calls / sum(lat), sorted(lat)[int(0.99 * len(lat))], cpu / (batch * calls) * 1e6,
                r1.ru_majflt - r0.ru_majflt)

    def sample(self):
        """Sampled keys (the head and random others) and their embeddings, read without training."""
        np = self.np
        n = self.cfg["keys"]
        idx = np.unique(np.concatenate([np.arange(min(n, SAMPLE // 2)),
                                        np.random.default_rng(7).integers(0, n, SAMPLE // 2)]))
        k = self.keys[idx]
        return k, self.evstore.embedding_lookup(self.ev, k, training=False).numpy()

    def manager(self, ev=None):
        import checkpoint
        return checkpoint.CheckpointManager(self.cfg["ckpt"], {"t": ev or self.ev}, lease=False)


def child(cfg):
    """Runs the steps `cfg["phase"]` names; prints one JSON line of figures."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    out = dict(kind=cfg["kind"], phase=cfg["phase"])
    # baseline: the runtime and an empty table, before any row exists
    side = Side(cfg) if cfg["phase"] not in ("serve", "sequential") else None
    out["rss_base_mb"] = _status_mib("VmRSS")
    if cfg["phase"] == "sequential":
        out.update(sequential_rate(cfg["work"], cfg["seq_bytes"]))
    if cfg["phase"] == "train-save":
        c0 = time.process_time()
        out["populate_keys_per_s"] = side.populate()
        out["populate_cpu_us_per_key"] = (time.process_time() - c0) / cfg["keys"] * 1e6
        out["rss_populated_mb"] = _status_mib("VmRSS")
        if cfg["save"]:
            out["save_rounds"] = []
            for r in range(cfg["save_rounds"]):
                if r:   # the previous round's full made way for the disk's sequential rate of its bytes
                    shutil.rmtree(cfg["ckpt"])
                    out["save_rounds"][-1].update(_probe(cfg, out["save_rounds"][-1]["full_bytes"], renice=False))
                mgr = side.manager()
                drop_cache(cfg["tier_dir"])   # the tier file read from the disk, as a table larger than memory is
                a, c = time.perf_counter(), time.process_time()
                full_seq = mgr.save_full()
                out["save_rounds"].append(dict(save_full_s=time.perf_counter() - a, save_full_cpu_s=time.process_time() - c,
                                               full_bytes=int(_dir_mb(cfg["ckpt"]) * 2**20), load_avg=os.getloadavg()[0]))
                print(json.dumps(dict(save_round=r, **out["save_rounds"][-1])), file=sys.stderr, flush=True)
            out.update({k: out["save_rounds"][-1][k] for k in ("save_full_s", "save_full_cpu_s")})
            out["full_seq"] = full_seq
            out["full_mb"] = _dir_mb(cfg["ckpt"])
            out["rss_saved_mb"] = _status_mib("VmRSS")
            keys, rows = side.sample()
            np.savez(cfg["sample"], keys=keys, rows=rows)
        for _ in range(cfg["warmup"]):
            side.train_step()
        perf = PerfRecord(cfg["perf"]) if cfg.get("perf") else None
        out.update(side.train(cfg["steps"], perf))
        if perf:
            perf.close()
        out["find1_keys_per_s"], p99, _, _ = side.lookups(1, cfg["find1_calls"])
        out["find1_p99_us"] = p99 * 1e6
        out["find1k_keys_per_s"], p99, out["find1k_cpu_us_per_key"], out["find1k_majflt"] = \
            side.lookups(1024, cfg["find1k_calls"])
        out["find1k_p99_ms"] = p99 * 1e3
        out["rss_train_mb"] = _status_mib("VmRSS")
        out["rss_train_file_mb"] = _status_mib("RssFile")  # mapped file pages: the tier file's that reads mapped
        # how much of it the TLB sees in 2 MiB pages: the tier's own memory, and its file's mapping
        out["rss_train_anon_huge_mb"] = smaps_rollup_kib("AnonHugePages") / 1024
        out["rss_train_file_pmd_mb"] = smaps_rollup_kib("FilePmdMapped") / 1024
        st = side.ev.stats()
        out.update(cache_rows=st["cache_rows"], disk_mb=st["disk_bytes"] / 2**20, admitted=st["admitted"],
                   index_mb=st["index_bytes"] / 2**20, meta_mb=st["meta_bytes"] / 2**20)
        if cfg["save"]:
            before = _dir_mb(cfg["ckpt"])
            mgr.save_delta()
            out["delta_mb"] = _dir_mb(cfg["ckpt"]) - before
            for _ in range(cfg["extra_deltas"]):   # a chain for a server to follow (beyond --serve)
                for _ in range(cfg["delta_steps"]):
                    side.train_step()
                mgr.save_delta()
            out["train_steps_total"] = cfg["warmup"] + cfg["steps"] + cfg["extra_deltas"] * cfg["delta_steps"]
            del mgr
    if cfg["phase"] == "serve":
        serve_phase(cfg, out)
    if cfg["phase"] == "restore":
        fresh = side.make_ev()
        mgr = side.manager(fresh)
        seq = mgr.chain()[0].seq
        drop_cache(cfg["ckpt"])   # the full read from the disk
        a, c = time.perf_counter(), time.process_time()
        mgr.restore(seq=seq)
        out["restore_full_s"] = time.perf_counter() - a
        out["restore_full_cpu_s"] = time.process_time() - c
        out["full_bytes"] = int(_dir_mb(cfg["ckpt"]) * 2**20)
        out["rss_restored_mb"] = _status_mib("VmRSS")
        s = np.load(cfg["sample"])
        got = side.evstore.embedding_lookup(fresh, s["keys"], training=False).numpy()
        out["restored_rows_checked"] = int(len(s["keys"]))
        out["restored_bit_exact"] = bool(np.array_equal(got.view(np.uint32), s["rows"].view(np.uint32)))
    out["rss_peak_mb"] = _status_mib("VmHWM")
    print(json.dumps(out), flush=True)


# ---- serving the larger-than-memory checkpoint (beyond --serve) ------------------
PREDICT_IDS = 8   # ids per example


def _feed(source, dest):
    """The commits of `source` in order, to be made visible in `dest` one at a time."""
    from checkpoint.manifest import MANIFEST
    os.makedirs(dest, exist_ok=True)
    pending = sorted((d for d in os.listdir(source) if os.path.exists(os.path.join(source, d, MANIFEST))),
                     key=lambda d: int(d.split("-")[1]))

    def commit_next():
        """Hard-links the next commit into `dest`, its manifest last (as a writer commits); False at the end."""
        if not pending:
            return False
        d = pending.pop(0)
        os.makedirs(os.path.join(dest, d))
        for n in sorted(os.listdir(os.path.join(source, d)), key=lambda n: n == MANIFEST):
            os.link(os.path.join(source, d, n), os.path.join(dest, d, n))
        return True
    return commit_next


def serve_phase(cfg, out):
    """Serves the checkpoint root from a tiered evstore-table export: load time, predict latency at
    batch 1 idle and while the chain's deltas are applied, RSS. Runs in its own process."""
    import threading

    import numpy as np
    import tensorflow as tf

    import evstore
    from serving_loader import ServingModel, export_serving_model

    class Served(tf.Module):
        def __init__(self, ev):
            super().__init__()
            self.tables = [ev]

        def __call__(self, x):
            ids = x[0] if isinstance(x, (list, tuple)) else x
            return tf.reduce_mean(evstore.embedding_lookup(self.tables[0], ids, training=False), axis=[1, 2])

    work = os.path.dirname(cfg["ckpt"])
    export = os.path.join(work, "export")
    export_serving_model(Served(evstore.EmbeddingVariable("t", cfg["dim"])), export, tables="evstore",
                         input_signature=[tf.TensorSpec([None, PREDICT_IDS], tf.int64, name="ids")])
    commit_next = _feed(cfg["ckpt"], os.path.join(work, "served-root"))
    commit_next()   # the full
    rss0 = _status_mib("VmRSS")
    a = time.perf_counter()
    sm = ServingModel(export, os.path.join(work, "served-root"), storage=evstore.TieredStorage(
        dram_bytes=cfg["serve_dram_bytes"], path=cfg["tier_dir"]))
    out["serve_load_s"] = time.perf_counter() - a
    out["serve_rss_mb"] = _status_mib("VmRSS")
    out["serve_rss_growth_mb"] = out["serve_rss_mb"] - rss0
    keys, rng = _keys(cfg["keys"]), np.random.default_rng(3)
    feature = next(iter(sm.inputs))

    def predicts(seconds):
        lat, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            ids = keys[_zipf_ranks(rng, cfg["zipf"], PREDICT_IDS, cfg["keys"])].reshape(1, PREDICT_IDS)
            a = time.perf_counter()
            sm.predict({feature: ids})
            lat.append(time.perf_counter() - a)
        return lat

    predicts(5.0)   # warm-up
    idle, busy, applied0 = [], [], sm.applied
    for _ in range(cfg["serve_windows"]):
        idle += predicts(cfg["serve_window_s"])
        stop = threading.Event()

        def feed(stop=stop):   # one delta a second
            while not stop.wait(1.0) and commit_next():
                pass
        feeder = threading.Thread(target=feed)
        feeder.start()
        sm.start(every_s=0.1)
        busy += predicts(cfg["serve_window_s"])
        stop.set()
        feeder.join()
        sm.stop()
    p = lambda xs, q: float(np.percentile(xs, q)) * 1e3  # noqa: E731
    out.update(serve_idle_p50_ms=p(idle, 50), serve_idle_p99_ms=p(idle, 99), serve_idle_n=len(idle),
               serve_busy_p50_ms=p(busy, 50), serve_busy_p99_ms=p(busy, 99), serve_busy_n=len(busy),
               serve_deltas_applied=sm.applied - applied0, serve_failures=sm.failures,
               serve_version=sm.version)
    sm.close()


# ---- the parent ------------------------------------------------------------------
# A child that imports evstore from the directory argv[1] ahead of the repository's (run with cwd=ROOT).
OVERLAY_BOOT = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); module = sys.argv[2]; "
                "sys.argv = [module] + sys.argv[3:]; runpy.run_module(module, run_name='__main__')")


def _probe(cfg, nbytes, renice=True):
    """The disk's sequential write + fsync and cold read of `nbytes` in the work directory, measured by a
    child process at the niceness of the save and restore children (from a parent: `renice`; from such a
    child: its own), so that the baseline and what it is compared with wait alike for a core."""
    fig = _run_child(dict(cfg, phase="sequential", seq_bytes=int(nbytes)), renice=renice, quiet=True)
    return {k: fig[k] for k in ("seq_read_s", "seq_write_s", "seq_bytes")}


def _budget(args):
    if args.dram_mib:
        return int(args.dram_mib * 2**20)
    return int(args.dram_fraction * args.keys * args.dim * 3 * 4)


def _cfg(args, kind, phase, work):
    return dict(kind=kind, phase=phase, keys=args.keys, dim=args.dim, dram_bytes=_budget(args), work=work,
                tier_dir=os.path.join(work, "tier"), ckpt=os.path.join(work, "ckpt"), save_rounds=1,
                child_nice=args.child_nice,
                sample=os.path.join(work, f"sample-{kind}.npz"), zipf=args.zipf,
                batch=args.batch, warmup=args.warmup, steps=args.steps, seed=0, find1_calls=2000,
                find1k_calls=200, extra_deltas=0, delta_steps=20, save=not getattr(args, "no_save", False))


def _run_child(cfg, renice=True, quiet=False):
    """Runs one child (train-save, restore, serve, the sequential probe) `cfg["child_nice"]` nicer than
    this process (`renice`; a child starting a probe passes False: it runs at the child's niceness)."""
    os.makedirs(cfg["tier_dir"], exist_ok=True)
    cmd = [*module_cmd(__spec__.name), "child", json.dumps(cfg)]
    if cfg.get("overlay"):   # evstore imported from another tree (ab_oplib.py: another build's op library)
        cmd = [sys.executable, "-c", OVERLAY_BOOT, cfg["overlay"], __spec__.name, "child", json.dumps(cfg)]
    p = subprocess.run(["nice", "-n", str(cfg["child_nice"]), *cmd] if renice else cmd,
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"{cfg['kind']} {cfg['phase']} failed (exit {p.returncode}): {p.stderr[-3000:]}")
    fig = json.loads(p.stdout.strip().splitlines()[-1])
    fig["load_avg"] = os.getloadavg()[0]
    if not quiet:
        print(json.dumps(fig), flush=True)
    return fig


def _sequential(fig, cfg):
    """The disk's sequential rate for the full's bytes, in this run, into the train-save figures: a save
    reads them (the tier) and writes them (the bundle), a restore reads the bundle and writes the tier.
    Measured between the phases, when the trained table's tier is gone (the probe's bytes are on disk
    beside the full only), in a child at the save's niceness."""
    fig.update(_probe(cfg, int(fig["full_mb"] * 2**20)))
    fig["save_rounds"][-1].update({k: fig[k] for k in ("seq_read_s", "seq_write_s", "seq_bytes")})
    for r in fig["save_rounds"]:
        r["save_vs_sequential"] = (r["seq_read_s"] + r["seq_write_s"]) / r["save_full_s"]
    fig["save_vs_sequential"] = fig["save_rounds"][-1]["save_vs_sequential"]
    print(json.dumps({"save_rounds": fig["save_rounds"]}), flush=True)


def _print_sequential(saved, restored, restore_rounds=()):
    """The save and restore against the disk's sequential read + write of the full's bytes, same run:
    each save round against the probe right after it, each restore round against the probe right after
    it (`restore_rounds`; without them the restore against the last save's probe)."""
    head = saved if "seq_read_s" in saved else (restore_rounds[0] if restore_rounds else None)
    if head is None:   # no probe ran (a --phases run of serve alone)
        return
    print(f"{head['kind']}: the full's {head['seq_bytes'] / 2**20:,.0f} MiB; (sequential read + write and fsync) "
          "/ (save or restore), each round against the disk's rate measured right after it:")
    for i, r in enumerate(saved.get("save_rounds", [])):
        seq = r["seq_read_s"] + r["seq_write_s"]
        print(f"  save round {i + 1}: sequential {r['seq_read_s']:.2f} + {r['seq_write_s']:.2f} s = {seq:.2f} s; full save "
              f"(a tier file cold) {r['save_full_s']:.2f} s ({r['save_full_cpu_s']:.2f} s CPU) = "
              f"{seq / r['save_full_s']:.2f}x; load {r['load_avg']:.1f}")
    if not restore_rounds and "restore_full_s" in restored:
        restore_rounds = [dict(restored, **{k: saved[k] for k in ("seq_read_s", "seq_write_s")})]
    for i, r in enumerate(restore_rounds):
        seq = r["seq_read_s"] + r["seq_write_s"]
        r["restore_vs_sequential"] = seq / r["restore_full_s"]
        print(f"  restore round {i + 1}: sequential {r['seq_read_s']:.2f} + {r['seq_write_s']:.2f} s = {seq:.2f} s; "
              f"restore (full cold) {r['restore_full_s']:.2f} s ({r['restore_full_cpu_s']:.2f} s CPU) = "
              f"{r['restore_vs_sequential']:.2f}x; load {r['load_avg']:.1f}")
    if "restore_full_s" in restored and restore_rounds:
        restored["restore_vs_sequential"] = restore_rounds[-1]["restore_vs_sequential"]
    saves = [r["save_vs_sequential"] for r in saved.get("save_rounds", []) if "save_vs_sequential" in r]
    rest = [r["restore_vs_sequential"] for r in restore_rounds]
    print(f"  median: save {statistics.median(saves):.2f}x" if saves else "  median: -",
          f"restore {statistics.median(rest):.2f}x" if rest else "")


def _header(args):
    row_bytes = args.dim * 3 * 4
    return (f"{args.keys:,} keys x dim {args.dim} + Adam ({row_bytes * args.keys / 2**30:.2f} GiB of rows), "
            f"DRAM budget {_budget(args) / 2**20:.0f} MiB ({_budget(args) / (row_bytes * args.keys):.1%} of the rows), "
            f"Zipf({args.zipf}) batches of {args.batch}")


def _train_line(kind, fig):
    """One side's training in one round: CPU (user + system), wall, and what the machine's memory
    manager did meanwhile, so that a round slowed by the kernel shows as such."""
    vm = fig.get("train_vm", {})
    return (f"{kind} {fig['train_cpu_us_per_key']:.3f} us CPU a key ({fig['train_user_us_per_key']:.3f} user + "
            f"{fig['train_sys_us_per_key']:.3f} sys), {fig['train_wall_us_per_key']:.3f} us wall; kernel meanwhile: "
            f"compact_stall {vm.get('compact_stall', 0)}, pgscan_direct {vm.get('pgscan_direct', 0)}, "
            f"pgscan_kswapd {vm.get('pgscan_kswapd', 0)}, thp_fault_alloc {vm.get('thp_fault_alloc', 0)}, "
            f"dirty pages {vm.get('nr_dirty_start', 0)} -> {vm.get('nr_dirty_end', 0)}; written "
            f"{fig.get('train_write_bytes_per_key', 0):.0f} B a key, of which the file grew by "
            f"{fig.get('train_file_growth_bytes_per_key', 0):.0f} B (new page-cache pages)")


def _print_rounds(rounds):
    """Each round's training ratio (all-DRAM CPU / tiered CPU: higher is better for the tier), by CPU and
    by wall, and their medians over the rounds: the figure a target is judged by."""
    def xs(ratios):
        return ", ".join(f"{x:.2f}x" for x in ratios)

    by_cpu = [d["train_cpu_us_per_key"] / t["train_cpu_us_per_key"] for d, t in rounds]
    by_wall = [d["train_wall_us_per_key"] / t["train_wall_us_per_key"] for d, t in rounds]
    print(f"\ntraining, tiered / all-DRAM by round: by CPU {xs(by_cpu)}; by wall {xs(by_wall)}")
    print(f"median of {len(rounds)} round(s): **{statistics.median(by_cpu):.2f}x by CPU**, "
          f"{statistics.median(by_wall):.2f}x by wall")
    if all("find1k_cpu_us_per_key" in t for _, t in rounds):
        f_cpu = [d["find1k_cpu_us_per_key"] / t["find1k_cpu_us_per_key"] for d, t in rounds]
        f_wall = [t["find1k_keys_per_s"] / d["find1k_keys_per_s"] for d, t in rounds]
        print(f"read-only lookups at batch 1,024, tiered / all-DRAM by round: by CPU {xs(f_cpu)} "
              f"(median {statistics.median(f_cpu):.2f}x); by wall {xs(f_wall)} "
              f"(median {statistics.median(f_wall):.2f}x); the tier's major faults "
              f"{', '.join(str(t['find1k_majflt']) for _, t in rounds)}")
    return by_cpu, by_wall


def ev_level(args):
    runs = {"dram": [], "tiered": []}
    for r in range(args.rounds):
        order = ["dram", "tiered"] if r % 2 == 0 else ["tiered", "dram"]
        for kind in order:
            work = tempfile.mkdtemp(prefix="tiered-ev-", dir=args.dir)
            try:
                cfg = _cfg(args, kind, "train-save", work)
                if args.perf:
                    cfg["perf"] = os.path.abspath(f"{args.perf}-{kind}-{r + 1}.data")
                fig = _run_child(cfg)
                shutil.rmtree(cfg["tier_dir"], ignore_errors=True)
                if not cfg["save"]:   # --no-save: training and lookups only
                    runs[kind].append(fig)
                    continue
                _sequential(fig, cfg)
                restored = _run_child(dict(cfg, phase="restore"))
                _print_sequential(fig, restored)
                fig.update({k: v for k, v in restored.items() if k.startswith(("restore", "rss_restored"))},
                           rss_restored_base_mb=restored["rss_base_mb"], rss_restored_peak_mb=restored["rss_peak_mb"])
                runs[kind].append(fig)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        d, t = runs["dram"][-1], runs["tiered"][-1]
        print(f"round {r + 1} ({' first, '.join(order)} second), load {os.getloadavg()[0]:.1f}: "
              f"ratio by CPU {d['train_cpu_us_per_key'] / t['train_cpu_us_per_key']:.2f}x, by wall "
              f"{d['train_wall_us_per_key'] / t['train_wall_us_per_key']:.2f}x\n  {_train_line('all-DRAM', d)}\n  "
              f"{_train_line('tiered', t)}", flush=True)
    _print_rounds(list(zip(runs["dram"], runs["tiered"])))
    med = {k: {f: statistics.median(x.get(f, 0) for x in v) for f in FIELDS} for k, v in runs.items()}
    print(f"\nEV level: {_header(args)}; {args.rounds} round(s), medians of each figure")
    print("| figure | all-DRAM EV | tiered EV | tiered / all-DRAM |")
    print("|---|---|---|---|")
    for f in FIELDS:
        a, b = med["dram"][f], med["tiered"][f]
        print(f"| {f} | {a:.4g} | {b:.4g} | {b / a:.2f}x |" if a else f"| {f} | {a:.4g} | {b:.4g} | - |")
    t = med["tiered"]
    index_cost = 56 * args.keys / 2**20   # the docs' per-key cost (tiered-storage.md), upper end
    cache_cost = t["cache_rows"] * 8 / 2**20
    bound = _budget(args) / 2**20 + index_cost + cache_cost
    print(f"\ntiered table's RSS (above the process before the table existed): {t['rss_train_mb'] - t['rss_base_mb']:.0f}"
          f" MiB after training (populated in this process), {t['rss_restored_mb'] - t['rss_restored_base_mb']:.0f} MiB "
          f"after a restore in a fresh process; bound: budget {_budget(args) / 2**20:.0f} + index and metadata "
          f"{index_cost:.0f} (56 B/key) + cache bookkeeping {cache_cost:.0f} (8 B/cached row) = {bound:.0f} MiB")
    d = med["dram"]
    print(f"all-DRAM table's RSS: {d['rss_train_mb'] - d['rss_base_mb']:.0f} MiB after training, "
          f"{d['rss_restored_mb'] - d['rss_restored_base_mb']:.0f} MiB after a restore in a fresh process")
    for kind, v in runs.items():
        if not all("restored_bit_exact" in x for x in v):
            continue   # --no-save: nothing restored
        bad = [x for x in v if not x.get("restored_bit_exact")]
        print(f"{kind}: restored sampled rows bit-exact in {len(v) - len(bad)}/{len(v)} runs")


def beyond(args):
    """The larger-than-memory run, one process per phase: train + save, restore + verify, then (--serve)
    serve the checkpoint while its deltas arrive. --phases runs some of them in --work (kept unless the
    run ends with the last phase), so a run can stop after the restore and serve later."""
    phases = args.phases.split(",") if args.phases else ["train-save", "restore"] + (["serve"] if args.serve else [])
    work = args.work or tempfile.mkdtemp(prefix="tiered-beyond-", dir=args.dir)
    os.makedirs(work, exist_ok=True)
    print(_header(args), "; work directory", work, flush=True)
    done = False
    try:
        cfg = _cfg(args, "tiered", "train-save", work)
        cfg.update(extra_deltas=12 if args.serve else 0, serve_windows=2, serve_window_s=20.0, save_rounds=args.rounds,
                   serve_dram_bytes=int(args.serve_dram_fraction * args.keys * args.dim * 4))
        figs, restores = {}, []
        for phase in phases:
            subprocess.run(["df", "-h", work])
            for r in range(args.rounds if phase == "restore" else 1):
                figs[phase] = _run_child(dict(cfg, phase=phase))
                shutil.rmtree(cfg["tier_dir"], ignore_errors=True)
                if phase == "restore":   # each restore against the disk's rate measured right after it
                    restores.append(dict(figs[phase], **_probe(cfg, figs[phase]["full_bytes"])))
                    if not figs[phase].get("restored_bit_exact"):
                        sys.exit("restored rows differ from the saved ones")
            if phase == "train-save":
                _sequential(figs[phase], cfg)
        print(json.dumps(figs))
        _print_sequential(figs.get("train-save", {}), figs.get("restore", {}), restores)
        done = phases[-1] == ("serve" if args.serve else "restore")
    finally:
        subprocess.run(["df", "-h", work])
        if done or not args.phases:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("kept for the next phases:", work)


def add_arguments(ap):
    ap.add_argument("--dim", type=int, default=64, help="ev/beyond: embedding width (Adam: 3x the floats a row)")
    ap.add_argument("--dram-mib", type=float, default=None, help="ev/beyond: the DRAM budget in MiB "
                                                                 "(default: --dram-fraction of the rows)")
    ap.add_argument("--zipf", type=float, default=1.1, help="ev/beyond: the Zipf exponent of the ids")
    ap.add_argument("--batch", type=int, default=4096, help="ev/beyond: training batch")
    ap.add_argument("--warmup", type=int, default=200, help="ev/beyond: untimed training steps first")
    ap.add_argument("--steps", type=int, default=300, help="ev/beyond: timed training steps")
    ap.add_argument("--no-save", action="store_true", help="ev: training and lookups only (no full or delta "
                                                             "save, no restore: the tier file is the only disk use)")
    ap.add_argument("--child-nice", type=int, default=10, help="ev/beyond: how much nicer than this process "
                    "each child runs (the sides, and the sequential probe alike)")
    ap.add_argument("--serve", action="store_true", help="beyond: serve the checkpoint last (predict latency "
                                                         "idle and while deltas apply)")
    ap.add_argument("--phases", default=None, help="beyond: some of train-save,restore,serve (default: all "
                                                   "that apply), in --work, kept until the last phase ran")
    ap.add_argument("--work", default=None, help="beyond: the work directory of --phases")
    ap.add_argument("--serve-dram-fraction", type=float, default=0.1,
                    help="beyond --serve: the server's DRAM budget, a share of the served values' bytes")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    child(json.loads(sys.argv[2]))
