"""The job's final report: what the run did and what it measured."""
import json
import os

import numpy as np

import checkpoint
from evstore_app.job.model import build_model

__all__ = ["Summary", "state_matches"]


def _ev_state(model, names):
    out = {}
    for n in names:
        x = model.get_layer(n).ev.export()
        k = np.argsort(x["keys"].numpy())
        out[n] = {c: x[c].numpy()[k] for c in ("keys", "values", "versions", "freqs")}
        fk = np.argsort(x["filtered_keys"].numpy())
        out[n]["filtered"] = x["filtered_keys"].numpy()[fk]
    return out


def state_matches(spec, root, model):
    """Restores the newest chain of `root` into a fresh model; True if every EV
    (rows, versions, freqs, counted keys) and every weight equals `model`'s."""
    fresh = build_model(spec)
    checkpoint.CheckpointManager(root, fresh).restore()
    names = [f["name"] for f in spec["sparse"]]
    a, b = _ev_state(model, names), _ev_state(fresh, names)
    for n in names:
        for c in a[n]:
            if not np.array_equal(a[n][c], b[n][c]):
                return False
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(model.get_weights(), fresh.get_weights()))


class Summary:
    def __init__(self, out, trainer):
        self.out, self.trainer = out, trainer
        self.labels, self.live, self.frozen = [], [], []

    def score(self, y, live, frozen=None):
        self.labels.append(np.asarray(y))
        self.live.append(np.asarray(live))
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

    def finish(self, first_full, final, train_seconds, steps, server_seen=None, spec=None, extra=None):
        from evstore_app.job.trainer import auc
        t = self.trainer
        sc = checkpoint.scan(t.manager.storage)
        ms = [m for q, m in sorted(sc.manifests.items()) if q >= first_full]
        fulls = [m.total_bytes for m in ms if m.kind == "full"]
        deltas = [m.total_bytes for m in ms if m.kind == "delta"]
        y = np.concatenate(self.labels) if self.labels else np.zeros(0)
        res = {
            "out": self.out,
            "examples": t.examples, "steps": steps, "train_seconds": round(train_seconds, 2),
            "examples_per_s": round(t.examples / max(train_seconds, 1e-9), 1),
            "checkpoints": {"first_full": first_full, "final": final, "fulls": len(fulls), "deltas": len(deltas),
                            "full_bytes_mean": int(np.mean(fulls)) if fulls else 0,
                            "delta_bytes_mean": int(np.mean(deltas)) if deltas else 0,
                            "delta_bytes_p50": int(np.percentile(deltas, 50)) if deltas else 0},
            "tables": t.timeline[-1] if t.timeline else {},
            "rows_over_time": [{"t": p["t"], "rows": sum(p["rows"].values())} for p in t.timeline],
            "auc": {"live": auc(y, np.concatenate(self.live)) if self.live else float("nan"),
                    "frozen": auc(y, np.concatenate(self.frozen)) if self.frozen else float("nan")},
        }
        if server_seen is not None:
            committed = [m.seq for m in ms if m.seq > first_full]
            fresh = [server_seen[m.seq] - m.wall_time for m in ms if m.seq in server_seen and m.seq > first_full]
            res["serving"] = {
                "committed_after_first_full": len(committed),
                "seen_by_client": sorted(q for q in server_seen if q > first_full),
                "served_final": final in server_seen,
                "freshness_p50_s": round(float(np.percentile(fresh, 50)), 3) if fresh else None,
                "freshness_p99_s": round(float(np.percentile(fresh, 99)), 3) if fresh else None,
            }
        if spec is not None:
            res["restore_matches_trainer"] = state_matches(spec, t.manager.root, t.model)
        res.update(extra or {})
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
        return res


def format_summary(res):
    """The human-readable summary printed at the end of a run."""
    lines = [f"examples: {res['examples']:,} in {res['train_seconds']} s ({res['examples_per_s']:,.0f} examples/s)"]
    c = res["checkpoints"]
    ratio = c["delta_bytes_mean"] / c["full_bytes_mean"] if c["full_bytes_mean"] else float("nan")
    lines.append(f"checkpoints: {c['fulls']} fulls (mean {c['full_bytes_mean'] / 2**20:.2f} MiB), {c['deltas']} deltas "
                 f"(mean {c['delta_bytes_mean'] / 2**20:.3f} MiB = {ratio:.1%} of a full)")
    tb = res.get("tables") or {}
    for n in (tb.get("rows") or {}):
        lines.append(f"table {n}: {tb['rows'][n]:,} rows, {tb['filtered'][n]:,} counted not admitted, "
                     f"{tb['evicted'][n]:,} evicted")
    if res.get("rows_over_time"):
        pts = res["rows_over_time"]
        pick = pts[:: max(1, len(pts) // 6)] + [pts[-1]]
        lines.append("rows over time: " + ", ".join(f"{p['t']:.0f}s {p['rows']:,}" for p in pick))
    s = res.get("serving")
    if s:
        every = s.get("served_every_commit")
        lines.append(f"serving: {s.get('applied_by_server', '?')} checkpoints applied by the server process "
                     f"({s['committed_after_first_full']} committed after the first full; every one served: {every}); "
                     f"freshness p50 {s['freshness_p50_s']} s, p99 {s['freshness_p99_s']} s "
                     "(commit -> served, seen by a client)")
    a = res["auc"]
    if a["frozen"] == a["frozen"]:
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
    lines.append(f"output: {res['out']} (summary.json, tensorboard/)")
    return "\n".join(lines)
