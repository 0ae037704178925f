"""Where a sharded front's request goes: its latency back to back and open loop, and the CPU profile of
its parts (the lookup_keys call, the fan-out to the shards, the wait for their answers, the rows' insert
into its cache, the signature).

    nice -n 5 .venv/bin/python -m bench.serving.bench_front_profile --shards 2     # ~2 minutes

A model of --keys rows x --dim (bench_sharded_serving's), served by --shards `evstore serve --shard`
processes and a FrontModel in this process; requests of batch --batch with ids drawn uniformly (so
nearly every request asks the shards: the front's per-version cache seldom holds them). Reported:
p50 / p99 back to back and at --hz open loop; per request, the CPU seconds cProfile counts in each
part (cumulative, back to back). The last line is JSON.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.timing import open_loop
from bench.harness.workload import make_keys
from bench.serving.bench_sharded_serving import ShardProcess, write_chain
from bench.tiered.bench_tiered_serving import IDS, Feed

PARTS = {   # part -> (file suffix, function name) whose cumulative time is the part's
    "lookup_keys + signature (TF calls)": ("flat_call.py", "__call__"),
    "fan-out: Fleet.lookup, all of it": ("shard_client.py", "lookup"),
    "waiting for the shards' answers": ("_channel.py", "result"),
    "starting the calls (grpc futures)": ("_channel.py", "future"),
    "rows into the front's cache": ("ev_table.py", "insert"),
    "routing (shard_index)": ("sharded.py", "shard_index"),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--hz", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=15.0, help="open-loop window")
    args = ap.parse_args()
    import logging

    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    from serving_loader.front import FrontModel

    d = tempfile.mkdtemp(prefix="front-profile-")
    export, source = write_chain(d, args.shards, args.keys, args.dim, 1, 100, 1.1, 0)
    feed = Feed(source, os.path.join(d, "root"))
    while feed.next():
        pass
    shards = [ShardProcess(export, feed.dest, i, args.shards, args.keys * args.dim * 4 // 10 // args.shards, d,
                           os.path.join(d, f"shard{i}.log")) for i in range(args.shards)]
    front = FrontModel(export, feed.dest, [s.address for s in shards])
    rng = np.random.default_rng(1)

    def req():
        return {"ids": make_keys(rng.integers(0, args.keys, size=(args.batch, IDS)))}

    try:
        for _ in range(200):
            front.run(front.signature, req())
        lat = []
        prof = cProfile.Profile()
        for _ in range(args.requests):
            x = req()
            t = time.perf_counter()
            prof.enable()
            front.run(front.signature, x)
            prof.disable()
            lat.append(time.perf_counter() - t)
        stats = pstats.Stats(prof).stats
        parts = {}
        for name, (suffix, fn) in PARTS.items():
            parts[name] = sum(v[3] for (f, _, func), v in stats.items() if f.endswith(suffix) and func == fn)
        whole = sum(v[3] for (f, _, func), v in stats.items() if f.endswith("model.py") and func == "run")
        open_lat, _ = open_loop(args.seconds, args.hz, req, lambda x: front.run(front.signature, x))
        out = {"shards": args.shards, "batch": args.batch, "load": os.getloadavg()[0],
               "back_to_back_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
               "back_to_back_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
               "open_loop_hz": args.hz, "open_loop_p50_ms": round(float(np.percentile(open_lat, 50)) * 1e3, 3),
               "open_loop_p99_ms": round(float(np.percentile(open_lat, 99)) * 1e3, 3),
               "profiled_ms_per_request": round(whole / args.requests * 1e3, 3),
               "parts_ms_per_request": {k: round(v / args.requests * 1e3, 3) for k, v in parts.items()}}
        for k, v in out["parts_ms_per_request"].items():
            log(f"{k}: {v} ms")
        log(f"back to back p50 {out['back_to_back_p50_ms']} ms; at {args.hz}/s p50 {out['open_loop_p50_ms']} ms")
        print(json.dumps(out))
    finally:
        front.close()
        for s in shards:
            s.stop()


if __name__ == "__main__":
    main()
