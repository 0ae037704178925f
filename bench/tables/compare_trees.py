"""Before/after of two evstore checkouts: the reduced `make bench` and the serving benchmark, alternating.

    .venv/bin/python -m bench.tables.compare_trees --before ../wt-before --after . --pairs 5

Each checkout must have its op library built in place against this venv's TensorFlow (`make install`
in that checkout, or `cmake -S TREE -B TREE -G Ninja -DPython_EXECUTABLE=.venv/bin/python && cmake
--build TREE`); both run under this venv's python with PYTHONPATH set to the checkout, and
each runs its OWN benchmarks (`python -m bench.run`, `python -m bench.serving.bench_serving` from the
tree's root; the scripts bench/run.py and bench/serving/bench_serving.py of a tree from before bench/ was a package), so the
figures are what `make bench` of that tree reports. One pair = one run of each tree; the order
alternates pair by pair (before first, then after first, ...), so a slow drift of the machine hits
both sides alike. Per run:

  run.py --matrix KEYSxDIM --batches 10 --no-tfra --no-cluster --no-filters --no-e2e --no-serving
         --checkpoint-keys KEYS --checkpoint-repeats 3 --opt-max-keys 0
  bench_serving.py --live-s 60 --predict-hz 200 (delta apply at dim 16 and 64, predict p50/p99 idle and
         under application from 12,012 predicts per mode: at its default 3,000 the p99 is the slowest ~30
         and moves by several percent between pairs of the same two trees)

--lookups-only runs the lookup matrix alone (about 10 s a run instead of 100), so that many more pairs fit;
--settle S waits S seconds before each run (on a 2-core machine the run right after another one was
repeatedly the slow one of its pair, while the previous process's memory was still being reclaimed).

Prints a markdown table of medians per figure with the change (after vs before, signed so that a
positive % is always worse), then every raw value in run order; writes the raw values as JSON to
--out. Figures: lookup (find, find-or-insert hit / new, runs A and B), Adam apply, full / delta saves,
restore, delta apply rows/s, predict p50 / p99 idle and under application.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness.paths import RESULTS


# (label, higher_is_better, extractor(run.py json, bench_serving json))
FIGURES = [
    ("find (A, M keys/s)", True, lambda b, s: b["results"][0]["A"]["evstore"]["find"] / 1e6),
    ("find-or-insert hit (A, M keys/s)", True, lambda b, s: b["results"][0]["A"]["evstore"]["foi_hit"] / 1e6),
    ("insert: find-or-insert new (A, M keys/s)", True, lambda b, s: b["results"][0]["A"]["evstore"]["foi_new"] / 1e6),
    ("find (B, M keys/s)", True, lambda b, s: b["results"][0]["B"]["evstore"]["find"] / 1e6),
    ("find-or-insert hit (B, M keys/s)", True, lambda b, s: b["results"][0]["B"]["evstore"]["foi_hit"] / 1e6),
    ("insert: find-or-insert new (B, M keys/s)", True, lambda b, s: b["results"][0]["B"]["evstore"]["foi_new"] / 1e6),
    ("Adam apply (B, M keys/s)", True, lambda b, s: b["results"][0]["B"]["evstore"]["adam_apply"] / 1e6),
    ("Adam train step (B, M keys/s)", True, lambda b, s: b["results"][0]["B"]["evstore"]["train_step"] / 1e6),
    ("full save (s)", False, lambda b, s: b["checkpoint"]["full"]["save_s_median"]),
    ("delta save 0.1% (s)", False, lambda b, s: b["checkpoint"]["deltas"][0]["save_s"]),
    ("delta save 1% (s)", False, lambda b, s: b["checkpoint"]["deltas"][1]["save_s"]),
    ("delta save 10% (s)", False, lambda b, s: b["checkpoint"]["deltas"][2]["save_s"]),
    ("restore full + 3 deltas (s)", False, lambda b, s: b["checkpoint"]["restore"][0]["s"]),
    ("serving: delta apply dim 16 (M rows/s)", True,
     lambda b, s: next(a for a in s["apply"] if a["dim"] == 16)["apply_rows_per_s"] / 1e6),
    ("serving: delta apply dim 64 (M rows/s)", True,
     lambda b, s: next(a for a in s["apply"] if a["dim"] == 64)["apply_rows_per_s"] / 1e6),
    ("serving: predict p50 idle (ms)", False, lambda b, s: s["live"]["idle_p50_ms"]),
    ("serving: predict p99 idle (ms)", False, lambda b, s: s["live"]["idle_p99_ms"]),
    ("serving: predict p99 under application (ms)", False, lambda b, s: s["live"]["busy_p99_ms"]),
]


# The figures of --lookups-only: run.py's lookup matrix alone (no checkpoint, no serving).
LOOKUP_FIGURES = FIGURES[:8]


def bench_cmd(python, tree, module):
    """`python -m module` for a tree whose bench/ is a package (run from the tree's root); a tree
    from before bench/ was a package runs the script of the module's last name."""
    if os.path.exists(os.path.join(tree, "bench", "__init__.py")):
        return [python, "-m", module]
    return [python, os.path.join(tree, "bench", module.rsplit(".", 1)[1] + ".py")]


def run_tree(tree, keys, dim, python, workdir, tag, lookups_only=False, batches=10):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TF_CPP_MIN_LOG_LEVEL="2")
    out_dir = os.path.join(workdir, tag)
    os.makedirs(out_dir, exist_ok=True)
    cmd = bench_cmd(python, tree, "bench.run") + ["--matrix", f"{keys}x{dim}", "--batches", str(batches),
           "--no-tfra", "--no-cluster", "--no-filters", "--no-e2e", "--no-serving", "--opt-max-keys", "0",
           "--out-dir", out_dir]
    cmd += ["--no-checkpoint"] if lookups_only else ["--checkpoint-keys", str(keys), "--checkpoint-repeats", "3"]
    with open(os.path.join(out_dir, "run.log"), "w") as log:
        subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    bench = json.load(open(sorted(glob.glob(os.path.join(out_dir, "bench-*.json")))[-1]))
    if lookups_only:
        return {label: round(f(bench, None), 6) for label, _, f in LOOKUP_FIGURES}
    with open(os.path.join(out_dir, "serving.log"), "w") as log:
        r = subprocess.run(bench_cmd(python, tree, "bench.serving.bench_serving") + ["--seed", "0", "--live-s", "60",
                            "--predict-hz", "200"], cwd=tree,
                           env=env, stdout=subprocess.PIPE, stderr=log, text=True, check=True)
    serving = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    return {label: round(f(bench, serving), 6) for label, _, f in FIGURES}


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="checkout measured as 'before'")
    ap.add_argument("--after", required=True, help="checkout measured as 'after'")
    ap.add_argument("--pairs", type=int, default=5, help="runs of each tree (default 5)")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lookups-only", action="store_true",
                    help="only run.py's lookup and apply figures (no checkpoint, no serving): shorter runs, more pairs")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait before each run (lets the previous process's memory be reclaimed)")
    ap.add_argument("--batches", type=int, default=10, help="run.py --batches (timed batches per phase)")
    ap.add_argument("--out", default=None, help="raw values as JSON (default: bench/results/compare-<time>.json)")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="compare-trees-")
    raw = {"before": [], "after": []}
    loads = []
    for i in range(args.pairs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            time.sleep(args.settle)
            loads.append(loadavg())
            t0 = time.time()
            raw[side].append(run_tree(getattr(args, side), args.keys, args.dim, sys.executable, workdir,
                                      f"{side}-{i}", args.lookups_only, args.batches))
            print(f"pair {i + 1}/{args.pairs} {side}: {time.time() - t0:.0f} s, load {loads[-1]:.2f}",
                  file=sys.stderr, flush=True)
    figures = LOOKUP_FIGURES if args.lookups_only else FIGURES
    lines = ["| figure | before | after | change (+ = worse) |", "|---|---|---|---|"]
    for label, higher, _ in figures:
        b = statistics.median(r[label] for r in raw["before"])
        a = statistics.median(r[label] for r in raw["after"])
        worse = (b - a) / b if higher else (a - b) / b
        lines.append(f"| {label} | {b:.4g} | {a:.4g} | {worse * 100:+.1f}% |")
    lines += ["", f"Load average at the start of each run: {min(loads):.2f}-{max(loads):.2f}.", "",
              "Raw values in run order (pairs alternate: before first in pairs 1, 3, 5, ...):", ""]
    for label, _, _ in figures:
        lines.append(f"- {label}: before {[r[label] for r in raw['before']]}, after {[r[label] for r in raw['after']]}")
    print("\n".join(lines))
    out = args.out or os.path.join(RESULTS, time.strftime("compare-%Y%m%dT%H%M%SZ.json", time.gmtime()))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"before": os.path.abspath(args.before), "after": os.path.abspath(args.after), "loads": loads,
                   "raw": raw}, f, indent=1)
    print(f"\nraw: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
