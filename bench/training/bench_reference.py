"""What the reference model costs the trainer: the demo's model and stream trained with and without it.

    .venv/bin/python -m bench.training.bench_reference [--batches 240] [--batch-size 512]
        [--commit-every 4] [--rounds 2]

Each side trains a fresh Trainer (evstore_app/job/trainer.py) on the same
batches of the synthetic click stream, scoring every batch before training
(`Trainer.score`) and committing a delta every N batches with its quality
record; with the reference (the default) every batch is also scored by the
reference model, which first keeps the rows of the batch's keys it does not
hold yet (copy-on-write), and each commit whose run passes the default gate
moves it to the model (evstore_app/job/reference.py). The sides alternate for
--rounds rounds after an untimed warm-up of each; the ratio of their median
examples/s is the figure. Also
reports the rows the tables hold at the end, the rows the reference keeps
at the end (bounded by the keys since its commit) and the moves taken.
"""
import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run_side(reference, batches, batch_size, commit_every, out):
    from evstore_app.job.model import field_ev
    from evstore_app.job.synthetic import SPEC, ClickStream
    from evstore_app.job.trainer import Trainer

    tr = Trainer(dict(SPEC, batch_size=batch_size), out, keep_chains=2, reference=reference)
    stream = ClickStream(seed=0, batch_size=batch_size)
    data = [stream.batch(b) for b in range(batches)]
    copies = [0]
    if reference:
        move = tr.reference.move_to

        def counted(model):
            copies[0] += 1
            move(model)
        tr.reference.move_to = counted
    tr.manager.save_full(metadata=tr.metadata(), quality=tr.quality)
    t0 = time.perf_counter()
    for b, (cols, y) in enumerate(data):
        x = tr.inputs(cols)
        tr.train(x, y, b + 1, *tr.score(x))
        if (b + 1) % commit_every == 0:
            tr.manager.save_delta(metadata=tr.metadata(), quality=tr.quality)
    seconds = time.perf_counter() - t0
    rows = sum(int(ev.size()) for ev in tr.evs.values())
    kept = sum(int(field_ev(tr.reference.model, n).size()) for n in tr.evs) if reference else 0
    return {"examples_per_s": batches * batch_size / seconds, "rows": rows, "kept": kept, "moves": copies[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--commit-every", type=int, default=4, help="batches between deltas (default 4)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    res = {"with": [], "without": []}
    for side in (False, True):   # untimed: the first Trainer of a process pays TensorFlow's start-up and tracing
        run_side(side, a.commit_every, a.batch_size, a.commit_every, tempfile.mkdtemp(prefix="evstore-bench-ref-"))
    for r in range(a.rounds):
        for side in ("without", "with"):
            out = tempfile.mkdtemp(prefix=f"evstore-bench-ref-{side}-")
            res[side].append(run_side(side == "with", a.batches, a.batch_size, a.commit_every, out))
    med = {k: statistics.median(x["examples_per_s"] for x in v) for k, v in res.items()}
    print(json.dumps({"command": "python -m bench.training.bench_reference " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "load_average": os.getloadavg(), "examples_per_s": {k: round(v) for k, v in med.items()},
        "with_over_without": round(med["with"] / med["without"], 3),
        "rows_at_end": res["with"][-1]["rows"], "reference_kept_rows_at_end": res["with"][-1]["kept"],
        "reference_moves": res["with"][-1]["moves"],
        "commits": a.batches // a.commit_every}, indent=1))


if __name__ == "__main__":
    main()
