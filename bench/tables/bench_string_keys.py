"""String keys: find and find-or-insert keys/s with 8- and 32-byte keys, against
evstore's int64 path and TFRA's string-key cuckoo table, in one run, interleaved.

    .venv/bin/python -m bench.tables.bench_string_keys --keys 1000000 --dim 16 \\
        --peer-python .peer-tfra/bin/python

For each key size: one evstore string EV, one evstore int64 EV (keys 0..N-1)
and (with --peer-python) a TFRA peer process (peer_tfra_strings.py) each hold
the same N keys; then `--rounds` rounds run every system's batch in turn
(medians reported). find = read-only lookup of existing keys; find_or_insert =
evstore's training lookup of existing keys (TFRA: insert of existing keys, its
nearest operation). Bytes per key = index_bytes + meta_bytes of the EV's stats
(key bytes included, rows excluded; dirty lists sealed first) over N, against
the key bytes.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd
from bench.harness.timing import on_host
from bench.tables.string_keys_common import batch_indices, make_keys


class Peer:
    def __init__(self, python, n, dim, kb, batch):
        self.p = subprocess.Popen(module_cmd("bench.peers.peer_tfra_strings", python=python), cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.p.stdin.write(f"{n} {dim} {kb} {batch}\n")
        self.p.stdin.flush()
        self.rss = float(self._reply("@@READY"))

    def _reply(self, tag="@@"):
        for line in self.p.stdout:
            if line.startswith(tag + " "):
                return line.split()[1]
        raise RuntimeError("TFRA peer exited")

    def run(self, w, i):
        self.p.stdin.write(f"{'find' if w == 'find' else 'upsert'} {i}\n")
        self.p.stdin.flush()
        return float(self._reply())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--key-bytes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--peer-python", default=None)
    args = ap.parse_args()
    import numpy as np
    import tensorflow as tf
    import evstore
    from evstore._ops import gen

    rows = []
    for kb in args.key_bytes:
        keys = make_keys(args.keys, kb)
        idx = batch_indices(args.keys, args.batch, args.rounds)
        s_ev = evstore.EmbeddingVariable(f"s{kb}", args.dim, key_dtype=tf.string)
        i_ev = evstore.EmbeddingVariable(f"i{kb}", args.dim)
        for lo in range(0, args.keys, 65536):
            k = keys[lo:lo + 65536]
            s_ev.load(tf.constant(k.tolist()), tf.zeros([len(k), args.dim]))
            i_ev.load(tf.range(lo, lo + len(k), dtype=tf.int64), tf.zeros([len(k), args.dim]))
        for ev in (s_ev, i_ev):   # seal the load's dirty lists: measure the steady-state table
            ev.commit_export(ev.begin_export(return_keys=False)[0])
        st = s_ev.stats()
        it = i_ev.stats()
        bpk_s = (st["index_bytes"] + st["meta_bytes"]) / args.keys
        bpk_i = (it["index_bytes"] + it["meta_bytes"]) / args.keys
        sb = [tf.constant(keys[i].tolist()) for i in idx]
        ib = [tf.constant(i.astype(np.int64)) for i in idx]
        proxy = tf.zeros([0])
        # The million Python bytes objects of `keys` are setup, not the op: drop them and freeze what is
        # left, or a garbage collection (triggered by the eager ops' allocations) walks them inside the
        # timed calls and is counted as the op's time. The TFRA peer does the same.
        del keys
        gc.collect()
        gc.freeze()
        systems = {
            "evstore_string": lambda w, r: _time(lambda: on_host(
                gen.ev_find(s_ev.resource_handle, sb[r], dim=args.dim) if w == "find" else
                gen.ev_find_or_insert(s_ev.resource_handle, sb[r], proxy, dim=args.dim))),
            "evstore_int64": lambda w, r: _time(lambda: on_host(
                gen.ev_find(i_ev.resource_handle, ib[r], dim=args.dim) if w == "find" else
                gen.ev_find_or_insert(i_ev.resource_handle, ib[r], proxy, dim=args.dim))),
        }
        peer = None
        if args.peer_python:
            peer = Peer(args.peer_python, args.keys, args.dim, kb, args.batch)
            systems["tfra_string"] = peer.run
        for w in ("find", "find_or_insert"):
            times = {name: [] for name in systems}
            for name, fn in systems.items():
                fn(w, 0)   # warm-up
            for r in range(args.rounds):
                for name, fn in systems.items():
                    times[name].append(fn(w, r))
            rate = {name: args.batch / statistics.median(t) for name, t in times.items()}
            row = {"key_bytes": kb, "workload": w, **{f"{k}_Mkeys_s": round(v / 1e6, 3) for k, v in rate.items()},
                   "vs_int64": round(rate["evstore_string"] / rate["evstore_int64"], 2)}
            if peer:
                row["vs_tfra"] = round(rate["evstore_string"] / rate["tfra_string"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(json.dumps({"key_bytes": kb, "bytes_per_key_string": round(bpk_s, 1),
                          "bytes_per_key_int64": round(bpk_i, 1),
                          "string_overhead_over_key_bytes": round(bpk_s - kb, 1),
                          "tfra_fill_rss_mib": peer.rss if peer else None}), flush=True)
        if peer:
            peer.close()
        del s_ev, i_ev


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
