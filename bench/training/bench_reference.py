"""What the reference model costs the trainer: the demo's model and stream trained without it, with it
(copy-on-write), and with the previous design's full copy, in one run.

    .venv/bin/python -m bench.training.bench_reference [--batches 240] [--batch-size 512]
        [--commit-every 4] [--rounds 3] [--prefill 0]

Each side trains a fresh Trainer (evstore_app/job/trainer.py) on the same
batches of the synthetic click stream, scoring every batch before training
(`Trainer.score`) and committing a delta every N batches with its quality
record. With the reference (`cow`, the trainer's) every batch is also scored by
the reference model, which first keeps the rows of the batch's keys it does
not hold yet (copy-on-write), and each commit whose run passes the default
gate moves it to the model (evstore_app/job/reference.py). `copy` is the
design it replaced, kept here as the peer: the same scoring, but each move
exports and imports every table. --prefill N loads N rows (keys the stream
never sends) into each of the user and item tables first, so the tables are
large beside the delta (what a full copy pays for). The sides alternate for
--rounds rounds after an untimed warm-up of each; the figures are the ratios
of their median examples/s to the side without a reference. Also reports the
rows the tables hold at the end, the rows the reference keeps at the end
(bounded by the keys since its commit) and the moves taken.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def full_copy_reference(base):
    """The previous design as a ReferenceModel class: no copy-on-write; every move exports and imports
    every table (built on `base`, evstore_app.job.reference.ReferenceModel, imported late)."""
    from evstore_app.job.model import field_ev

    class FullCopyReference(base):
        def keep(self, x):
            pass

        def evicted(self, ev, keys, values):
            pass

        def move_to(self, model):
            super().move_to(model)
            for f in self.spec["sparse"]:
                rows = field_ev(model, f["name"]).export()
                self._own[f["name"]].load(rows["keys"], rows["values"], clear=True)

    return FullCopyReference


def run_side(side, batches, batch_size, commit_every, out, prefill=0):
    import numpy as np

    from evstore_app.job.model import field_ev
    from evstore_app.job.reference import ReferenceModel
    from evstore_app.job.synthetic import SPEC, ClickStream
    from evstore_app.job.trainer import Trainer

    spec = dict(SPEC, batch_size=batch_size)
    tr = Trainer(spec, out, keep_chains=2, reference=side != "without")
    stream = ClickStream(seed=0, batch_size=batch_size)
    data = [stream.batch(b) for b in range(batches)]
    rng = np.random.default_rng(0)
    for name in ("user", "item") if prefill else ():
        ev = field_ev(tr.model, name)
        ev.load(np.arange(10**9, 10**9 + prefill, dtype=np.int64),
                rng.normal(0, 0.01, (prefill, ev.dim)).astype(np.float32))
    if side == "copy":
        tr.reference = full_copy_reference(ReferenceModel)(spec)
        tr.manager.on_evict = tr.reference.evicted
    moves = [0]
    if tr.reference is not None:
        tr.reference.restart(tr.model)
        move = tr.reference.move_to

        def counted(model):
            moves[0] += 1
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
    tr.manager.close()   # its writer lease: the root is removed next
    rows = sum(int(ev.size()) for ev in tr.evs.values())
    kept = sum(int(field_ev(tr.reference.model, n).size()) for n in tr.evs) if side == "cow" else None
    return {"examples_per_s": batches * batch_size / seconds, "rows": rows, "kept": kept, "moves": moves[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--commit-every", type=int, default=4, help="batches between deltas (default 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=0, help="rows loaded into the user and item tables first")
    a = ap.parse_args()
    sides = ("without", "cow", "copy")
    res = {k: [] for k in sides}
    for side in sides:   # untimed: the first Trainer of a process pays TensorFlow's start-up and tracing
        run_side(side, a.commit_every, a.batch_size, a.commit_every, tempfile.mkdtemp(prefix="evstore-bench-ref-"))
    for r in range(a.rounds):
        for side in sides:
            out = tempfile.mkdtemp(prefix=f"evstore-bench-ref-{side}-")
            res[side].append(run_side(side, a.batches, a.batch_size, a.commit_every, out, a.prefill))
            shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(x["examples_per_s"] for x in v) for k, v in res.items()}
    print(json.dumps({"command": "python -m bench.training.bench_reference " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "load_average": os.getloadavg(), "examples_per_s": {k: round(v) for k, v in med.items()},
        "cow_over_without": round(med["cow"] / med["without"], 3),
        "copy_over_without": round(med["copy"] / med["without"], 3),
        "cow_over_copy": round(med["cow"] / med["copy"], 3),
        "rows_at_end": res["cow"][-1]["rows"], "reference_kept_rows_at_end": res["cow"][-1]["kept"],
        "reference_moves": res["cow"][-1]["moves"], "commits": a.batches // a.commit_every}, indent=1))


if __name__ == "__main__":
    main()
