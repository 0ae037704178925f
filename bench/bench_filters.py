"""Admission filters and eviction on a long-tailed stream: evstore vs TFRA's restrict policies.

    .venv/bin/python bench/bench_filters.py             # 2M lookups, dim 16 (~3 min)
    .venv/bin/python bench/bench_filters.py --quick     # 400k lookups
    make bench                                          # bench/run.py runs this too

Stream (bench/common.py zipf_stream): 8192 ids per step, id = step*800 + rank,
rank ~ Zipf(1.1) over 200k ranks: a moving window where popular ids fade and
new ones arrive, most ids are seen once or twice.

Every configuration runs the same stream in a fresh process (so RSS growth is
its own): a training step is lookup -> SGD apply (versions = step); every
--save-every steps a "save": evstore evicts (if it has a policy) and seals +
commits its change sets (what a checkpoint does), TFRA calls
`de.Variable.restrict(num_reserved)` (if it has a policy).

  evstore/none, /counter3, /bloom3      no filter, CounterFilter(3), BloomFilter(3, capacity=500k, fp 1%)
  .../+evict                            the same with GlobalStepEvict(steps_to_live=40)
  tfra/none                             de.Variable, no policy
  tfra/frequency, tfra/timestamp        de.FrequencyRestrictPolicy / TimestampRestrictPolicy,
                                        restrict(num_reserved = evstore/none+evict's live keys)

Different contracts: evstore's filters decide *admission* (a rare id never gets a row) and its
eviction removes ids *by age or weight* whatever the table size; TFRA's restrict policies admit
every id, keep a per-key status (a second hash table: count or timestamp) and, when called,
*trim the table to a size* by dropping the lowest-count / oldest ids (a top-k over the status table).

Measured per configuration: lookup keys/s (median over the steps; evstore: EvFindOrInsert with its filter; TFRA:
`de.Variable.lookup` plus the policy's status update `apply_update`, the per-batch work the
policy adds), step keys/s (whole stream: lookup + apply + the saves' evict/restrict, without evstore's
seal/commit), live keys at the end (admitted rows; TFRA: table size), bytes per live key
(evstore `stats()["bytes"]` = index + metadata + rows + filter counters, over live keys), and RSS
growth of the process per live key (both).
"""
import argparse
import json
import statistics
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import add_stream_args, rss_mib, zipf_stream  # noqa: E402

TTL = 40
EV_CONFIGS = ["none", "counter3", "bloom3", "none+evict", "counter3+evict", "bloom3+evict"]
TFRA_CONFIGS = ["none", "frequency", "timestamp"]


def evstore_worker(args):
    import tensorflow as tf
    import evstore
    stream = zipf_stream(args.lookups, args.batch, args.window, args.shift, args.seed)
    name, _, ev_part = args.config.partition("+")
    flt = {"none": None, "counter3": evstore.CounterFilter(3),
           "bloom3": evstore.BloomFilter(3, capacity=args.bloom_capacity, fp_rate=0.01)}[name]
    evict = evstore.GlobalStepEvict(TTL) if ev_part == "evict" else None
    rss0 = rss_mib()
    ev = evstore.EmbeddingVariable("bench", args.dim, filter=flt, evict=evict)
    lr = tf.constant(0.1)
    looks, t_step = [], 0.0
    evicted = 0
    for step, ids in enumerate(stream):
        ids_t = tf.constant(ids)
        t0 = time.perf_counter()
        emb = evstore.embedding_lookup(ev, ids_t)
        emb.numpy()
        t1 = time.perf_counter()
        evstore.training.sparse_apply_sgd(ev, tf.IndexedSlices(emb * 1e-3, ids_t), lr, step)
        if step % args.save_every == 0 and evict is not None:
            evicted += int(ev.evict(step))
        t2 = time.perf_counter()
        looks.append(t1 - t0)
        t_step += t2 - t0
        if step % args.save_every == 0:
            ev.commit_export(ev.begin_export()[0])   # a save seals and drops the change sets
    st = ev.stats()
    n = args.batch * len(stream)
    live = st["admitted"]
    return {"system": "evstore", "config": args.config, "lookup_keys_s": args.batch / statistics.median(looks),
            "step_keys_s": n / t_step,
            "live": live, "index_entries": st["size"], "filtered": st["filtered"], "evicted": st["evicted"],
            "free_rows": st["free_rows"], "bytes": st["bytes"], "filter_bytes": st["filter_bytes"],
            "bytes_per_live": st["bytes"] / max(live, 1),
            "rss_per_live": (rss_mib() - rss0) * 2**20 / max(live, 1), "distinct_ids": None}


