"""`evstore train`: the streaming trainer on the user's files.

Reads the data (Parquet or CSV, pyarrow, timestamp order), resumes from the
checkpoint root's newest chain if it has one (at the saved input position),
trains batch by batch with progressive evaluation, saves deltas and fulls on
a schedule, and commits a final delta when the data ends or on Ctrl-C /
SIGTERM. With `export`, the serving export is written first (or kept if it
is this model's), so `evstore serve --export EXPORT --checkpoints ROOT` can
follow the run from its first commit (the closing summary prints that
command line, with `--model_name` the spec file's name). `max_rows=0` with
`export` writes the export and commits nothing: what `evstore serve
--allow-empty` serves until the first commit.
"""
import os
import sys
import time

import tensorflow as tf

from evstore_app.job.guard import Guard, GuardTripped
from evstore.gate import Gate
from evstore_app.job.kafka_source import KafkaStream
from evstore_app.job.report import Summary, format_offsets
from evstore_app.job.source import FileStream
from evstore_app.job.spec import load_spec
from evstore_app.job.trainer import Trainer

__all__ = ["run", "KafkaStream"]


def run(data, spec, checkpoints, delta_every=60.0, full_every=3600.0, max_rows=None, out=None, keep_chains=3,
        progress=True, stop_event=None, export=None, guard=None, guard_restore=False, serving_view=None,
        guard_min_examples=None, from_seq=None, export_tables="stock", reference=True):
    """Trains on `data` per `spec` (path or dict), checkpointing under `checkpoints`.
    `data`: a data file or directory (FileStream), or a KafkaStream: an
    unbounded run from Kafka topics, each commit recording every partition's
    offset, resumed from them (evstore_app/job/kafka_source.py); it ends at the
    stream's max_events / until, or on `stop_event`.
    Every commit carries the progressive quality of the examples trained
    since the previous one (evstore.quality).
    `export`: a local directory for the model's serving export
    (serving_loader.ensure_serving_export: written before training, kept when
    it already holds this model's export; ValueError if it holds another's).
    `guard`: a gate expression (serving_loader/gate.py; `served` is the last
    commit's quality) each commit must pass; the first that fails is not
    committed and training stops (evstore_app/job/guard.py), the summary's
    "guard" says why; with `guard_restore` the trainer's model is restored to
    the last good commit. Commits of fewer than `guard_min_examples`
    examples are not judged. GateError (a ValueError) for a malformed one.
    `serving_view`: a lower-precision serving view in every commit
    (CheckpointManager's argument). `from_seq`: restore the chain ending at
    that commit instead of the newest and continue that branch (the next
    delta's parent is it; servers follow the newest branch), resuming the
    input at its recorded position; ValueError when the root holds no
    commit `from_seq`. `export_tables`: the export's tables, "stock" or
    "evstore" (export_serving_model's `tables`: "evstore" for tiered serving).
    `reference`: score every batch with the reference model too, recorded in
    each commit's quality['reference'] (evstore_app/job/reference.py).
    Returns the summary dict (also written to OUT/summary.json, with
    OUT/report.png; OUT defaults to default_out(checkpoints)). A root that
    already holds every row of `data` trains and commits nothing."""
    if guard is not None:
        Gate.parse(guard, min_examples=guard_min_examples)   # refused before anything is read or built
    if export_tables not in ("stock", "evstore"):
        raise ValueError(f"export_tables must be 'stock' or 'evstore', got {export_tables!r}")
    if from_seq is not None and (isinstance(from_seq, bool) or not isinstance(from_seq, int) or from_seq < 0):
        raise ValueError(f"from_seq must be a commit's sequence number (an integer >= 0), got {from_seq!r}")
    spec_arg, spec = spec, load_spec(spec)
    kafka = isinstance(data, KafkaStream)
    stream = data.bind(spec) if kafka else FileStream(data, spec, max_rows=max_rows)
    trainer = Trainer(spec, checkpoints, keep_chains=keep_chains, serving_view=serving_view, reference=reference,
                      reference_gate=guard, reference_min_examples=guard_min_examples)
    if stop_event is not None:
        trainer.stop_event = stop_event
    guard = Guard(guard, trainer, guard_min_examples) if guard is not None else None
    quality = guard.quality if guard is not None else trainer.quality
    start = trainer.resume(seq=from_seq)
    if trainer.resumed_at is not None:
        where = (f"offsets {format_offsets(start)}" if kafka else f"row {start:,} of {stream.rows:,}")
        at = "" if from_seq is None else f" (commit {from_seq})"
        print(f"evstore train: resuming at {where} from {trainer.manager.root}{at}", file=sys.stderr, flush=True)
    out = out or default_out(checkpoints)
    extra = {}
    if export is not None:
        import serving_loader
        _, written = serving_loader.ensure_serving_export(trainer.model, export, tables=export_tables)
        extra["export"] = {"dir": os.path.abspath(export), "written": written, "tables": export_tables,
                           "serve": serve_command(export, checkpoints, model_name(spec_arg))}
    os.makedirs(out, exist_ok=True)
    writer = tf.summary.create_file_writer(os.path.join(out, "tensorboard"))
    summary = Summary(out, trainer)
    if not kafka and start >= stream.rows:   # a finished root (or no rows asked for): nothing to train or commit
        last = trainer.manager.last_committed
        first = None if last is None else last.seq
        return summary.finish(seq=first, first_full=first, final=first, train_seconds=0.0, steps=0,
                              spec=spec if first is not None else None,
                              extra={"position": trainer.position, "rows_in_data": stream.rows, **extra})
    if kafka and trainer.resumed_at is None:
        trainer.position = stream.position()      # no offsets yet: the group's, else auto.offset.reset
    if trainer.manager.last_committed is None:
        trainer.manager.save_full(metadata=trainer.metadata(), quality=trainer.quality)   # the initial state
    first = trainer.manager.last_committed.seq
    trainer.manager.start(delta_every=delta_every, full_every=full_every, metadata=trainer.metadata,
                          quality=quality)
    if kafka:
        progress_line = KafkaProgress(stream, trainer) if progress else None
        bar = None

        def idle():
            stream.committed(trainer.manager.last_committed)
            if progress_line is not None:
                progress_line.maybe_print()

        try:
            opened = stream.open(trainer.position, trainer.stop_event)
        except BaseException:
            trainer.manager.stop(final_delta=False)
            raise
        batches = stream.batches(spec["batch_size"], trainer.stop_event, on_idle=idle) if opened else iter(())
    else:
        bar, idle = _bar(progress, stream.rows, start), None
        batches = stream.batches(start)
    t0, steps, last = time.time(), 0, 0.0
    try:
        for position, (cols, y) in batches:
            if trainer.stop_event.is_set():
                break
            x = trainer.inputs(cols)
            scores, reference = trainer.score(x)
            summary.score(y, scores)
            trainer.train(x, y, position, scores, reference)
            steps += 1
            if bar is not None:
                bar.update(len(y))
            if idle is not None:
                idle()
            if time.time() - last > 2.0:
                last = time.time()
                trainer.snapshot_stats()
                trainer.write_summaries(writer, trainer.examples, summary.running())
    finally:
        tripped = guard is not None and guard.tripped is not None
        try:
            final = trainer.manager.stop(final_delta=not tripped)
        except GuardTripped:    # the final delta is the one the guard refuses
            tripped, final = True, None
        finally:
            if kafka:
                try:
                    stream.committed(trainer.manager.last_committed, wait=True)
                finally:
                    stream.close()
        if bar is not None:
            bar.close()
    train_seconds = time.time() - t0
    if tripped:
        final = guard.tripped["last_good"]
        if guard_restore:   # the model, position and example count of the last good commit
            meta = trainer.manager.restore(seq=final)
            trainer.position, trainer.examples = meta.get("position", 0), int(meta.get("examples", 0))
        print(guard.message(guard_restore), file=sys.stderr, flush=True)
        extra["guard"] = dict(guard.tripped, restored=bool(guard_restore))
    trainer.snapshot_stats()
    trainer.write_summaries(writer, trainer.examples, summary.running())
    extra.update({"kafka": stream.report()} if kafka else {"rows_in_data": stream.rows})
    # Without a restore a tripped trainer holds examples the chain does not: nothing to compare.
    return summary.finish(seq=final, first_full=first, final=final, train_seconds=train_seconds, steps=steps,
                          spec=spec if not tripped or guard_restore else None,
                          extra={"position": trainer.position, **extra})


