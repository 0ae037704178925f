"""A table configuration too large for run A's three tables in one process: one system per process.

bench/run.py measures each (keys, dim) in two processes, run A (evstore, DenseHashTable and numpy,
interleaved batch by batch) and run B (evstore and TFRA). At 10M keys x 64 run A holds three large
tables at once (its estimated peak, 17 GiB, is more than this machine has free), so such a
configuration runs its systems one after another instead, each in a bench_lookup.py process of its own:

    evstore   evstore and numpy's gather (interleaved: numpy is dropped after the read phase)
              phases read, insert, train
    dense_hash  TF DenseHashTable                phases read, insert
    tfra      TFRA (its peer process alone)      phases read, insert, train

in `rounds` rounds, the order reversed every other round (evstore, dense_hash, tfra, then tfra,
dense_hash, evstore: each system's mean place in the run is the same, so a load that rises or falls
steadily through the run favours none). Every process sees the same keys and batches
(bench/harness/workload.py, the same seed). A system's batch times from all its rounds are pooled
(bench_lookup.summarize), so its rate is the median over rounds x --batches batches; its other
figures (memory, fill time, stats) are its first round's. The result has the shape of run_config's:
"A" holds evstore, dense_hash and numpy, "B" evstore and tfra (the same evstore figures in both), so
the tables render as for the smaller configurations; "solo" records the order, each process's wall
time and peak RSS, and any process that failed.

Run I (bench_insert_build.py: each table built from empty by new keys) of such a configuration
runs likewise (build_solo): one process per table, evstore then DenseHashTable, the order
reversed every other round. The processes of one round are paired: its ratios, by CPU time per
key (each process's CPU, all its threads) with wall time beside it, are the round's.
"""
from bench.tables.bench_insert_build import SYSTEMS as BUILD_SYSTEMS
from bench.tables.bench_insert_build import summarize as summarize_builds
from bench.tables.bench_lookup import summarize

PROCESSES = (
    ("evstore", ["--systems", "evstore,numpy", "--phases", "read,insert,train"], ("evstore", "numpy")),
    ("dense_hash", ["--systems", "dense_hash", "--phases", "read,insert"], ("dense_hash",)),
    ("tfra", ["--systems", "", "--phases", "read,insert,train"], ("tfra",)),
)


def order(rounds, with_tfra, names=None):
    """The processes of each round, by name: the order of PROCESSES (or of `names`), reversed every other
    round."""
    names = list(names or [name for name, _, _ in PROCESSES if with_tfra or name != "tfra"])
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


def pool(runs, batch):
    """One system's figures from its runs (one result dict per process that measured it): the first
    run's figures, every workload's rates and spreads recomputed from all runs' batch times."""
    merged = dict(runs[0])
    for key in [k for k in merged if k.endswith("_batch_s")]:
        w = key[:-len("_batch_s")]
        summarize(merged, w, [t for r in runs for t in r.get(key) or []], batch,
                  [c for r in runs for c in r.get(w + "_batch_cpu_s") or []])
    merged["rounds_pooled"] = len(runs)
    return merged


def run_solo(run_one, rounds, batch, with_tfra):
    """Runs the processes, `rounds` rounds; run_one(tag, extra_args, peer) -> bench_lookup's JSON
    result (or {"error": ...}) runs one, `peer` True for the TFRA process. Returns {"A", "B", "solo"}."""
    got = {}     # system -> its results, one per process that ran it
    solo = {"rounds": rounds, "order": order(rounds, with_tfra), "processes": [], "errors": []}
    specs = {name: (extra, systems) for name, extra, systems in PROCESSES}
    for r, names in enumerate(solo["order"]):
        for name in names:
            extra, systems = specs[name]
            res = run_one(f"{name}{r + 1}", extra, name == "tfra")
            peak = res.get("rss_peak_mib")
            if name == "tfra":
                peak = (res.get("tfra") or {}).get("rss_peak_mib", peak)
            solo["processes"].append({"round": r + 1, "process": name, "wall_s": res.get("wall_s"),
                                      "rss_peak_mib": peak})
            failed = res.get("error") or res.get("tfra_error")
            if failed:
                solo["errors"].append(f"round {r + 1} {name}: {failed}")
            for s in systems:
                if isinstance(res.get(s), dict) and not (set(res[s]) <= {"error"}):
                    got.setdefault(s, []).append(res[s])
    out = {"solo": solo, "A": {}, "B": {}}
    for s, runs in got.items():
        merged = pool(runs, batch)
        for run in ("A", "B") if s == "evstore" else ("B",) if s == "tfra" else ("A",):
            out[run][s] = merged
    for run, systems in (("A", ("evstore", "dense_hash", "numpy")), ("B", ("evstore",) + (("tfra",) if with_tfra
                                                                                       else ()))):
        for s in systems:
            if s not in out[run]:
                out[run][s] = {"error": f"no process measured {s}"}
    return out


def build_solo(run_one, rounds):
    """Run I one table per process: run_one(tag, system) -> bench_insert_build's JSON result for that
    system alone (or {"error": ...}). Returns bench_insert_build's result shape over the rounds in which
    both tables were built (their figures paired round by round), plus "solo": the order, each
    process's wall time and peak RSS, and any process that failed."""
    solo = {"rounds": rounds, "order": order(rounds, False, BUILD_SYSTEMS), "processes": [], "errors": []}
    paired, meta = [], {}
    for r, names in enumerate(solo["order"]):
        got = {}
        for name in names:
            res = run_one(f"{name}{r + 1}", name)
            solo["processes"].append({"round": r + 1, "process": name, "wall_s": res.get("wall_s"),
                                      "rss_peak_mib": res.get("rss_peak_mib")})
            if "error" in res:
                solo["errors"].append(f"round {r + 1} {name}: {res['error']}")
                continue
            got[name] = res["rounds"][0][name]
            meta = {k: res[k] for k in ("keys", "dim", "batch", "tf_version")}
        if len(got) == len(BUILD_SYSTEMS):
            paired.append(got)
    if not paired:
        return {"error": "no round built both tables", "solo": solo}
    return {**meta, "rounds": paired, **summarize_builds(paired), "solo": solo}