def run_worker(cmd, log_path, timeout):
    with open(log_path, "w") as log:
        try:
            r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out; see {log_path}"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}; see {log_path}"}
    return json.loads(lines[-1])


def stream_args(args):
    return ["--lookups", str(args.lookups), "--batch", str(args.batch), "--window", str(args.window),
            "--shift", str(args.shift), "--dim", str(args.dim), "--save-every", str(args.save_every),
            "--seed", str(args.seed)]


def fmt(x, p=1, scale=1.0):
    return "n/a" if x is None else f"{x / scale:.{p}f}"


def render(results, meta):
    out = [f"`{meta['command']}` — {meta['lookups']} lookups, batch {meta['batch']}, dim {meta['dim']}, "
           f"window {meta['window']} Zipf(1.1) ranks moving {meta['shift']} ids/step, save every "
           f"{meta['save_every']} steps; {meta['distinct_ids']} distinct ids, {meta['ids_seen_3plus']} seen 3+ "
           f"times. GlobalStepEvict(steps_to_live={TTL}); BloomFilter capacity {meta.get('bloom_capacity')}; "
           f"TFRA restrict(num_reserved={meta.get('reserve')}).\n",
           "| system / config | lookup M keys/s | vs evstore/none | step M keys/s | live keys | index entries "
           "| bytes / live key | RSS growth / live key | evicted |",
           "|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in results if r.get("system") == "evstore" and r.get("config") == "none"), {})
    for r in results:
        if "error" in r:
            out.append(f"| {r.get('system')}/{r.get('config')} | error: {r['error']} | | | | | | | |")
            continue
        rel = (f"{r['lookup_keys_s'] / base['lookup_keys_s']:.2f}x" if base.get("lookup_keys_s") else "n/a")
        out.append(f"| {r['system']}/{r['config']} | {fmt(r['lookup_keys_s'], 2, 1e6)} | {rel} | "
                   f"{fmt(r['step_keys_s'], 2, 1e6)} | {r['live']} | {r.get('index_entries', 'n/a')} | "
                   f"{fmt(r.get('bytes_per_live'))} | {fmt(r.get('rss_per_live'))} | {r.get('evicted', 'n/a')} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_stream_args(ap)
    ap.add_argument("--quick", action="store_true", help="400k lookups")
    ap.add_argument("--worker", choices=["evstore"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--peer-python", default=os.path.join(ROOT, ".peer-tfra", "bin", "python"),
                    help="python of the TFRA venv (default .peer-tfra/bin/python); missing: TFRA is skipped")
    ap.add_argument("--bloom-capacity", type=int, default=500_000, help="BloomFilter capacity (default 500k)")
    ap.add_argument("--no-tfra", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.quick:
        args.lookups = min(args.lookups, 400_000)
    if args.worker:
        print(json.dumps(evstore_worker(args)), flush=True)
        return
    import numpy as np
    stream = zipf_stream(args.lookups, args.batch, args.window, args.shift, args.seed)
    _, counts = np.unique(np.concatenate(stream), return_counts=True)
    logdir = os.path.join(args.out_dir, "logs")
    os.makedirs(logdir, exist_ok=True)
    results = []
    for cfg in EV_CONFIGS:
        print(f"evstore/{cfg} ...", flush=True)
        cmd = ([sys.executable, os.path.abspath(__file__), "--worker", "evstore", "--config", cfg,
                "--bloom-capacity", str(args.bloom_capacity)] + stream_args(args))
        results.append(dict(run_worker(cmd, os.path.join(logdir, f"filters_evstore_{cfg}.log"), args.timeout),
                            system="evstore", config=cfg))
    reserve = next((r.get("live") for r in results if r["config"] == "none+evict"), None) or args.window
    if not args.no_tfra and os.path.exists(args.peer_python):
        for cfg in TFRA_CONFIGS:
            print(f"tfra/{cfg} ...", flush=True)
            cmd = [args.peer_python, os.path.join(HERE, "peer_tfra_filters.py"), "--policy", cfg,
                   "--reserve", str(reserve)] + stream_args(args)
            results.append(dict(run_worker(cmd, os.path.join(logdir, f"filters_tfra_{cfg}.log"), args.timeout),
                                system="tfra", config=cfg))
    meta = {"command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv), "lookups": args.lookups,
            "batch": args.batch, "dim": args.dim, "window": args.window, "shift": args.shift,
            "save_every": args.save_every, "distinct_ids": int(counts.size),
            "ids_seen_3plus": int((counts >= 3).sum()), "reserve": reserve,
            "bloom_capacity": args.bloom_capacity}
    md = render(results, meta)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = os.path.join(args.out_dir, f"filters-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
    print(f"results: {os.path.relpath(base, ROOT)}.json / .md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
