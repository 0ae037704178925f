"""The job's final report: what the run did and what it measured."""
import json
import os

import numpy as np

import checkpoint
from evstore_app.job.model import build_model, field_ev

__all__ = ["Summary", "state_matches", "format_offsets"]


def _ev_state(model, names):
    out = {}
    for n in names:
        x = field_ev(model, n).export()
        k = np.argsort(x["keys"].numpy())
        out[n] = {c: x[c].numpy()[k] for c in ("keys", "values", "versions", "freqs")}
        fk = np.argsort(x["filtered_keys"].numpy())
        out[n]["filtered"] = x["filtered_keys"].numpy()[fk]
    return out


def state_matches(spec, root, model, seq=None):
    """Restores the newest chain of `root` (or the one ending at `seq`) into a
    fresh model; True if every EV (rows, versions, freqs, counted keys) and
    every weight equals `model`'s."""
    fresh = build_model(spec)
    checkpoint.CheckpointManager(root, fresh).restore(seq=seq)
    names = [f["name"] for f in spec["sparse"]]
    a, b = _ev_state(model, names), _ev_state(fresh, names)
    for n in names:
        for c in a[n]:
            if not np.array_equal(a[n][c], b[n][c]):
                return False
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(model.get_weights(), fresh.get_weights()))


def _pick(points, n=7):
    """At most `n` evenly spread points, first and last included, none twice."""
    if len(points) <= n:
        return list(points)
    return [points[i] for i in sorted(set(np.linspace(0, len(points) - 1, n).round().astype(int)))]


class Summary:
    """What a run measured: progressive scores per batch (live model, and a
    frozen one where there is one), and at the end the summary dict built from
    the whole history of this run (the manager's commits, the trainer's
    timeline), not from what checkpoint retention left on the root."""

    def __init__(self, out, trainer):
        self.out, self.trainer = out, trainer
        self.labels, self.live, self.frozen, self.times = [], [], [], []

    def score(self, y, live, frozen=None):
        import time
        self.labels.append(np.asarray(y))
        self.live.append(np.asarray(live))
        self.times.append(time.time() - self.trainer.started)
        if frozen is not None:
            self.frozen.append(np.asarray(frozen))

    def running(self, window=200):
        from evstore_app.job.trainer import auc
        if not self.labels:
            return {}
        y = np.concatenate(self.labels[-window:])
        r = {"auc/live": auc(y, np.concatenate(self.live[-window:]))}
        if self.frozen:
            r["auc/frozen"] = auc(y, np.concatenate(self.frozen[-window:]))
        return r

    def auc_over_time(self, points=60, window=50):
        """[(seconds, live AUC, frozen AUC or None)] over sliding windows of batches."""
        from evstore_app.job.trainer import auc
        out = []
        n = len(self.labels)
        if n == 0:
            return out
        for hi in sorted(set(np.linspace(1, n, min(points, n)).round().astype(int))):
            lo = max(0, hi - window)
            y = np.concatenate(self.labels[lo:hi])
            live = auc(y, np.concatenate(self.live[lo:hi]))
            frozen = auc(y, np.concatenate(self.frozen[lo:hi])) if self.frozen else None
            out.append((round(self.times[hi - 1], 2), live, frozen))
        return out

    def finish(self, first_full, final, train_seconds, steps, server_seen=None, spec=None, extra=None, seq=None):
        from evstore_app.job.trainer import auc
        t = self.trainer
        history = list(t.manager.history)                 # every commit of this run, deleted ones too
        ms = [m for m in history if first_full is not None and m.seq >= first_full]
        fulls = [m.total_bytes for m in ms if m.kind == "full"]
        untrained = [m for m in ms if m.kind == "full" and m.metadata.get("examples", 0) == 0]
        deltas = [m.total_bytes for m in ms if m.kind == "delta"]
        # A full worth comparing a delta with holds trained state (train's first full is the empty model).
        trained = [m for m in history if m.kind == "full" and m.metadata.get("examples", 0) > 0]
        if not trained:
            sc = checkpoint.scan(t.manager.storage)
            trained = [m for _, m in sorted(sc.manifests.items())
                       if m.kind == "full" and m.metadata.get("examples", 0) > 0]
        y = np.concatenate(self.labels) if self.labels else np.zeros(0)
        session = t.session_examples
        res = {
            "out": self.out,
            "examples": t.examples, "examples_this_session": session, "resumed_at": t.resumed_at,
            "steps": steps, "train_seconds": round(train_seconds, 2),
            "examples_per_s": round(session / max(train_seconds, 1e-9), 1),
            "checkpoints": {"first_full": first_full, "final": final, "fulls": len(fulls), "deltas": len(deltas),
                            "untrained_fulls": len(untrained),
                            "full_bytes_mean": int(np.mean(fulls)) if fulls else 0,
                            "delta_bytes_mean": int(np.mean(deltas)) if deltas else 0,
                            "delta_bytes_p50": int(np.percentile(deltas, 50)) if deltas else 0,
                            "reference_full": ({"seq": trained[-1].seq, "bytes": trained[-1].total_bytes}
                                               if trained else None),
                            "commits": [{"seq": m.seq, "kind": m.kind, "bytes": m.total_bytes,
                                         "t": round(m.wall_time - t.started, 2)} for m in ms]},
            "tables": t.timeline[-1] if t.timeline else {},
            "timeline": t.timeline,
            "rows_over_time": [{"t": p["t"], "rows": sum(p["rows"].values())} for p in t.timeline],
            "auc": {"live": auc(y, np.concatenate(self.live)) if self.live else None,
                    "frozen": auc(y, np.concatenate(self.frozen)) if self.frozen else None},
            "auc_over_time": self.auc_over_time(),
        }
        if server_seen is not None:
            committed = [m.seq for m in ms if m.seq > first_full]
            fresh = [(round(m.wall_time - t.started, 2), server_seen[m.seq] - m.wall_time)
                     for m in ms if m.seq in server_seen and m.seq > first_full]
            res["serving"] = {
                "committed_after_first_full": len(committed),
                "seen_by_client": sorted(q for q in server_seen if q > first_full),
                "served_final": final in server_seen,
                "freshness_p50_s": round(float(np.percentile([f for _, f in fresh], 50)), 3) if fresh else None,
                "freshness_p99_s": round(float(np.percentile([f for _, f in fresh], 99)), 3) if fresh else None,
                "freshness": fresh,
            }
        if spec is not None:
            res["restore_matches_trainer"] = state_matches(spec, t.manager.root, t.model, seq=seq)
        res.update(extra or {})
        res["report_png"] = write_report_png(res, os.path.join(self.out, "report.png"))
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
        return res


