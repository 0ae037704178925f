"""`evstore demo`: the whole online-learning loop on the embedded synthetic stream.

  stream -> trainer (filters + eviction on) -> deltas every few seconds,
  fulls now and then -> a separate `evstore serve` process hot-applies them
  -> report.
Every batch is scored before it is trained on by the live server (over its
REST API) and by a ServingModel frozen at the first full, giving the
progressive AUC of online updating against no updating. A status poller
measures freshness (commit -> served, as a client sees it). The run ends
after `minutes` or on Ctrl-C / SIGTERM: a final delta is committed, the
server applies it and exits, the final chain is restored into a fresh model
and compared with the trainer's state, and a summary is printed and written
to OUT/summary.json.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import tensorflow as tf

from evstore_app.job.report import Summary, write_report_png
from evstore_app.job.synthetic import SPEC, ClickStream
from evstore_app.job.train import serve_command
from evstore_app.job.trainer import Trainer

__all__ = ["run"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A real `evstore serve` process and a client for it. It polls the root
    every `poll_every` seconds: commit -> served is at most that plus one
    apply (a scan of a local root is a directory listing and a stat per
    checkpoint)."""

    def __init__(self, export, root, name="demo", poll_every=0.05, log_path=None, gate=None):
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}/v1/models/{name}"
        # The admin listener only when gated: the demo reads the gate's hold from the admin status.
        admin_port = _free_port() if gate is not None else -1
        self.admin_url = f"http://127.0.0.1:{admin_port}/v1/models/{name}/admin"
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--checkpoints", root,
             "--rest_api_port", str(self.port), "--port", "-1", "--admin_port", str(admin_port), "--model-name", name,
             "--poll-every", str(poll_every)]
            + (["--gate", gate] if gate is not None else []),
            stdout=self.log, stderr=subprocess.STDOUT)
        self.seen = {}   # version -> wall time first reported
        self._stop = threading.Event()
        self._poller = None

    def _get(self, url, timeout=5):
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the serving process exited with {self.proc.returncode} (see its log)")
            try:
                return self.version()
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise RuntimeError("the serving process did not become ready")

    def version(self):
        st = self._get(self.base)
        return int(st["model_version_status"][0]["version"])

    def predict(self, inputs):
        body = json.dumps({"inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
        req = urllib.request.Request(self.base + ":predict", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())
        return np.asarray(out["outputs"], np.float64).reshape(-1)

    def metrics(self):
        """{sample name: value} of the server's Prometheus /metrics (unlabelled samples)."""
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}

    def admin(self):
        """The server's admin status (serving_loader/admin.py; a gated server's admin listener)."""
        return self._get(self.admin_url)

    def published(self):
        """Every version the server has published (its status lists them all,
        replaced ones as END), whether or not this client's polls saw them."""
        st = self._get(self.base)
        return {int(v["version"]) for v in st["model_version_status"]}

    def observe(self):
        """The version served now, recorded in `seen` (first time it was reported)."""
        v = self.version()
        self.seen.setdefault(v, time.time())
        return v

    def start_polling(self, every=0.05):
        def loop():
            while not self._stop.is_set():
                try:
                    self.observe()
                except (urllib.error.URLError, ConnectionError, OSError, KeyError, ValueError):
                    pass
                self._stop.wait(every)
        self._poller = threading.Thread(target=loop, daemon=True)
        self._poller.start()

    def stop(self):
        self._stop.set()
        if self._poller:
            self._poller.join()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _unserved(status):
    """The commits a gated server's admin `status` holds back or leaves waiting."""
    return status.get("held_commits", []) + status.get("waiting_commits", [])


def _poisoned(history, first_full, examples):
    """The commits after `first_full` that trained on examples of the
    stretch (`examples`: (after, up to], as the trainer counts them)."""
    if examples is None:
        return []
    by_seq = {m.seq: m for m in history}
    out = []
    for m in history:
        parent = by_seq.get(m.parent)
        if m.seq <= first_full or parent is None:
            continue
        lo, hi = parent.metadata.get("examples", 0), m.metadata.get("examples", 0)
        if lo < examples[1] and hi > examples[0]:
            out.append(m.seq)
    return out


def run(minutes=3.0, out=None, seed=0, batch_size=512, delta_every=5.0, full_every=60.0, warmup_batches=60,
        progress=True, stop_event=None, keep_chains=3, poison=None, gate=None, serving_view=None, kafka=None):
    """Runs the demo; returns the summary dict (also OUT/summary.json).

    `poison`: (start, seconds): the training labels are shuffled within each
    batch from `start` seconds after serving starts (the first batch scored
    by the server), for `seconds` (a logging bug; the served models are
    still scored on the true labels). A commit is made at each edge of the
    stretch, so every commit trained either only on the stretch's examples
    or on none of them: the stretch is what the gate judges, whatever the
    delta schedule (a commit whose examples straddle a stretch's start, few
    of them poisoned, ranks well and is served: docs/guides/quality-gate.md).
    The summary's "poison" gives the stretch in seconds since the trainer
    started, the time axis of its other series, its examples and its commits.
    `gate`: the serving process's quality gate (`evstore serve --gate`).
    `serving_view`: the trainer also writes the served rows in that precision
    (CheckpointManager's argument), which the server then serves.
    `kafka`: the stream goes through a Kafka broker (evstore_app/job/demo_kafka.py): True
    starts the bundled one, a "host:port" names one; each commit then records
    the topic's offsets and the summary's "kafka" reports the stream."""
    if gate is not None:
        from evstore.gate import Gate
        Gate.parse(gate)   # refused here, not in the serving process
    import serving_loader
    out = out or tempfile.mkdtemp(prefix="evstore-demo-")
    os.makedirs(out, exist_ok=True)
    root, export = os.path.join(out, "checkpoints"), os.path.join(out, "export")
    spec = dict(SPEC, batch_size=batch_size)
    stream = ClickStream(seed=seed, batch_size=batch_size)
    trainer = Trainer(spec, root, seed=seed, keep_chains=keep_chains, serving_view=serving_view, reference_gate=gate)
    if stop_event is not None:
        trainer.stop_event = stop_event
    writer = tf.summary.create_file_writer(os.path.join(out, "tensorboard"))
    summary = Summary(out, trainer)
    serving_loader.ensure_serving_export(trainer.model, export)   # next to the checkpoints, as `train --export`
    feed = None
    if kafka:
        from evstore_app.job.demo_kafka import KafkaFeed
        feed = KafkaFeed(stream, spec, bootstrap=None if kafka is True else kafka, out=out)
        print(f"evstore demo: the stream goes through {feed.describe()}", file=sys.stderr, flush=True)
        batches = feed.batches(trainer.stop_event)
    else:
        batches = ((b + 1, batch) for b, batch in stream.batches())   # (position after the batch, batch)
    try:
        for _ in range(warmup_batches):                       # a first model worth freezing
            position, (cols, y) = next(batches)
            trainer.train(trainer.inputs(cols), y, position)
    except BaseException:
        if feed is not None:
            feed.close()
        raise
    first_full = trainer.manager.save_full(metadata=trainer.metadata())
    trainer.reference.restart(trainer.model)              # the model the first delta replaces
    frozen = serving_loader.ServingModel(export, root)     # never polled again: frozen at the first full
    server = _Server(export, root, log_path=os.path.join(out, "server.log"), gate=gate)
    shuffle = np.random.default_rng(seed + 1)
    bar = None
    try:
        server.wait_ready()
        server.start_polling()
        trainer.manager.start(delta_every=delta_every, full_every=full_every, metadata=trainer.metadata,
                              quality=trainer.quality)
        deadline = time.time() + 60 * minutes
        bar = _progress(progress, minutes)
        t_train, last_stats, step = time.time(), 0.0, 0
        poison_examples, in_stretch = None, False
        if poison:   # in seconds since the trainer started
            poison = (t_train - trainer.started + poison[0], poison[1])
        while time.time() < deadline and not trainer.stop_event.is_set():
            got = next(batches, None)
            if got is None:    # the Kafka stream stopped (stop_event)
                break
            position, (cols, y) = got
            x = trainer.inputs(cols)
            live = server.predict(x)
            frozen_out, _ = frozen.predict(x)
            summary.score(y, live, frozen_out["outputs"].reshape(-1))
            t = time.time() - trainer.started
            poisoned = bool(poison) and poison[0] <= t < poison[0] + poison[1]
            if poisoned != in_stretch:   # the stretch starts or ends: a commit at its edge, before this batch
                trainer.manager.save_delta(metadata=trainer.metadata, quality=trainer.quality)
                in_stretch = poisoned
            y_train = shuffle.permutation(y) if poisoned else y
            if poisoned:   # the examples of the stretch, as the trainer counts them: (after, up to]
                poison_examples = [trainer.examples if poison_examples is None else poison_examples[0],
                                   trainer.examples + len(y)]
            trainer.train(x, y_train, position, *trainer.score(x))   # scored before training: the commit's quality
            if feed is not None:
                feed.source.committed(trainer.manager.last_committed)   # offsets to the group, event -> commit
            step += 1
            if time.time() - last_stats > 2.0:
                trainer.snapshot_stats()
                trainer.write_summaries(writer, trainer.examples, summary.running())
                last_stats = time.time()
                if bar:
                    bar.update(last_stats, trainer, summary, server)
        train_seconds = time.time() - t_train
        final = trainer.manager.stop()                     # the final delta: nothing trained is lost
        # An upper bound: a loaded machine is slow. A gated server may hold the final commit instead, or
        # leave it waiting (too few examples since the last judged commit to judge it).
        held_final = lambda: gate is not None and final in _unserved(server.admin())  # noqa: E731
        _wait_for(lambda: server.observe() >= final or held_final(), 120)
        # Counted from the manager's history: retention may have deleted some by now.
        committed = sum(1 for m in trainer.manager.history if m.seq > first_full)
        deadline = time.time() + 30     # the server's counters follow its applies
        while True:
            server_metrics = server.metrics()
            skipped = len(_superseded(trainer.manager.history, first_full, server.published()))
            if (server_metrics.get("evstore_serving_checkpoints_applied_total", 0) >= committed + 1 - skipped
                    or time.time() > deadline or (gate is not None and (held_final() or server.observe() >= final))):
                break
            time.sleep(0.2)
        published = server.published()
        gate_status = server.admin() if gate is not None else None
    finally:
        server.stop()
        if bar is not None:
            bar.close()
        if feed is not None:
            try:
                feed.source.committed(trainer.manager.last_committed, wait=True)
            finally:
                feed.close()
    trainer.snapshot_stats()
    trainer.write_summaries(writer, trainer.examples, summary.running())
    result = summary.finish(first_full=first_full, final=final, train_seconds=train_seconds, steps=step,
                            server_seen=server.seen, spec=spec,
                            extra={"export": {"dir": os.path.abspath(export), "written": True,
                                              "serve": serve_command(export, root, server.name)}})
    if feed is not None:
        feed.source.ended = feed.source.ended or "demo time"
        result["kafka"] = dict(feed.source.report(), topic=feed.topic, bootstrap=feed.bootstrap,
                               bundled_broker=feed.broker is not None)
    sv = result["serving"]
    sv["applied_by_server"] = int(server_metrics.get("evstore_serving_checkpoints_applied_total", -1))
    sv["apply_failures"] = int(server_metrics.get("evstore_serving_apply_failures_total", -1))
    # The server loaded the first full at start, then applied each later commit once, except
    # those a newer full replaced before its next poll (it loads that full's chain instead).
    sv["superseded_by_a_newer_full"] = _superseded(trainer.manager.history, first_full, published)
    sv["served_every_commit"] = (sv["applied_by_server"] + len(sv["superseded_by_a_newer_full"])
                                 >= sv["committed_after_first_full"] + 1
                                 and sv["apply_failures"] == 0 and sv["served_final"])
    if gate is not None:
        sv["gate"] = {k: gate_status.get(k) for k in ("gate", "held", "held_version", "held_reason",
                                                      "held_back_total", "served_versions", "overdue_total")}
    if poison:
        result["poison"] = {"start_s": round(poison[0], 2), "end_s": round(poison[0] + poison[1], 2),
                            "examples": poison_examples,
                            "commits": _poisoned(trainer.manager.history, first_full, poison_examples)}
    if poison or gate is not None:
        result["report_png"] = write_report_png(result, result["report_png"])   # with the stretch and the gate
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    return result


def _superseded(history, first_full, seen):
    """Commits after `first_full` the server never served because a newer
    full, which it did serve, came before its next poll (`seen`: the versions
    the server published, from its own status rather than this client's polls,
    which can miss a full the server moved past quickly)."""
    fulls = [m.seq for m in history if m.kind == "full" and m.seq in seen]
    return [m.seq for m in history
            if m.seq > first_full and m.seq not in seen and any(f > m.seq for f in fulls)]


def _wait_for(cond, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if cond():
                return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the serving process did not apply the final checkpoint in time")


class _Bar:
    def __init__(self, minutes):
        from tqdm import tqdm
        self.t0 = time.time()
        self.bar = tqdm(total=int(60 * minutes), unit="s", desc="evstore demo", file=sys.stderr,
                        bar_format="{desc} {bar} {n_fmt}/{total_fmt}s {postfix}")

    def update(self, now, trainer, summary, server):
        self.bar.n = min(self.bar.total, int(now - self.t0))
        rows = sum(trainer.timeline[-1]["rows"].values()) if trainer.timeline else 0
        run = summary.running()
        self.bar.set_postfix_str(f"{trainer.examples / max(now - trainer.started, 1e-9):,.0f} ex/s  rows {rows:,}  "
                                 f"served seq {max(server.seen) if server.seen else '-'}  "
                                 f"AUC live {run.get('auc/live', float('nan')):.3f} "
                                 f"frozen {run.get('auc/frozen', float('nan')):.3f}")

    def close(self):
        self.bar.close()


def _progress(enabled, minutes):
    return _Bar(minutes) if enabled else None