class KafkaProgress:
    """The progress line of a Kafka run, every 5 s on stderr: messages,
    events/s since the last line, lag per partition, event time -> commit of
    the last commit, bad messages."""

    def __init__(self, stream, trainer, every=5.0):
        self.stream, self.trainer, self.every = stream, trainer, every
        self.t, self.n = time.time(), trainer.examples

    def maybe_print(self):
        now = time.time()
        if now - self.t < self.every:
            return
        rate = (self.trainer.examples - self.n) / (now - self.t)
        self.t, self.n = now, self.trainer.examples
        lag = self.stream.lag()
        lag_text = " ".join(f"{k} {v:,}" if v is not None else f"{k} ?" for k, v in lag.items()) or "-"
        f = self.stream.freshness[-1] if self.stream.freshness else None
        fresh = f"event->commit p50 {f[2]:.2f} s p99 {f[3]:.2f} s (commit {f[0]})" if f else "no commit with events yet"
        print(f"evstore train: {self.stream.messages:,} messages, {rate:,.0f} events/s, lag {lag_text}, {fresh}, "
              f"bad {self.stream.bad:,}", file=sys.stderr, flush=True)


def model_name(spec):
    """The name `evstore train` suggests serving the model as: the spec file's
    name without its extension (examples/movielens.json -> movielens), or
    "default" (the server's default name) for a spec given as a dict."""
    if isinstance(spec, (str, os.PathLike)):
        return os.path.splitext(os.path.basename(os.fspath(spec)))[0] or "default"
    return "default"


def serve_command(export, checkpoints, name="default"):
    """The `evstore serve` command line that serves `export` kept fresh from
    `checkpoints` as model `name` (what the REST paths /v1/models/<name> ask for)."""
    import shlex
    root = checkpoints if "://" in str(checkpoints) else os.path.abspath(checkpoints)
    return (f"evstore serve --export {shlex.quote(os.path.abspath(export))} --checkpoints {shlex.quote(str(root))} "
            f"--model_name {shlex.quote(name)}")


def default_out(checkpoints):
    """Where `train` writes its summary, report and TensorBoard files by
    default: `<root>.train` beside a local root (one per root), else
    `./evstore-train-<last part of the URL>`."""
    root = str(checkpoints)
    if "://" not in root:
        return os.path.abspath(root).rstrip(os.sep) + ".train"
    name = root.rstrip("/").rsplit("/", 1)[-1].replace(":", "") or "root"
    return os.path.abspath(f"evstore-train-{name}")


def _bar(enabled, total, start):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit="ex", desc="evstore train", file=sys.stderr)