def write_report_png(res, path):
    """Draws the run (a summary dict) into a PNG at `path`; returns `path`.

    Panels: rows over time per table; admitted / filtered (counted, not
    admitted) / evicted per table; delta and full sizes; freshness (commit ->
    served, when a server ran); progressive AUC of the live model (and of the
    frozen one, in the demo) over sliding windows of batches."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))
    ax = ax.ravel()
    tl = res.get("timeline") or []
    ts = [p["t"] for p in tl]
    for name in (tl[-1]["rows"] if tl else {}):
        ax[0].plot(ts, [p["rows"][name] for p in tl], label=name)
        ax[1].plot(ts, [p["rows"][name] for p in tl], label=f"{name} admitted")
        ax[1].plot(ts, [p["filtered"][name] for p in tl], "--", label=f"{name} filtered")
        ax[1].plot(ts, [p["evicted"][name] for p in tl], ":", label=f"{name} evicted")
    ax[0].set_title("rows over time")
    ax[1].set_title("admitted / filtered (counted, not admitted) / evicted")
    commits = res["checkpoints"].get("commits") or []
    for kind, marker in (("full", "s"), ("delta", "o")):
        pts = [(c["t"], c["bytes"] / 2**20) for c in commits if c["kind"] == kind]
        if pts:
            ax[2].scatter(*zip(*pts), marker=marker, label=f"{kind}s ({len(pts)})")
    ax[2].set_yscale("log")
    ax[2].set_title("checkpoint sizes (MiB, log scale)")
    fresh = (res.get("serving") or {}).get("freshness") or []
    by_commit = (res.get("kafka") or {}).get("event_to_commit_by_commit") or []
    at = {c["seq"]: c["t"] for c in commits}
    if fresh:
        ax[3].plot([f[0] for f in fresh], [f[1] for f in fresh], "o-", ms=3)
        ax[3].set_ylabel("seconds")
        ax[3].set_title("freshness: commit -> served (seen by a client)")
    elif by_commit:
        pts = [(at[c["seq"]], c["p50_s"], c["p99_s"]) for c in by_commit if c["seq"] in at]
        ax[3].plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label="p50")
        ax[3].plot([p[0] for p in pts], [p[2] for p in pts], "o--", ms=3, label="p99")
        ax[3].set_ylabel("seconds")
        ax[3].set_title("freshness: event time (producer) -> commit, per commit")
    else:
        ax[3].set_title("freshness")
        ax[3].text(0.5, 0.5, "no server in this run", ha="center", va="center", transform=ax[3].transAxes)
    series = res.get("auc_over_time") or []
    if series:
        ax[4].plot([p[0] for p in series], [p[1] for p in series], label="live (updated online)")
        if any(p[2] is not None for p in series):
            ax[4].plot([p[0] for p in series], [p[2] for p in series], label="frozen at the first full")
    else:
        ax[4].text(0.5, 0.5, "no new rows trained", ha="center", va="center", transform=ax[4].transAxes)
    poison = res.get("poison")
    if poison:
        ax[4].axvspan(poison["start_s"], poison["end_s"], color="tab:red", alpha=0.12, label="training labels shuffled")
    gate = (res.get("serving") or {}).get("gate")
    ax[4].set_title("progressive AUC (each batch scored before training)"
                    + (f"\nserver gated: {gate['gate']}" if gate else ""))
    a = res.get("auc") or {}
    c = res["checkpoints"]
    lines = [f"examples this run: {res.get('examples_this_session', res['examples']):,}",
             f"examples/s: {res['examples_per_s']:,.0f}",
             f"commits: {_count(c['fulls'], 'full')}, {_count(c['deltas'], 'delta')}"]
    if a.get("live") is not None:
        lines.append(f"AUC live {a['live']:.4f}" + (f", frozen {a['frozen']:.4f}" if a.get("frozen") is not None
                                                     else ""))
    k = res.get("kafka")
    if k:
        lines.append(f"kafka: {k['messages']:,} messages, {k['bad']:,} bad")
        f = k.get("event_to_commit")
        if f:
            lines.append(f"event -> commit p50 {f['p50_s']} s, p99 {f['p99_s']} s")
    ax[5].axis("off")
    ax[5].text(0.02, 0.95, "\n".join(lines), va="top", family="monospace", transform=ax[5].transAxes)
    for i in range(5):
        ax[i].set_xlabel("seconds since start")
        if ax[i].get_legend_handles_labels()[0]:
            ax[i].legend(fontsize=8)
        ax[i].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def format_offsets(position):
    """"topic[0]@120 topic[1]@98" for a Kafka position dict."""
    parts = [f"{t}[{p}]@{off:,}" for t, ps in sorted((position.get("kafka") or {}).items())
             for p, off in sorted(ps.items(), key=lambda kv: int(kv[0]))]
    return " ".join(parts) or "(none)"


def _kafka_lines(k):
    """The Kafka source's lines of the summary: offsets reached, lag, bad
    messages, event time -> commit, broker waits."""
    lines = [f"kafka: {k['source']}: {k['messages']:,} messages consumed in all, ended by {k['ended']}; offsets "
             f"{format_offsets({'kafka': k['offsets']})}"]
    lag = k.get("lag") or {}
    if lag:
        lines.append("kafka lag at the end: " + ", ".join(f"{p} {v:,}" if v is not None else f"{p} ?"
                                                         for p, v in lag.items()))
    if k.get("bad"):
        reasons = ", ".join(f"{r}: {n:,}" for r, n in sorted(k["bad_reasons"].items()))
        lines.append(f"kafka bad messages skipped: {k['bad']:,} in all ({reasons or 'before this run'})"
                     + (f", produced to {k['dead_letter_topic']}" if k.get("dead_letter_topic") else ""))
    f = k.get("event_to_commit")
    if f:
        lines.append(f"event time -> commit: p50 {f['p50_s']} s, p99 {f['p99_s']} s, max {f['max_s']} s "
                     f"({f['events']:,} events)")
    if k.get("broker_waits_s"):
        lines.append(f"waited for the Kafka broker {len(k['broker_waits_s'])} time(s): "
                     + ", ".join(f"{w} s" for w in k["broker_waits_s"]))
    return lines


def _count(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def _checkpoints_phrase(c):
    """The summary's account of the commits of a run, e.g. "1 full (the initial,
    untrained model: 0.06 MiB), 1 delta (0.681 MiB; ...)"."""
    parts = []
    untrained = c.get("untrained_fulls", 0)
    if c["fulls"]:
        size = f"{c['full_bytes_mean'] / 2**20:.2f} MiB"
        if c["fulls"] == 1 and untrained == 1:
            parts.append(f"1 full (the initial, untrained model: {size})")
        elif c["fulls"] == 1:
            parts.append(f"1 full ({size})")
        else:
            parts.append(f"{c['fulls']} fulls (mean {size}"
                         + (f"; {untrained} of them the initial, untrained model" if untrained else "") + ")")
    if c["deltas"]:
        size = f"{c['delta_bytes_mean'] / 2**20:.3f} MiB"
        ref = c.get("reference_full")
        phrase = f"{_count(c['deltas'], 'delta')} ({'mean ' if c['deltas'] > 1 else ''}{size}"
        if ref:
            phrase += f" = {c['delta_bytes_mean'] / ref['bytes']:.1%} of the newest full of trained state, " \
                      f"{ref['bytes'] / 2**20:.2f} MiB)"
        else:
            phrase += "; no full of trained state yet to compare with)"
        parts.append(phrase)
    return ", ".join(parts)


