"""Peer benchmark for bench/tables/bench_filters.py: TFRA 0.8.1 restrict policies on the Zipf stream.

Run ONLY with the peer venv's python (never import TFRA into the project venv):

    .peer-tfra/bin/python -m bench.peers.peer_tfra_filters --policy frequency --reserve 100000
    .peer-tfra/bin/python -m bench.peers.peer_tfra_filters --policy none,frequency,timestamp   # interleaved

A `de.Variable` (one CPU CuckooHashTable shard) with `restrict_policy` =
None | de.FrequencyRestrictPolicy | de.TimestampRestrictPolicy. A training step
on a batch (bench/harness/workload.py zipf_stream) is what TFRA's optimizer wrapper does:
`var.lookup(ids)` (find + initializer rows for misses), the policy's status
update `restrict_policy.apply_update(ids)`, then the SGD row update written
back with `var.upsert(unique ids, rows)` (TFRA inserts new keys at the apply).
Every --save-every steps `var.restrict(num_reserved)` trims the table (and the
status table) to `--reserve` keys. Prints one JSON line (a list, one entry per policy).
"""
import argparse
import json
import statistics
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.harness.args import add_stream_args
from bench.harness.rss import rss_mib
from bench.harness.workload import zipf_stream


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap)
    ap.add_argument("--policy", default="none",
                    help="comma-separated: none, frequency, timestamp; several run interleaved step by step")
    ap.add_argument("--reserve", type=int, default=100_000, help="restrict(num_reserved) (default 100k)")
    args = ap.parse_args()
    import tensorflow as tf
    import tensorflow_recommenders_addons as tfra
    from tensorflow_recommenders_addons import dynamic_embedding as de

    stream = zipf_stream(args.lookups, args.batch, args.window, args.shift, args.seed)
    policies = args.policy.split(",")
    kinds = {"none": None, "frequency": de.FrequencyRestrictPolicy, "timestamp": de.TimestampRestrictPolicy}
    rss0 = rss_mib()
    vs = [de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=args.dim, name=f"bench_{p}",
                      initializer=tf.random_normal_initializer(0, 0.01), restrict_policy=kinds[p]) for p in policies]
    looks = [[] for _ in vs]
    t_step = [0.0] * len(vs)
    half_rss = None
    for step, ids in enumerate(stream):
        ids_t = tf.constant(ids)
        for j in range(len(vs)):
            c = (j + step) % len(vs)
            var = vs[c]
            t0 = time.perf_counter()
            emb = var.lookup(ids_t)
            if var.restrict_policy is not None:
                var.restrict_policy.apply_update(ids_t)
            emb.numpy()
            t1 = time.perf_counter()
            uniq, idx = tf.unique(ids_t)
            grads = tf.math.unsorted_segment_sum(emb * 1e-3, idx, tf.shape(uniq)[0])
            rows = tf.gather(emb, tf.math.unsorted_segment_min(tf.range(tf.size(idx)), idx, tf.shape(uniq)[0]))
            var.upsert(uniq, rows - 0.1 * grads)
            if step % args.save_every == 0 and var.restrict_policy is not None:
                var.restrict(args.reserve, trigger=args.reserve)
            t2 = time.perf_counter()
            looks[c].append(t1 - t0)
            t_step[c] += t2 - t0
        if step == len(stream) // 2:
            half_rss = rss_mib() - rss0
    n = args.batch * len(stream)
    single = len(vs) == 1
    out = []
    for p, var, lk, ts in zip(policies, vs, looks, t_step):
        live = int(var.size().numpy())
        status = int(var.restrict_policy.status.size().numpy()) if var.restrict_policy is not None else 0
        out.append({"system": "tfra", "config": p, "tfra_version": tfra.__version__,
                    "lookup_keys_s": args.batch / statistics.median(lk), "step_keys_s": n / ts,
                    "live": live, "index_entries": live + status, "bytes_per_live": None, "evicted": None,
                    "rss_per_live": (rss_mib() - rss0) * 2**20 / max(live, 1) if single else None,
                    "rss_mib_half": half_rss if single else None, "rss_mib_end": rss_mib() - rss0 if single else None})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
