"""Rollback cost: time and extra resident memory of ServingModel.rollback.

    .venv/bin/python -m bench.serving.bench_rollback [--keys 500000] [--dim 16] [--deltas 3] [--delta-rows 50000]

The model and data are bench_serving's (one EV "emb", keys from bench/harness/workload.py):
a full of --keys rows, then --deltas deltas of --delta-rows changed rows each.
A ServingModel serves the newest; then it is rolled back to the second-newest
commit (a chain of the full and --deltas - 1 deltas is staged and published),
resumed (back to the newest: one delta applied), and for comparison a second
ServingModel of the same export and root is loaded (what a reload-based server
such as TF Serving holds while a new version loads). Extra RSS: peak during the
call minus RSS before it (bench/harness/rss.py: VmHWM and a 2 ms VmRSS sampler).
Also the latency of back-to-back batch-1 predictions on a second thread: idle
for 1 s, and during the rollback (its longest is how long the publish blocks
predictions). Prints one JSON line.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.serving.bench_serving import IDS_PER_EXAMPLE, make_job, touch
from bench.harness.rss import PeakRss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--deltas", type=int, default=3)
    ap.add_argument("--delta-rows", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from serving_loader import ServingModel

    work = tempfile.mkdtemp(prefix="bench-rollback-")
    model, ev, mgr, export = make_job(work, args.keys, args.dim, args.seed)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.deltas):
        touch(ev, args.keys, args.delta_rows, 0, args.dim, rng)
        mgr.save_delta()
    newest = mgr.last_committed.seq
    sm = ServingModel(export, mgr.root)
    assert sm.version == newest
    with PeakRss() as pin:
        sm.pin()
    ids = {"ids": np.arange(IDS_PER_EXAMPLE, dtype=np.int64)[None, :]}
    idle = _predict_latencies(sm, ids, lambda: time.sleep(1.0))
    with PeakRss() as rb:
        t = time.perf_counter()
        during = _predict_latencies(sm, ids, lambda: sm.rollback(newest - 1))
        rollback_s = time.perf_counter() - t
    assert sm.version == newest - 1 and sm.pinned
    with PeakRss() as rs:
        t = time.perf_counter()
        sm.resume()
        resume_s = time.perf_counter() - t
    assert sm.version == newest
    with PeakRss() as second:
        t = time.perf_counter()
        other = ServingModel(export, mgr.root)
        second_s = time.perf_counter() - t
    assert other.version == newest
    table_mib = args.keys * args.dim * 4 / 2**20
    staged_mib = (args.keys + (args.deltas - 1) * args.delta_rows) * (args.dim * 4 + 8) / 2**20
    print(json.dumps({
        "keys": args.keys, "dim": args.dim, "deltas": args.deltas, "delta_rows": args.delta_rows,
        "table_values_mib": round(table_mib, 1), "staged_chain_tensors_mib": round(staged_mib, 1),
        "pin_extra_mib": round(pin.extra_mib, 1),
        "rollback_s": round(rollback_s, 3), "rollback_extra_mib": round(rb.extra_mib, 1),
        "resume_s": round(resume_s, 3), "resume_extra_mib": round(rs.extra_mib, 1),
        "second_model_load_s": round(second_s, 3), "second_model_load_extra_mib": round(second.extra_mib, 1),
        "rss_before_rollback_mib": round(rb.start_mib, 1),
        "predict_ms_idle": {"p50": _ms(idle, 50), "max": _ms(idle, 100)},
        "predict_ms_during_rollback": {"p50": _ms(during, 50), "max": _ms(during, 100), "n": len(during)}}))


def _predict_latencies(sm, inputs, action):
    """Latencies of back-to-back batch-1 predictions on another thread while `action` runs."""
    import threading
    stop, lat = threading.Event(), []

    def loop():
        while not stop.is_set():
            t = time.perf_counter()
            sm.predict(inputs)
            lat.append(time.perf_counter() - t)

    th = threading.Thread(target=loop)
    th.start()
    try:
        action()
    finally:
        stop.set()
        th.join()
    return lat


def _ms(xs, q):
    return round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None


if __name__ == "__main__":
    main()
