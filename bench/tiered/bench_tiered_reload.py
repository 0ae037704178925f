"""RSS of a tiered server over time while it loads a full and then reloads a new chain while serving
(docs/guides/tiered-storage.md, "Memory during a reload").

    .venv/bin/python -m bench.tiered.bench_tiered_reload                       # 2M keys x 64, ~2 minutes
    .venv/bin/python -m bench.tiered.bench_tiered_reload --keys 4000000 --view int8

The writer (one all-DRAM EV, the rows' Zipf frequencies as bench_tiered_serving gives them) saves
a full (chain 1) and then a second full of new values (chain 2). A ServingModel on the
`tables="evstore"` export with `TieredStorage(dram_bytes = --dram-fraction of the float32 rows'
bytes)` loads chain 1, serves predicts (a thread, batch 1, Zipf ids) and then reloads chain 2 while
serving. A thread samples VmRSS every 10 ms. Reported: RSS before the model, after the load, the
peak during the load and during the reload, the tables' own DRAM (`stats()`: index, per-row
metadata, cache slots) and the bound the guide states, (budget + per-key bytes x keys) x 2 tables +
the loader's buffers; `--trace FILE` writes the (seconds, MiB, phase) samples.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.rss import malloc_trim, rss_mib, rss_split_mib
from bench.tiered.bench_tiered_serving import CHUNK, IDS, Feed, build, freqs, make_keys

MIB = 2 ** 20
SLOT_CHUNK = 4096            # slots per slot array chunk (tiered_store.h kSlotChunk)
SLOT_INFO_BYTES = 8          # per slot bookkeeping (tiered_store.h SlotInfo)
# The process's own allocations beside the tables while a reload runs and predicts are served (Python
# objects, TensorFlow's eager tensors, the manifest, the stager; pages of libraries first touched): twice the
# 8.4 MiB measured at 2M keys (RssFile +5.8, anonymous memory beyond the tables' +2.6; BENCHMARKS.md).
PROCESS_ALLOWANCE_MIB = 16


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Sampler:
    """VmRSS (RssAnon, RssFile) every `interval` s, labelled with the phase set last."""

    def __init__(self, interval=0.01):
        self.interval, self.phase, self.samples = interval, "start", []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, *rss_split_mib(), self.phase))
            self._stop.wait(self.interval)

    def peak(self, phase, part=1):
        """The phase's largest VmRSS (part 1), RssAnon (2) or RssFile (3)."""
        return max((x[part] for x in self.samples if x[-1] == phase), default=0.0)

    def stop(self):
        self._stop.set()
        self._t.join()


def write_fulls(workdir, keys, dim, zipf, seed, view):
    """Exports and a source root holding two chains: a full, then a full of new values."""
    import checkpoint
    from serving_loader import export_serving_model
    from bench.tiered.bench_tiered_serving import signature

    model, ev = build(dim)
    tables = os.path.join(workdir, "export-evstore")
    export_serving_model(model, tables, input_signature=signature(), tables="evstore")
    mgr = checkpoint.CheckpointManager(os.path.join(workdir, "source"), model, serving_view=view)
    rng = np.random.default_rng(seed)
    for _ in range(2):
        for s in range(0, keys, CHUNK):
            e = min(keys, s + CHUNK)
            idx = np.arange(s, e)
            ev.load(make_keys(idx), rng.standard_normal((e - s, dim), dtype=np.float32) * 0.1,
                    freqs=freqs(idx, zipf))
        mgr.save_full()
    root = mgr.root
    del model, ev, mgr
    return tables, root


def bound_parts(st, dram_bytes, dim, view):
    """The guide's bound on a reload's RSS above the RSS after the load, by part (MiB), from the
    served table's stats (`st`, after its load: the new chain has the same keys) and the budget."""
    from checkpoint.bundle import CHUNK_ROWS
    from serving_loader.ev_table import loading_dram_bytes

    slot = dram_bytes // max(1, st["cache_capacity"])        # bytes per cache slot (row + bookkeeping)
    row = slot - SLOT_INFO_BYTES
    chunk = SLOT_CHUNK * slot                                  # slot arrays grow a chunk at a time
    served_slots = st["row_bytes"]                             # the served table's slot arrays now
    loader = 2 * CHUNK_ROWS * (row + 3 * 8)                    # two chunks' rows, keys, versions, frequencies
                                                               # (the next one is read while one is imported)
    if view:                                                   # and its codes (and scales) read from the view
        loader += CHUNK_ROWS * (dim * {"int8": 1}.get(view, 2) + 4)
    return {"replacement_index": st["index_bytes"] / MIB, "replacement_meta": st["meta_bytes"] / MIB,
            "replacement_cache": (loading_dram_bytes(dram_bytes) + chunk) / MIB,
            "served_cache_growth": max(0, dram_bytes + chunk - served_slots) / MIB,
            "loader_buffers": loader / MIB, "process_allowance": PROCESS_ALLOWANCE_MIB}


