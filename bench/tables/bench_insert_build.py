"""New-key inserts, amortized: evstore and TF's DenseHashTable each built from empty to --keys keys.

    .venv/bin/python -m bench.tables.bench_insert_build --keys 1000000 --dim 64
    .venv/bin/python -m bench.tables.bench_insert_build --keys 10000000 --dim 16 --rounds 2

Why this and not only bench_lookup's insert phase: that phase inserts 20 batches
of new keys into tables already holding --keys keys and takes the median batch.
`DenseHashTable` grows by doubling when a batch would take it over 0.8 of its
buckets; the doubling allocates the new bucket arrays, writes every bucket (the
memory's first touch) and rehashes every key, all inside one `insert`. That one
batch is never the median, and at 10M keys it falls outside the 20 batches
altogether, so the median batch touches no new memory. evstore grows in small
steps (a 65,536-row block, a 1.25x index segment) and every batch pays its share,
including the first touch of the rows it fills. The median therefore compares
evstore's whole cost with the part of DenseHashTable's cost that excludes its
growth. On this VM a page touched for the first time costs far more than a
write to a mapped one (the host backs it then), so that part is most of the cost.

Here both tables start empty, unsized (TF's default 131,072 buckets; evstore's
defaults) and receive the same batches of never-seen keys until they hold
--keys keys, batch by batch in turns (order alternating). Every batch is timed,
the growing ones included: the rate is keys / the sum of all batches' time,
in wall seconds and in CPU seconds of the whole process (every thread:
evstore's block-reserve thread and TF's pool threads included; prefer CPU
where the machine's load varies). The interpreter's garbage collector is off
while batches are timed (build_batches). Each side does what its training path does:
evstore EvFindOrInsert (each new key gets an index entry, its version and
frequency, a dirty mark and a row from the initializer bank, and every row is
copied into the op's output tensor, which a training step feeds to the model);
DenseHashTable.insert of the same keys with supplied rows (no output).
The output stays a tensor: `.numpy()` would add a copy that is neither table's
work (TensorFlow's EagerTensor.numpy() copies, and numpy advises an array of
4 MiB or more for huge pages, so every batch faulted fresh huge pages for it).

Memory: evstore's bytes per key from its stats(); DenseHashTable's from TF's
growth rule (buckets double from 131,072 while entries + batch > 0.8 x buckets;
each bucket holds an int64 key and dim float32 values), checked against
size(). --rounds N builds N pairs of fresh tables, one pair at a time.
--systems evstore (or dense_hash) builds one table alone: `make bench` runs a
configuration too large for one process so, one table per process, and pairs
the processes of a round (bench/tables/solo_runs.py: build_solo).
Prints a table and one JSON line (the last line of stdout).
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

from bench.harness.args import add_numbers
from bench.harness.rss import guard_available_memory, hwm_mib, rss_mib
from bench.harness.workload import make_keys

TF_INITIAL_BUCKETS = 131072  # tf.lookup.experimental.DenseHashTable's default initial_num_buckets
TF_MAX_LOAD = 0.8            # and its max_load_factor
SYSTEMS = ("evstore", "dense_hash")


def dense_hash_buckets(keys, batch):
    """DenseHashTable's bucket count after inserting `keys` new keys in batches of `batch` (TF's rule)."""
    buckets, size = TF_INITIAL_BUCKETS, 0
    while size < keys:
        n = min(batch, keys - size)
        while size + n > buckets * TF_MAX_LOAD:
            buckets *= 2
        size += n
    return buckets


def build_round(args, tf, ops, evstore, r):
    """One table of each of args.systems built from empty, batch by batch in turns; returns per-system totals."""
    run, ev, dht = {}, None, None
    if "evstore" in args.systems:
        ev = evstore.EmbeddingVariable(f"build{r}", dim=args.dim, key_dtype=tf.int64)
        no_proxy = tf.zeros([0])
        run["evstore"] = lambda k: ops.ev_find_or_insert(ev.resource_handle, k, no_proxy, dim=args.dim)
    if "dense_hash" in args.systems:
        dht = tf.lookup.experimental.DenseHashTable(key_dtype=tf.int64, value_dtype=tf.float32,
                                                    default_value=tf.zeros([args.dim]), empty_key=-1, deleted_key=-2)
        supplied = tf.random.normal([args.batch, args.dim], stddev=0.01)
        run["dense_hash"] = lambda k: dht.insert(k, supplied[:k.shape[0]])
    tot = {s: {"wall_s": 0.0, "cpu_s": 0.0, "batches_s": []} for s in run}
    build_batches(args, tf, run, tot)
    if "evstore" in run:
        st = ev.stats()
        tot["evstore"]["bytes_per_key"] = (st["index_bytes"] + st["meta_bytes"] + st["row_bytes"]) / max(1, st["size"])
        tot["evstore"]["size"] = st["size"]
    if "dense_hash" in run:
        size = int(dht.size().numpy())
        buckets = dense_hash_buckets(args.keys, args.batch)
        tot["dense_hash"]["bytes_per_key"] = buckets * (8 + 4 * args.dim) / max(1, size)
        tot["dense_hash"]["size"] = size
        tot["dense_hash"]["buckets"] = buckets
    tot["rss_mib"] = rss_mib()
    for name in run:
        b = sorted(tot[name].pop("batches_s"))
        tot[name].update(rate_wall=args.keys / tot[name]["wall_s"], rate_cpu=args.keys / tot[name]["cpu_s"],
                         batch_s_median=b[len(b) // 2], batch_s_max=b[-1])
    run.clear()
    ev = dht = None
    gc.collect()
    return tot


# The kernel's direct-compaction counters (/proc/vmstat, the whole machine's): a huge-page fault that finds
# no free 2 MiB page compacts memory in the faulting thread, which can cost that batch tenths of a second.
# Summed per table over its batches, they tell a round slowed by compaction from one that was not.
COMPACTION = ("compact_stall", "compact_free_scanned")


def compaction():
    """The COMPACTION counters now (zeros where /proc/vmstat lacks them)."""
    got = dict.fromkeys(COMPACTION, 0)
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in got:
                    got[name] = int(value)
    except OSError:
        pass
    return got


def build_batches(args, tf, run, tot):
    """Every batch of new keys into each table of `run`, in turns (the order alternating), each timed, with
    the interpreter's garbage collector off (as timeit does): a full collection of TensorFlow's objects
    takes a large fraction of a second and would be charged to whichever table's batch set it off."""
    gc.collect()
    gc.disable()
    try:
        for i, s in enumerate(range(0, args.keys, args.batch)):
            k = tf.constant(make_keys(range(s, min(args.keys, s + args.batch))))
            for name in (list(run) if i % 2 == 0 else list(run)[::-1]):
                v0 = compaction()
                c0, t0 = time.process_time(), time.perf_counter()
                run[name](k)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                v1 = compaction()
                tot[name]["wall_s"] += wall
                tot[name]["cpu_s"] += cpu
                tot[name]["batches_s"].append(wall)
                for field in COMPACTION:
                    tot[name][field] = tot[name].get(field, 0) + v1[field] - v0[field]
    finally:
        gc.enable()


