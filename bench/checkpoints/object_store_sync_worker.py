"""One worker of bench_object_store's synchronous part (run by it, twice):
    python -m bench.checkpoints.object_store_sync_worker RANK PORT0,PORT1 KEYS DIM DIRTY BUCKET LOCAL_ROOT
Fills its shard of a CollectiveEmbeddingVariable (Adam slots m, v), then times SyncCheckpointManager
full and delta commits to LOCAL_ROOT and to s3://BUCKET/sync, alternating; prints `RESULT <json>`."""
import json
import os
import sys
import time

import numpy as np


def main():
    rank, ports, keys, dim, dirty, bucket, local_root = (int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]),
                                                         int(sys.argv[4]), float(sys.argv[5]), sys.argv[6], sys.argv[7])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    import checkpoint.sync
    import evstore
    from bench.checkpoints.bench_object_store import load_rows
    from bench.harness.workload import make_keys

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        item = evstore.CollectiveEmbeddingVariable("item", dim=dim)
        w = tf.Variable(tf.ones([dim, 1]))
    step = tf.Variable(0, dtype=tf.int64)
    all_keys = make_keys(np.arange(keys))
    mine = all_keys[evstore.shard_index(all_keys, len(ports)).numpy() == rank]
    rng = np.random.default_rng(rank)
    for s in range(0, len(mine), 200_000):
        load_rows(item.local, mine[s:s + 200_000], rng, dim, tf)
    dirty_keys = mine[rng.choice(len(mine), max(1, int(dirty * len(mine))), replace=False)]
    mgrs = {"local": checkpoint.sync.SyncCheckpointManager(local_root, [item, w], global_step=step),
            "s3": checkpoint.sync.SyncCheckpointManager(f"s3://{bucket}/sync", [item, w], global_step=step)}
    out = {"shard_keys": int(item.local.size())}
    for kind in ("full", "delta"):
        for name, mgr in mgrs.items():
            if kind == "delta":
                load_rows(item.local, dirty_keys, rng, dim, tf)   # the same keys dirty for each root's delta
            step.assign_add(1)
            t0 = time.perf_counter()
            mgr.save_full() if kind == "full" else mgr.save_delta()
            out[f"{name}_{kind}_commit_s"] = round(time.perf_counter() - t0, 2)
            out[f"{name}_{kind}_bytes"] = mgr.last_committed.total_bytes
    print("RESULT " + json.dumps(out), flush=True)
    for mgr in mgrs.values():
        mgr.close()
    sys.stdout.flush()
    os._exit(0)   # the collective runtime's teardown can wait on peers that already left


if __name__ == "__main__":
    main()
