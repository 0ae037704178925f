"""Peer for bench_string_keys.py: TFRA 0.8.1's CPU cuckoo table with tf.string keys.

Run ONLY with the peer venv's python (.peer-tfra, made by bench/peers/tfra-setup.sh):
reads "<keys> <dim> <key_bytes> <batch>" on its first stdin line, fills a
`de.get_variable(key_dtype=tf.string)` table's CuckooHashTable with the same
keys bench_string_keys.py makes, prints "@@READY <rss MiB>", then answers
"find <i>" / "upsert <i>" with "@@ <seconds>" for batch i, and exits on EOF.
  find    CuckooHashTable.lookup of existing keys (static default value)
  upsert  CuckooHashTable.insert of existing keys (TFRA has no find-or-insert:
          its nearest equivalent for keys already present)
"""
import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.rss import rss_mib
from bench.harness.timing import on_host
from bench.tables.string_keys_common import batch_indices, make_keys


def main():
    import numpy as np
    import tensorflow as tf
    from tensorflow_recommenders_addons import dynamic_embedding as de
    n, dim, kb, batch = (int(x) for x in sys.stdin.readline().split())
    keys = make_keys(n, kb)
    var = de.get_variable("s", key_dtype=tf.string, value_dtype=tf.float32, dim=dim,
                          initializer=tf.keras.initializers.Zeros())
    table = var.tables[0]
    rss0 = rss_mib()
    for lo in range(0, n, 65536):
        k = tf.constant(keys[lo:lo + 65536])
        table.insert(k, tf.zeros([k.shape[0], dim]))
    filled = rss_mib() - rss0
    idx = batch_indices(n, batch, 8)
    bk = [tf.constant(keys[i]) for i in idx]
    vals = tf.ones([batch, dim])
    del keys   # as the evstore side: no million-object array left for the garbage collector to walk
    gc.collect()
    gc.freeze()
    print(f"@@READY {filled:.1f}", flush=True)
    for line in sys.stdin:
        w, i = line.split()
        k = bk[int(i)]
        t = time.perf_counter()
        if w == "find":
            on_host(table.lookup(k))
        else:
            table.insert(k, vals)
        print(f"@@ {time.perf_counter() - t:.6f}", flush=True)


if __name__ == "__main__":
    main()
