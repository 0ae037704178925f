"""Admission filters and eviction on a long-tailed stream: evstore vs TFRA's restrict policies.

    .venv/bin/python -m bench.tables.bench_filters             # 2M lookups, dim 16 (~3 min)
    .venv/bin/python -m bench.tables.bench_filters --quick     # 400k lookups
    make bench                                          # bench/run.py runs this too

Stream (bench/harness/workload.py zipf_stream): 8192 ids per step, id = step*800 + rank,
rank ~ Zipf(1.1) over 200k ranks: a moving window where popular ids fade and
new ones arrive, most ids are seen once or twice.

Speed: all evstore configurations run the same stream interleaved step by step
in one process (so a slow phase of the shared machine hits them alike), then
all TFRA configurations likewise in one TFRA-venv process. Memory: each
configuration again alone in a fresh process, for its RSS growth. A training
step is lookup -> SGD apply (versions = step); every
--save-every steps a "save": evstore evicts (if it has a policy) and seals +
commits its change sets (what a checkpoint does), TFRA calls
`de.Variable.restrict(num_reserved)` (if it has a policy).

  evstore/none, /counter3, /bloom3      no filter, CounterFilter(3), BloomFilter(3, capacity=500k, fp 1%)
  .../+evict                            the same with GlobalStepEvict(steps_to_live=40; --ttl)
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

from bench.harness.args import add_stream_args
from bench.harness.paths import RESULTS, ROOT
from bench.harness.peers import DEFAULT_VENV, module_cmd
from bench.harness.rss import rss_mib
from bench.harness.workload import zipf_stream

TTL = 40
EV_CONFIGS = ["none", "counter3", "bloom3", "none+evict", "counter3+evict", "bloom3+evict"]
TFRA_CONFIGS = ["none", "frequency", "timestamp"]


def evstore_worker(args):
    """Runs the stream through one EV per configuration in args.config (comma-
    separated), interleaved step by step (each step's batch goes to every EV in
    turn, the order rotating), so a slow phase of the machine hits all alike.
    RSS growth is reported only for a single configuration."""
    import tensorflow as tf
    import evstore
    stream = zipf_stream(args.lookups, args.batch, args.window, args.shift, args.seed)
    configs = args.config.split(",")
    rss0 = rss_mib()
    evs = []
    for cfg in configs:
        name, _, ev_part = cfg.partition("+")
        flt = {"none": None, "counter3": evstore.CounterFilter(3),
               "bloom3": evstore.BloomFilter(3, capacity=args.bloom_capacity, fp_rate=0.01)}[name]
        evict = evstore.GlobalStepEvict(args.ttl) if ev_part == "evict" else None
        evs.append(evstore.EmbeddingVariable(f"bench_{len(evs)}", args.dim, filter=flt, evict=evict))
    lr = tf.constant(0.1)
    looks = [[] for _ in evs]
    t_step = [0.0] * len(evs)
    half = [None] * len(evs)
    for step, ids in enumerate(stream):
        ids_t = tf.constant(ids)
        for j in range(len(evs)):
            c = (j + step) % len(evs)
            ev = evs[c]
            t0 = time.perf_counter()
            emb = evstore.embedding_lookup(ev, ids_t)
            emb.numpy()
            t1 = time.perf_counter()
            evstore.training.sparse_apply_sgd(ev, tf.IndexedSlices(emb * 1e-3, ids_t), lr, step)
            if step % args.save_every == 0 and ev.evict_policies:
                ev.evict(step).numpy()
            t2 = time.perf_counter()
            looks[c].append(t1 - t0)
            t_step[c] += t2 - t0
            if step % args.save_every == 0:
                ev.commit_export(ev.begin_export()[0])   # a save seals and drops the change sets
            if step == len(stream) // 2:
                half[c] = (ev.stats()["bytes"], rss_mib() - rss0)
    n = args.batch * len(stream)
    out = []
    for c, ev in enumerate(evs):
        st = ev.stats()
        live = st["admitted"]
        single = len(evs) == 1
        out.append({"system": "evstore", "config": configs[c], "lookup_keys_s": args.batch / statistics.median(looks[c]),
                    "step_keys_s": n / t_step[c], "live": live, "index_entries": st["size"],
                    "filtered": st["filtered"], "evicted": st["evicted"], "free_rows": st["free_rows"],
                    "bytes": st["bytes"], "filter_bytes": st["filter_bytes"], "bytes_per_live": st["bytes"] / max(live, 1),
                    "bytes_mib_half": half[c][0] / 2**20, "bytes_mib_end": st["bytes"] / 2**20,
                    "rss_per_live": (rss_mib() - rss0) * 2**20 / max(live, 1) if single else None,
                    "rss_mib_half": half[c][1] if single else None, "rss_mib_end": rss_mib() - rss0 if single else None})
    return out


def run_worker(cmd, log_path, timeout):
    with open(log_path, "w") as log:
        try:
            r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out; see {log_path}"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("{", "["))]
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
           f"times. GlobalStepEvict(steps_to_live={meta['ttl']}); BloomFilter capacity {meta.get('bloom_capacity')}; "
           f"TFRA restrict(num_reserved={meta.get('reserve')}).\n",
           "| system / config | lookup M keys/s | vs evstore/none | step M keys/s | live keys "
           "| index entries "
           "| free rows | bytes / live key | table MiB at 50% -> 100% | RSS growth / live key "
           "| RSS MiB at 50% -> 100% | evicted |",
           "|---" * 12 + "|"]
    base = next((r for r in results if r.get("system") == "evstore" and r.get("config") == "none"), {})
    for r in results:
        if "error" in r:
            out.append(f"| {r.get('system')}/{r.get('config')} | error: {r['error']} |" + " |" * 10)
            continue
        rel = (f"{r['lookup_keys_s'] / base['lookup_keys_s']:.2f}x" if base.get("lookup_keys_s") else "n/a")
        out.append(f"| {r['system']}/{r['config']} | {fmt(r['lookup_keys_s'], 2, 1e6)} | {rel} | "
                   f"{fmt(r['step_keys_s'], 2, 1e6)} | {r['live']} | {r.get('index_entries', 'n/a')} | "
                   f"{r.get('free_rows', 'n/a')} | {fmt(r.get('bytes_per_live'))} | "
                   f"{fmt(r.get('bytes_mib_half'))} -> {fmt(r.get('bytes_mib_end'))} | {fmt(r.get('rss_per_live'))} | "
                   f"{fmt(r.get('rss_mib_half'))} -> {fmt(r.get('rss_mib_end'))} | {r.get('evicted') or 'n/a'} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_stream_args(ap)
    ap.add_argument("--quick", action="store_true", help="400k lookups")
    ap.add_argument("--worker", choices=["evstore"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--peer-python", default=os.path.join(DEFAULT_VENV, "bin", "python"),
                    help="python of the TFRA venv (default .peer-tfra/bin/python); missing: TFRA is skipped")
    ap.add_argument("--ttl", type=int, default=TTL, help=f"GlobalStepEvict steps_to_live (default {TTL}; quick 10)")
    ap.add_argument("--bloom-capacity", type=int, default=500_000, help="BloomFilter capacity (default 500k)")
    ap.add_argument("--no-tfra", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.lookups = min(args.lookups, 400_000)
        args.ttl = min(args.ttl, 10)
    if args.worker:
        print(json.dumps(evstore_worker(args)), flush=True)   # a list, one entry per configuration
        return
    import numpy as np
    stream = zipf_stream(args.lookups, args.batch, args.window, args.shift, args.seed)
    _, counts = np.unique(np.concatenate(stream), return_counts=True)
    logdir = os.path.join(args.out_dir, "logs")
    os.makedirs(logdir, exist_ok=True)
    # Speed: all evstore configurations interleaved in one process, all TFRA
    # policies interleaved in another (run right after). Memory (RSS growth):
    # one process per configuration.
    def ev_cmd(cfgs):
        return (module_cmd(__spec__.name) + ["--worker", "evstore", "--config", ",".join(cfgs),
                 "--bloom-capacity", str(args.bloom_capacity), "--ttl", str(args.ttl)] + stream_args(args))

    print("evstore: all configurations interleaved (speed) ...", flush=True)
    speed = run_worker(ev_cmd(EV_CONFIGS), os.path.join(logdir, "filters_evstore_speed.log"), args.timeout)
    speed = speed if isinstance(speed, list) else [dict(speed, config=c) for c in EV_CONFIGS]
    reserve = next((r.get("live") for r in speed if r.get("config") == "none+evict"), None) or args.window
    tfra = not args.no_tfra and os.path.exists(args.peer_python)

    def tfra_cmd(policies):
        return module_cmd("bench.peers.peer_tfra_filters", python=args.peer_python) + ["--policy", ",".join(policies),
                "--reserve", str(reserve)] + stream_args(args)

    if tfra:
        print("tfra: all policies interleaved (speed) ...", flush=True)
        t = run_worker(tfra_cmd(TFRA_CONFIGS), os.path.join(logdir, "filters_tfra_speed.log"), args.timeout)
        speed += t if isinstance(t, list) else [dict(t, system="tfra", config=c) for c in TFRA_CONFIGS]
    memory = {}
    for cfg in EV_CONFIGS:
        print(f"evstore/{cfg} alone (RSS) ...", flush=True)
        r = run_worker(ev_cmd([cfg]), os.path.join(logdir, f"filters_evstore_{cfg}.log"), args.timeout)
        memory[("evstore", cfg)] = r[0] if isinstance(r, list) else r
    for cfg in TFRA_CONFIGS if tfra else []:
        print(f"tfra/{cfg} alone (RSS) ...", flush=True)
        r = run_worker(tfra_cmd([cfg]), os.path.join(logdir, f"filters_tfra_{cfg}.log"), args.timeout)
        memory[("tfra", cfg)] = r[0] if isinstance(r, list) else r
    results = []
    for r in speed:
        sys_ = r.get("system", "evstore")
        m = memory.get((sys_, r.get("config")), {})
        results.append(dict(r, system=sys_, rss_per_live=m.get("rss_per_live"), rss_mib_half=m.get("rss_mib_half"),
                            rss_mib_end=m.get("rss_mib_end"), alone=m))
    meta = {"command": " ".join([os.path.relpath(sys.executable, ROOT), "-m", __spec__.name] + sys.argv[1:]), "lookups": args.lookups,
            "batch": args.batch, "dim": args.dim, "window": args.window, "shift": args.shift,
            "save_every": args.save_every, "distinct_ids": int(counts.size),
            "ids_seen_3plus": int((counts >= 3).sum()), "reserve": reserve,
            "bloom_capacity": args.bloom_capacity, "ttl": args.ttl}
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
