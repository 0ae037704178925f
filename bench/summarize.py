"""Spread of the same-run ratios across several `bench/run.py` result files.

    .venv/bin/python -m bench.summarize bench/results/bench-A.json bench/results/bench-B.json ...
    .venv/bin/python -m bench.summarize --last 3

The machines are shared and noisy: one run's ratio can be off by 2x. This
prints, per (keys, dim) and ratio, the median and min-max over the files, as
a markdown table. Every ratio is still taken inside one run (see run.py).
"""
import argparse
import glob
import json
import os
import statistics
import sys

from bench.harness.paths import RESULTS

# (label, target, run, system, key, run, system, key): ratio = a / b
RATIOS = [
    ("find vs TFRA", 3.0, "B", "evstore", "find", "B", "tfra", "find"),
    ("find vs DenseHashTable", 2.0, "A", "evstore", "find", "A", "dense_hash", "find"),
    ("find vs numpy t[idx]", 0.6, "A", "evstore", "find", "A", "numpy", "gather"),
    ("find vs numpy take", None, "A", "evstore", "find", "A", "numpy", "take"),
    ("foi hit vs TFRA lookup", 3.0, "B", "evstore", "foi_hit", "B", "tfra", "lookup_init"),
    ("foi hit vs DHT find", 2.0, "A", "evstore", "foi_hit", "A", "dense_hash", "find"),
    ("foi hit vs numpy t[idx]", 0.6, "A", "evstore", "foi_hit", "A", "numpy", "gather"),
    ("foi new vs TFRA insert", 3.0, "B", "evstore", "foi_new", "B", "tfra", "insert_new"),
    ("foi new vs DHT insert", 2.0, "A", "evstore", "foi_new", "A", "dense_hash", "insert_new"),
    ("foi new vs numpy t[idx]", 0.6, "A", "evstore", "foi_new", "A", "numpy", "gather"),
    ("Adam apply vs TFRA step", 3.0, "B", "evstore", "adam_apply", "B", "tfra", "train_step"),
    ("train step vs TFRA step", None, "B", "evstore", "train_step", "B", "tfra", "train_step"),
    ("apply_gradients vs TFRA's", None, "B", "evstore", "train_apply", "B", "tfra", "train_apply"),
]


def get(res, run, system, key):
    v = res.get(run, {}).get(system, {}).get(key)
    return v if isinstance(v, (int, float)) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("files", nargs="*", help="results JSON files written by bench/run.py")
    ap.add_argument("--last", type=int, default=0, help="use the N newest bench/results/bench-*.json")
    args = ap.parse_args()
    files = list(args.files)
    if args.last:
        files += sorted(glob.glob(os.path.join(RESULTS, "bench-*.json")))[-args.last:]
    if not files:
        ap.error("no result files given")
    ratios = {}  # (keys, dim) -> label -> [ratio per file]
    for f in files:
        with open(f) as fh:
            data = json.load(fh)
        for r in data["results"]:
            if "A" not in r and "B" not in r:
                continue
            per = ratios.setdefault((r["keys"], r["dim"]), {})
            for label, _, ra, sa, ka, rb, sb, kb in RATIOS:
                a, b = get(r, ra, sa, ka), get(r, rb, sb, kb)
                if a is not None and b:
                    per.setdefault(label, []).append(a / b)
    configs = sorted(ratios)
    print(f"Ratios over {len(files)} runs: median (min-max); target in brackets.\n")
    print("| ratio | " + " | ".join(f"{k / 1e6:g}M x {d}" for k, d in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for label, target, *_ in RATIOS:
        cells = []
        for c in configs:
            v = ratios[c].get(label)
            cells.append("n/a" if not v else
                         f"{statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})")
        print(f"| {label}" + (f" [≥{target}x]" if target else "") + " | " + " | ".join(cells) + " |")
    print("\nfiles: " + ", ".join(os.path.basename(f) for f in files))


if __name__ == "__main__":
    sys.exit(main())
