"""A poisoned stretch of training data, served with and without the quality gate.

    .venv/bin/python -m bench.serving.bench_quality_gate [--out DIR] [--part demo,movielens]
        [--demo-minutes 2.5] [--poison 50:30] [--demo-gate default]
        [--movielens examples/data/movielens/ratings.csv] [--ml-poison 0.4:0.25] [--ml-poison-kind shuffle]
        [--ml-commit-every 8] [--ml-gate default] [--ml-compare "EXPR;EXPR"]
    .venv/bin/python -m bench.serving.bench_quality_gate --out DIR --combine RUN1/quality_gate.json RUN2/...  (one picture)

demo: `evstore demo` twice, as real processes (trainer, `evstore serve` polling
every 0.25 s): without a gate and with `--gate`, the training labels shuffled
within each batch for SECONDS from START (`--poison START:SECONDS`; a logging
bug). Every batch is scored before training by the served model (REST) and by
a model frozen at the first full, always on the true labels, so "served AUC"
is what users of the server got. From each run's summary.json: AUC over time
(sliding windows of 50 batches), its level before the stretch, its lowest point
from the stretch on, the frozen model's over the same windows, and when the
gated server served a new commit again after the stretch.

movielens: a replay in one process, in time order: the trainer commits a delta
every N batches (so both runs see the same commits; each record with the
reference model's scores, evstore_app/job/reference.py), a gated and an
ungated ServingModel poll after each commit and, with a model frozen at the
first full, score each batch before it is trained on. Labels (rating >= 4) are
shuffled (or inverted: --ml-poison-kind invert) for the fraction of rows given
by --ml-poison FROM:LENGTH. Served AUC per commit interval. Each gate of
--ml-compare (separated by ;) is one more gated ServingModel polling the same
commits: for each gate, `compare` says how many poisoned commits it served,
how many good commits it held, and after how many commits past the stretch it
served again.

Writes DIR/quality_gate.json (every figure) and DIR/quality_gate.png, and
prints the JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.harness.paths import ROOT as REPO
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# ---- demo: real processes ------------------------------------------------------
def run_demo(out, minutes, poison, gate):
    cmd = [sys.executable, "-m", "evstore_app.cli", "demo", "--minutes", str(minutes), "--out", out,
           "--poison", poison, "--no-progress"] + (["--gate", gate] if gate else [])
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def demo_figures(s):
    p = s["poison"]
    pts = [(t, live, frozen) for t, live, frozen in s["auc_over_time"] if live is not None]
    before = [live for t, live, _ in pts if p["start_s"] - 20 <= t < p["start_s"]]
    after = [(t, live, frozen) for t, live, frozen in pts if t >= p["start_s"]]
    low = min(after, key=lambda x: x[1])
    pre = float(np.mean(before)) if before else None
    back = next((t for t, live, _ in after if t > p["end_s"] and pre is not None and live >= pre - 0.01), None)
    out = {"served_auc_before": round(pre, 4) if pre else None,
           "served_auc_lowest": round(low[1], 4), "at_s": low[0], "frozen_auc_there": round(low[2], 4),
           "lowest_minus_frozen": round(low[1] - low[2], 4),
           "min_served_minus_frozen_from_stretch": round(min(live - fr for _, live, fr in after), 4),
           "served_auc_back_within_0.01_s_after_stretch": None if back is None else round(back - p["end_s"], 1),
           "auc_live_whole_run": round(s["auc"]["live"], 4), "auc_frozen_whole_run": round(s["auc"]["frozen"], 4)}
    sv = s["serving"]
    if sv.get("gate"):
        commits = {c["seq"]: c["t"] for c in s["checkpoints"]["commits"]}
        seen = sorted((commits[q] + f, q) for q in sv["seen_by_client"] if q in commits
                      for t, f in sv["freshness"] if abs(t - commits[q]) < 1e-6)
        # the first new version a client saw after the stretch ended (a held stretch is applied in one
        # step with the commit that passed), and the newest version it saw before
        first = next((x for x in seen if x[0] > p["end_s"]), None)
        out["gate"] = sv["gate"]
        out["serving_new_commits_again"] = None if first is None else {
            "s_after_stretch": round(first[0] - p["end_s"], 1),
            "seq": max(q for t, q in seen if abs(t - first[0]) < 0.1),
            "held_at_seq": max((q for t, q in seen if t <= p["end_s"]), default=None)}
    return out


# ---- movielens: an in-process replay ---------------------------------------------------
def run_movielens(out, data, poison, commit_every, gate, seed=0, kind="shuffle", compare=()):
    import checkpoint  # noqa: F401
    from evstore.quality import auc
    from evstore_app.job.source import FileStream
    from evstore_app.job.spec import load_spec
    from evstore_app.job.trainer import Trainer
    from serving_loader import ServingModel, ensure_serving_export

    spec = load_spec(os.path.join(REPO, "examples", "movielens.json"))
    spec["data"]["join"][0]["file"] = os.path.join(os.path.dirname(os.path.abspath(data)), "movies.csv")
    stream = FileStream(data, spec)
    root, export = os.path.join(out, "checkpoints"), os.path.join(out, "export")
    trainer = Trainer(spec, root, keep_chains=None, seed=seed)
    ensure_serving_export(trainer.model, export)
    batches = list(stream.batches(0))
    n = len(batches)
    lo, hi = int(poison[0] * n), int((poison[0] + poison[1]) * n)
    warm = commit_every
    for pos, (cols, y) in batches[:warm]:
        trainer.train(trainer.inputs(cols), y, pos)
    trainer.manager.save_full(metadata=trainer.metadata(), quality=trainer.quality)
    frozen = ServingModel(export, root)
    ungated = ServingModel(export, root)
    gated = ServingModel(export, root, gate=gate)
    others = {g: ServingModel(export, root, gate=g) for g in compare}
    # Shuffled across the whole stretch, not within a batch: a MovieLens batch in time order is mostly
    # one user's ratings, whose label rate a within-batch shuffle would keep.
    stretch = np.concatenate([batches[i][1][1] for i in range(lo, hi)])
    stretch = 1 - stretch if kind == "invert" else np.random.default_rng(seed + 1).permutation(stretch)
    poisoned, k = {}, 0
    for i in range(lo, hi):
        m = len(batches[i][1][1])
        poisoned[i], k = stretch[k:k + m], k + m
    y_true, scores, intervals, versions, held = [], {"ungated": [], "gated": [], "frozen": []}, [], [], []
    commit_kind = {}
    t0 = time.time()
    for i in range(warm, n):
        pos, (cols, y) = batches[i]
        x = trainer.inputs(cols)
        for name, sm in (("ungated", ungated), ("gated", gated), ("frozen", frozen)):
            scores[name].append(sm.predict(x)[0]["outputs"].reshape(-1))
        y_true.append(y)
        y_train = poisoned.get(i, y)
        trainer.train(x, y_train, pos, *trainer.score(x))
        if (i - warm + 1) % commit_every == 0 or i == n - 1:
            seq = trainer.manager.save_delta(metadata=trainer.metadata(), quality=trainer.quality)
            commit_kind[seq] = "poisoned" if i >= lo and i - commit_every + 1 < hi else "good"   # trained on any of it
            for sm in (ungated, gated, *others.values()):
                sm.poll()
            versions.append({"batch": i + 1, "committed": trainer.manager.last_committed.seq,
                             "ungated": ungated.version, "gated": gated.version})
            held.append(gated.admin_status()["held"])
    seconds = time.time() - t0
    # served AUC per commit interval (the batches scored between two commits)
    edges = [warm] + [v["batch"] for v in versions]
    series = []
    for a, b in zip(edges, edges[1:]):
        y = np.concatenate(y_true[a - warm:b - warm])
        series.append({"batch": b, "rows": int(batches[b - 1][0]), "poisoned": bool(a < hi and b > lo),
                       **{k: auc(y, np.concatenate(v[a - warm:b - warm])) for k, v in scores.items()}})
    pre = [p["ungated"] for p in series if p["batch"] <= lo][-5:]
    pre_auc = float(np.mean(pre)) if pre else None
    after = [p for p in series if p["batch"] > lo]
    low_u = min(after, key=lambda p: p["ungated"])
    low_g = min(after, key=lambda p: p["gated"])
    back_u = next((p["batch"] - hi for p in after if p["batch"] > hi and p["ungated"] >= pre_auc - 0.01), None)
    resumed = next((v for v, h in zip(versions, held) if v["batch"] > hi and not h), None)
    gs = gated.admin_status()
    last_poisoned = max(s for s, k in commit_kind.items() if k == "poisoned")

    def judged(sm):
        served = set(sm.gate.served_versions)
        again = min((s for s in served if s > last_poisoned), default=None)
        return {"poisoned_commits_served": sorted(s for s in served if commit_kind.get(s) == "poisoned"),
                "poisoned_commits": sum(1 for k in commit_kind.values() if k == "poisoned"),
                "served_versions": len(served), "held_back_total": sm.gate.held_back_total,
                "serving_again_commits_after_stretch": None if again is None else again - last_poisoned}
    return {
        "compare": {g: judged(sm) for g, sm in [(gate, gated), *others.items()]}, "poison_kind": kind,
        "data": os.path.relpath(data, REPO) if data.startswith(REPO) else data, "rows": stream.rows,
        "batches": n, "batch_size": spec["batch_size"], "commit_every_batches": commit_every,
        "poisoned_batches": [lo, hi], "gate": gate, "replay_seconds": round(seconds, 1),
        "commits": len(versions) + 1, "held_back_total": gs["held_back_total"],
        # polls that found the gated model holding before the stretch began: commits held on noise alone
        "held_polls_before_stretch": sum(1 for v, h in zip(versions, held) if h and v["batch"] <= lo),
        "held_polls_from_stretch": sum(1 for v, h in zip(versions, held) if h and v["batch"] > lo),
        "served_auc_before": round(pre_auc, 4) if pre_auc else None,
        "ungated_lowest": round(low_u["ungated"], 4), "ungated_lowest_at_batch": low_u["batch"],
        "frozen_there": round(low_u["frozen"], 4),
        "gated_lowest": round(low_g["gated"], 4), "frozen_at_gated_lowest": round(low_g["frozen"], 4),
        "min_gated_minus_frozen_from_stretch": round(min(p["gated"] - p["frozen"] for p in after), 4),
        "min_ungated_minus_frozen_from_stretch": round(min(p["ungated"] - p["frozen"] for p in after), 4),
        "ungated_back_within_0.01_batches_after_stretch": back_u,
        "gated_serving_again_batches_after_stretch": None if resumed is None else resumed["batch"] - hi,
        "auc_whole_run": {k: round(auc(np.concatenate(y_true), np.concatenate(v)), 4) for k, v in scores.items()},
        "series": series, "versions": versions,
    }


# ---- picture -------------------------------------------------------------------------
def draw(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in res if k == "demo" or k.startswith("movielens")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, k in zip(axes[0], panels):
        r = res[k]
        if k == "demo":
            for name, s in (("no gate", r["ungated"]), ("gated", r["gated"])):   # each on its own stretch
                t0 = s["poison"]["start_s"]
                pts = [p for p in s["auc_over_time"] if p[1] is not None]
                ax.plot([p[0] - t0 for p in pts], [p[1] for p in pts], label=f"served, {name}")
            t0 = r["ungated"]["poison"]["start_s"]
            pts = [p for p in r["ungated"]["auc_over_time"] if p[2] is not None]
            ax.plot([p[0] - t0 for p in pts], [p[2] for p in pts], ":", color="gray", label="frozen at the first full")
            p = r["ungated"]["poison"]
            ax.axvspan(0, p["end_s"] - p["start_s"], color="tab:red", alpha=0.12, label="training labels shuffled")
            ax.set_xlabel("seconds since the stretch began (each run)")
            ax.set_title(f"evstore demo stream (gate: {r['figures']['gated'].get('gate', {}).get('gate')})",
                         fontsize=9)
        else:
            s = r["series"]
            x = [p["rows"] for p in s]
            ax.plot(x, [p["ungated"] for p in s], label="served, no gate")
            ax.plot(x, [p["gated"] for p in s], label="served, gated")
            ax.plot(x, [p["frozen"] for p in s], ":", color="gray", label="frozen at the first full")
            lo, hi = r["poisoned_batches"]
            ax.axvspan(lo * r["batch_size"], hi * r["batch_size"], color="tab:red", alpha=0.12,
                       label="training labels shuffled")
            ax.set_xlabel("rows (time order)")
            ax.set_title(f"MovieLens {os.path.basename(os.path.dirname(r['data']))} (gate: {r['gate']})", fontsize=9)
        ax.set_ylabel("served AUC (true labels)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def combine(paths, out):
    """One picture of several runs' quality_gate.json (their demo and MovieLens panels, in order)."""
    res = {}
    for i, path in enumerate(paths):
        with open(path) as f:
            r = json.load(f)
        for k, v in r.items():
            if k == "demo" or k.startswith("movielens"):
                res[k if k not in res else f"{k}-{i}"] = v
    draw(res, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--part", default="demo,movielens")
    ap.add_argument("--demo-minutes", type=float, default=2.5)
    ap.add_argument("--poison", default="50:30", help="demo: START:SECONDS of shuffled training labels")
    ap.add_argument("--demo-gate", default="default")
    ap.add_argument("--movielens", default=os.path.join(REPO, "examples", "data", "movielens", "ratings.csv"))
    ap.add_argument("--ml-poison", default="0.4:0.25", help="movielens: FROM:LENGTH as fractions of the batches")
    ap.add_argument("--ml-commit-every", type=int, default=8)
    ap.add_argument("--ml-gate", default="default")
    ap.add_argument("--ml-poison-kind", choices=("shuffle", "invert"), default="shuffle")
    ap.add_argument("--ml-compare", default="auc >= served - 0.01, logloss <= served * 1.05;auc >= reference - 0.01",
                    help="more gates (separated by ;) judging the same commits")
    ap.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                    help="only draw the panels of earlier runs' quality_gate.json files into OUT/quality_gate.png")
    args = ap.parse_args()
    if args.combine:
        os.makedirs(args.out, exist_ok=True)
        combine(args.combine, os.path.join(args.out, "quality_gate.png"))
        return
    out = args.out or tempfile.mkdtemp(prefix="evstore-bench-gate-")
    os.makedirs(out, exist_ok=True)
    parts = args.part.split(",")
    res = {"command": " ".join(["python", "-m", __spec__.name] + sys.argv[1:])}
    if "movielens" in parts:
        a, b = (float(v) for v in args.ml_poison.split(":"))
        res["movielens"] = run_movielens(os.path.join(out, "movielens"), args.movielens, (a, b),
                                         args.ml_commit_every, args.ml_gate, kind=args.ml_poison_kind,
                                         compare=[g for g in args.ml_compare.split(";") if g.strip()])
    if "demo" in parts:
        ungated = run_demo(os.path.join(out, "demo-ungated"), args.demo_minutes, args.poison, None)
        gated = run_demo(os.path.join(out, "demo-gated"), args.demo_minutes, args.poison, args.demo_gate)
        res["demo"] = {"poison": args.poison, "ungated": ungated, "gated": gated,
                       "figures": {"ungated": demo_figures(ungated), "gated": demo_figures(gated)}}
    draw(res, os.path.join(out, "quality_gate.png"))
    short = {k: ({kk: vv for kk, vv in v.items() if kk not in ("series", "versions")} if k == "movielens" else
                 {"poison": v["poison"], "figures": v["figures"]} if k == "demo" else v) for k, v in res.items()}
    with open(os.path.join(out, "quality_gate.json"), "w") as f:
        json.dump(res, f, indent=1, default=float)
    print(json.dumps(short, indent=1, default=float))
    print(f"picture: {os.path.join(out, 'quality_gate.png')}")


if __name__ == "__main__":
    main()