def summarize(rounds, systems=SYSTEMS):
    """Each system's figures, medians over `rounds` (dicts holding one entry per system), and the ratios of
    evstore to DenseHashTable per round (wall and CPU) when both systems ran."""
    out = {s: {k: statistics.median(r[s][k] for r in rounds)
               for k in ("rate_wall", "rate_cpu", "bytes_per_key", "batch_s_median", "batch_s_max")}
           for s in systems}
    if set(SYSTEMS) <= set(systems):
        out["ratio_wall"] = [r["evstore"]["rate_wall"] / r["dense_hash"]["rate_wall"] for r in rounds]
        out["ratio_cpu"] = [r["evstore"]["rate_cpu"] / r["dense_hash"]["rate_cpu"] for r in rounds]
    return out


def render(out):
    """The table and per-round ratios of a result (main's, or one a solo run paired)."""
    lines = [f"{out['keys']:,} keys x dim {out['dim']} built from empty in batches of {out['batch']:,}, "
             f"{len(out['rounds'])} round(s); rates over every batch, growth included (medians of rounds)",
             "| system | M keys/s wall | M keys/s CPU | bytes/key | median batch ms | slowest batch ms |",
             "|---|---|---|---|---|---|"]
    for s in SYSTEMS:
        if s in out:
            o = out[s]
            lines.append(f"| {s} | {o['rate_wall'] / 1e6:.2f} | {o['rate_cpu'] / 1e6:.2f} | {o['bytes_per_key']:.0f} "
                         f"| {o['batch_s_median'] * 1e3:.1f} | {o['batch_s_max'] * 1e3:.0f} |")
    if "ratio_cpu" in out:
        lines.append("evstore / DenseHashTable per round: wall " + ", ".join(f"{x:.2f}x" for x in out["ratio_wall"])
                     + "; CPU " + ", ".join(f"{x:.2f}x" for x in out["ratio_cpu"]))
    stalls = {s: [r[s].get("compact_stall") for r in out["rounds"]] for s in SYSTEMS if s in out}
    if all(None not in v for v in stalls.values()):
        lines.append("direct compactions during each table's batches (the machine's), per round: "
                     + "; ".join(f"{s} " + ", ".join(map(str, v)) for s, v in stalls.items()))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_numbers(ap, (("--keys", 1_000_000, "keys each table is built to"),
                     ("--dim", 16, "embedding dim"),
                     ("--batch", 65536, "new keys per insert"),
                     ("--rounds", 1, "pairs of tables built, one pair at a time")))
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated tables to build, in turns (default evstore,dense_hash)")
    ap.add_argument("--min-available-mib", type=float, default=1024,
                    help="stop (exit 3, the reason on stderr) once MemAvailable falls under this (0: never)")
    args = ap.parse_args()
    args.systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if not args.systems:
        ap.error(f"--systems names none of {', '.join(SYSTEMS)}")
    if args.min_available_mib > 0:
        guard_available_memory(args.min_available_mib)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import evstore
    from evstore import ops

    rounds = [build_round(args, tf, ops, evstore, r) for r in range(args.rounds)]
    out = {"keys": args.keys, "dim": args.dim, "batch": args.batch, "systems": list(args.systems), "rounds": rounds,
           "tf_version": tf.__version__, "rss_peak_mib": hwm_mib(), **summarize(rounds, args.systems)}
    print(render(out))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