def format_summary(res):
    """The human-readable summary printed at the end of a run."""
    session = res.get("examples_this_session", res["examples"])
    lines = []
    kafka = res.get("kafka")
    if res.get("resumed_at") is not None:
        at = (f"offsets {format_offsets(res['resumed_at'])}" if isinstance(res["resumed_at"], dict)
              else f"row {res['resumed_at']:,}")
        lines.append(f"resumed at {at} ({res['examples'] - session:,} examples trained before this run)")
    if kafka:
        lines.extend(_kafka_lines(kafka))
    if session == 0 and res.get("resumed_at") is not None and not kafka:
        lines.append(f"nothing new to train: the checkpoint root is at row {res.get('position', res['resumed_at']):,}"
                     f" of {res.get('rows_in_data', '?'):,} (no checkpoint committed)")
    elif session == 0 and not kafka and not res.get("rows_in_data"):
        lines.append("nothing to train: no rows (--max-rows 0 or empty data); no checkpoint committed")
    else:
        lines.append(f"examples: {session:,} this run in {res['train_seconds']} s ({res['examples_per_s']:,.0f} "
                     "examples/s)" + (f"; {res['examples']:,} in all" if res["examples"] != session else ""))
    c = res["checkpoints"]
    ref = c.get("reference_full")
    if c["fulls"] or c["deltas"]:
        lines.append("checkpoints: " + _checkpoints_phrase(c))
    tb = res.get("tables") or {}
    for n in (tb.get("rows") or {}):
        lines.append(f"table {n}: {tb['rows'][n]:,} rows, {tb['filtered'][n]:,} counted not admitted, "
                     f"{tb['evicted'][n]:,} evicted")
    pts = res.get("rows_over_time") or []
    if len(pts) > 1:
        lines.append("rows over time: " + ", ".join(f"{p['t']:.0f}s {p['rows']:,}" for p in _pick(pts)))
    s = res.get("serving")
    if s:
        every = s.get("served_every_commit")
        skipped = s.get("superseded_by_a_newer_full") or []
        lines.append(f"serving: {s.get('applied_by_server', '?')} checkpoints applied by the server process "
                     f"(the first full and {s['committed_after_first_full']} commits after it"
                     + (f"; {len(skipped)} replaced by a newer full before the server's next poll: "
                        f"{', '.join(map(str, skipped))}" if skipped else "")
                     + f"; {s.get('apply_failures', '?')} failures; every one served: {every}); "
                     f"freshness p50 {s['freshness_p50_s']} s, p99 {s['freshness_p99_s']} s "
                     "(commit -> served, seen by a client)")
    a = res["auc"]
    if a.get("live") is None:
        pass
    elif a.get("frozen") is not None:
        lines.append(f"progressive AUC: live-updated server {a['live']:.4f} vs frozen at the first full "
                     f"{a['frozen']:.4f}")
    else:
        lines.append(f"progressive AUC (each batch scored before training on it): {a['live']:.4f}")
    if "restore_matches_trainer" in res:
        lines.append(f"restore of the final chain equals the trainer's state: {res['restore_matches_trainer']}")
    if res.get("export"):
        e = res["export"]
        lines.append(f"serving export: {e['dir']} ({'written' if e['written'] else 'kept: this model'}); serve it "
                     f"with: {e['serve']}")
    lines.append(f"report: {res['report_png']}")
    lines.append(f"output: {res['out']} (summary.json, report.png; TensorBoard scalars: "
                 f"tensorboard --logdir {os.path.join(res['out'], 'tensorboard')}, after "
                 "pip install 'evstore[tensorboard]')")
    return "\n".join(lines)