def run(keys=2_000_000, dim=64, dram_fraction=0.1, zipf=1.1, seed=0, view=None, workdir=None, trace=None):
    import logging

    import evstore
    from serving_loader import ServingModel

    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="treload-bench-")
    try:
        tables, source = write_fulls(workdir, keys, dim, zipf, seed, view)
        malloc_trim()
        feed = Feed(source, os.path.join(workdir, "served"))
        feed.next()
        dram_bytes = int(keys * dim * 4 * dram_fraction)
        sampler = Sampler()
        rss0 = rss_mib()
        sampler.phase = "load"
        t0 = time.perf_counter()
        sm = ServingModel(tables, os.path.join(workdir, "served"),
                          storage=evstore.TieredStorage(dram_bytes=dram_bytes, path=os.path.join(workdir, "tier")))
        load_s = time.perf_counter() - t0
        sampler.phase = "serving"
        time.sleep(0.5)
        after_load, after_load_anon, after_load_file = rss_split_mib()
        fields = ("index_bytes", "meta_bytes", "row_bytes", "admitted", "cache_capacity", "cache_rows")
        st = sm.publisher.table_stats(fields)["emb"]
        parts = bound_parts(st, dram_bytes, dim, view)
        stop, rng = threading.Event(), np.random.default_rng(seed + 1)

        def predicts():
            while not stop.is_set():
                sm.run(sm.signature, {"ids": make_keys((rng.zipf(zipf, size=(1, IDS)) - 1) % keys)})

        p = threading.Thread(target=predicts)
        p.start()
        time.sleep(1.0)
        feed.next()   # the second chain's full: a reload while serving
        sampler.phase = "reload"
        t0 = time.perf_counter()
        sm.poll()
        reload_s = time.perf_counter() - t0
        sampler.phase = "served"
        st2 = sm.publisher.table_stats(fields)["emb"]
        time.sleep(0.5)
        stop.set()
        p.join()
        sampler.stop()
        table_mib = (st["index_bytes"] + st["meta_bytes"] + st["row_bytes"]) / MIB
        out = dict(keys=keys, dim=dim, view=view or "float32", dram_mib=dram_bytes / MIB, load_s=load_s,
                   reload_s=reload_s, rss_before_mib=rss0, rss_after_load_mib=after_load,
                   peak_load_mib=sampler.peak("load"), peak_reload_mib=sampler.peak("reload"),
                   rss_after_reload_mib=rss_mib(), table_mib=table_mib,
                   index_mib=st["index_bytes"] / MIB, meta_mib=st["meta_bytes"] / MIB, row_mib=st["row_bytes"] / MIB,
                   cache_capacity=st.get("cache_capacity"), served=sm.version)
        out["reload_extra_mib"] = out["peak_reload_mib"] - out["rss_after_load_mib"]
        out["reload_extra_anon_mib"] = sampler.peak("reload", 2) - after_load_anon
        out["reload_extra_file_mib"] = sampler.peak("reload", 3) - after_load_file
        out["served_cache_rows"] = st["cache_rows"]
        out["replacement_mib"] = {k.replace("_bytes", ""): st2[k] / MIB for k in ("index_bytes", "meta_bytes", "row_bytes")}
        out["replacement_cache_rows"] = st2["cache_rows"]
        out["bound_parts_mib"] = parts
        out["bound_mib"] = sum(parts.values())
        out["margin_mib"] = out["bound_mib"] - out["reload_extra_mib"]
        if trace:
            with open(trace, "w") as f:
                json.dump(sampler.samples, f)
        sm.close()
        return out
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dram-fraction", type=float, default=0.1)
    ap.add_argument("--view", choices=["bfloat16", "float16", "int8"], default=None)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--trace", default=None, help="write the RSS samples (s, MiB, phase) as JSON here")
    a = ap.parse_args(argv)
    out = run(a.keys, a.dim, a.dram_fraction, view=a.view, workdir=a.dir, trace=a.trace)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
