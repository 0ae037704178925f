"""The quality gate of a served model: which commits a server applies (docs/guides/quality-gate.md).

The gate's language and its judgement of a run of commits are evstore/gate.py
(`Gate.parse`, `Gate.admit`); this module is the serving side: `GateState`
keeps what a server reports (the reference, the held version, why, the
commits held back or waiting) and bounds how long a server holds
(`max_hold_commits`, `max_hold_s`): past the bound the hold is *overdue*,
said in the status, the metrics and the log, and `past_max_hold` decides
whether the server holds on ("hold") or serves the newest commit ("serve").
"""
import logging
import time

from evstore.gate import DEFAULT_GATE, DEFAULT_MIN_EXAMPLES, Gate, GateError
from evstore.quality import merge

__all__ = ["Gate", "GateError", "GateState", "DEFAULT_GATE", "DEFAULT_MIN_EXAMPLES", "PAST_MAX_HOLD",
           "register_metrics"]

log = logging.getLogger("evstore.serving")

PAST_MAX_HOLD = ("hold", "serve")


def _trailing(records, min_examples):
    """The merged record of the newest `records` that together cover
    `min_examples` examples (a record without `hist` only alone), or None."""
    run = []
    for q in reversed(records):
        if q is None:
            continue
        if q.get("hist") is None:
            return q if not run and q["examples"] >= min_examples else None
        run.append(q)
        m = merge(run)
        if m["examples"] >= min_examples:
            return m
    return None


class GateState:
    """What a gated server reports and how long it may hold: the reference,
    whether it holds, at which version, why, the commits held back or
    waiting, and whether the hold is past its bound (module docstring).

    `max_hold_commits` / `max_hold_s`: the bound (None: none) on the commits
    a server leaves unserved after the served one (held or waiting) and on
    the seconds since it first left one unserved; `past_max_hold`: "hold" or
    "serve". ValueError for anything else."""

    def __init__(self, gate, max_hold_commits=None, max_hold_s=None, past_max_hold="hold", clock=time.monotonic):
        if max_hold_commits is not None and (isinstance(max_hold_commits, bool) or
                                             not isinstance(max_hold_commits, int) or max_hold_commits < 1):
            raise ValueError(f"the gate's max_hold_commits must be an integer >= 1 or None, got {max_hold_commits!r}")
        if max_hold_s is not None and (isinstance(max_hold_s, bool) or not isinstance(max_hold_s, (int, float))
                                       or not max_hold_s >= 0):
            raise ValueError(f"the gate's max_hold_s must be a number of seconds >= 0 or None, got {max_hold_s!r}")
        if past_max_hold not in PAST_MAX_HOLD:
            raise ValueError(f"the gate's past_max_hold must be one of {PAST_MAX_HOLD}, got {past_max_hold!r}")
        self.gate = gate
        self.max_hold_commits, self.max_hold_s, self.past_max_hold = max_hold_commits, max_hold_s, past_max_hold
        self._clock = clock
        self.held = None             # {"version", "reason", "commits"} while commits failed, else None
        self.waiting = []            # commits after the last judged one: too few examples to judge yet
        self.waiting_examples = 0
        self.behind = 0              # commits after the served one not served (held or waiting)
        self._behind_since = None    # clock() when the server first left a commit unserved
        self.overdue = False         # the hold is past max_hold_commits / max_hold_s
        self.overdue_total = 0       # holds that went past the bound
        self.served_past_hold_total = 0   # commits served unjudged because past_max_hold is "serve"
        self.held_back_total = 0     # distinct commits that failed the gate
        self.reference = None        # quality record `served` means: the run that passed last
        self._tail = []              # records of the commits served since the reference was set
        self._failed = set()         # (seq, checksum) counted in held_back_total
        self.served_versions = []    # the versions the gate let be served (newest 1000), in order

    def select(self, version, pending, reference=None, holding=False, extend=False):
        """The commits of `pending` (after served `version`, in chain order) to
        apply now, and the record that passed (None: none judged). Judges them
        against `reference` (default: the state's), records what failed and
        what waits; past the hold bound, says so and with past_max_hold
        "serve" returns them all. [] holds."""
        adm = self.gate.admit(pending, self.reference if reference is None else reference, holding=holding)
        self.note(version, pending, adm.failed, extend=extend)
        if adm.run:
            return adm.run, adm.judged
        self.waiting = adm.waiting
        by_seq = {m.seq: m for m in pending}
        self.waiting_examples = sum((by_seq[s].quality or {}).get("examples", 0) for s in adm.waiting)
        held = set(self.held["commits"]) if self.held else set()
        self.behind = len(held | {m.seq for m in pending})
        now = self._clock()
        if self._behind_since is None:
            self._behind_since = now
        over = ((self.max_hold_commits is not None and self.behind >= self.max_hold_commits) or
                (self.max_hold_s is not None and now - self._behind_since >= self.max_hold_s))
        if over and not self.overdue:
            self.overdue = True
            self.overdue_total += 1
            log.error("the quality gate has held version %s for %d commits and %.0f s, past its bound "
                      "(max_hold_commits %s, max_hold_s %s): %s", version, self.behind, now - self._behind_since,
                      self.max_hold_commits, self.max_hold_s,
                      "serving the newest commit unjudged" if self.past_max_hold == "serve" else "holding on")
        if over and self.past_max_hold == "serve":
            self.served_past_hold_total += len(pending)
            return list(pending), None
        return [], None

    def note(self, version, pending, failed, extend=False):
        """Records the commits of `pending` (after served `version`) that
        `admit` failed: counted once each, logged, and held until `clear`
        (`extend`: added to those held already, from another chain)."""
        by_seq = {m.seq: m for m in pending}
        for seq, why in failed:
            key = (seq, by_seq[seq].checksum)
            if key not in self._failed:
                self._failed.add(key)
                self.held_back_total += 1
                log.warning("commit %d held back by the quality gate: %s (serving %s)", seq, why, version)
        if failed and extend and self.held is not None:
            self.held["commits"] = self.held["commits"] + [seq for seq, _ in failed
                                                           if seq not in self.held["commits"]]
        elif failed:
            first = failed[0]
            self.held = {"version": version, "reason": f"commit {first[0]}: {first[1]}",
                         "commits": [seq for seq, _ in failed]}

    def served(self, quality):
        """A commit with record `quality` was published: the reference becomes
        the newest served commits that cover min_examples, when they do."""
        self._tail.append(quality)
        ref = _trailing(self._tail, self.gate.min_examples)
        if ref is not None:
            self.reference, self._tail = ref, []

    def passed(self, judged, serving, clear=True):
        """The run that `select` returned was published, up to `serving`:
        `judged` (its record that passed, None when served past the bound)
        becomes the reference; `clear`: nothing is held any more (False: a
        reload, whose last `select` said what holds after it)."""
        if judged is not None:
            self.reference, self._tail = judged, []
        self.served_versions = (self.served_versions + [serving])[-1000:]
        if clear:
            self.clear(serving=serving)

    def clear(self, serving=None):
        """Nothing is held back or waiting (any more); `serving`: the commit now served."""
        if (self.held is not None or self.overdue) and serving is not None:
            log.info("commit %d passes the quality gate: serving again (held at %s)", serving,
                     self.held["version"] if self.held else "the previous version")
        self.held, self.waiting, self.waiting_examples, self.behind = None, [], 0, 0
        self._behind_since, self.overdue = None, False

    def status(self):
        """The gate's part of the admin status."""
        return {"gate": self.gate.text, "gate_min_examples": self.gate.min_examples,
                "reference": _summary(self.reference),
                "held": self.held is not None,
                "held_version": None if self.held is None else self.held["version"],
                "held_reason": None if self.held is None else self.held["reason"],
                "held_commits": [] if self.held is None else list(self.held["commits"]),
                "held_back_total": self.held_back_total,
                "waiting_commits": list(self.waiting), "waiting_examples": self.waiting_examples,
                "behind_commits": self.behind,
                "behind_s": 0.0 if self._behind_since is None else round(self._clock() - self._behind_since, 3),
                "max_hold_commits": self.max_hold_commits, "max_hold_s": self.max_hold_s,
                "past_max_hold": self.past_max_hold, "overdue": self.overdue,
                "overdue_total": self.overdue_total, "served_past_hold_total": self.served_past_hold_total,
                "served_versions": list(self.served_versions)}


def _summary(record):
    """A quality record without its histograms (the status's view)."""
    if record is None:
        return None
    return {k: (_summary(v) if k == "reference" else v) for k, v in record.items() if k != "hist"}


class _Collector:
    """The gate's Prometheus metrics, read from a ServingModel at each scrape."""

    def __init__(self, model):
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.model.gate.status()
        yield GaugeMetricFamily("evstore_serving_gate_held", "1 while the quality gate holds the served version "
                                "(a newer commit failed it), else 0", value=1 if st["held"] else 0)
        yield GaugeMetricFamily("evstore_serving_gate_held_version", "Version the gate holds (-1: not holding)",
                                value=-1 if st["held_version"] is None else st["held_version"])
        yield GaugeMetricFamily("evstore_serving_gate_held_commits", "Commits newer than the served one that the "
                                "gate holds back now", value=len(st["held_commits"]))
        yield CounterMetricFamily("evstore_serving_gate_held_back", "Commits that failed the quality gate "
                                  "(each counted once)", value=st["held_back_total"])
        yield GaugeMetricFamily("evstore_serving_gate_waiting_commits", "Commits after the last judged one, "
                                "waiting for enough examples to be judged", value=len(st["waiting_commits"]))
        yield GaugeMetricFamily("evstore_serving_gate_behind_commits", "Commits after the served one that the "
                                "server does not serve (held back or waiting)", value=st["behind_commits"])
        yield GaugeMetricFamily("evstore_serving_gate_behind_seconds", "Seconds since the server first left a "
                                "commit unserved (0: serving the newest)", value=st["behind_s"])
        yield GaugeMetricFamily("evstore_serving_gate_overdue", "1 while the server holds past the gate's bound "
                                "(--gate-max-hold-commits / --gate-max-hold-seconds), else 0",
                                value=1 if st["overdue"] else 0)
        yield CounterMetricFamily("evstore_serving_gate_overdue_holds", "Holds that went past the gate's bound",
                                  value=st["overdue_total"])
        yield CounterMetricFamily("evstore_serving_gate_served_past_hold", "Commits served unjudged past the "
                                  "gate's bound (--gate-past-max-hold serve)", value=st["served_past_hold_total"])
        info = GaugeMetricFamily("evstore_serving_gate_info", "The gate expression and, while holding, why "
                                 "(value 1)", labels=["gate", "reason"])
        info.add_metric([st["gate"], st["held_reason"] or ""], 1)
        yield info

    def describe(self):
        return []


def register_metrics(registry, model):
    """Adds the quality gate's metrics of `model` (a gated ServingModel) to a prometheus_client registry."""
    registry.register(_Collector(model))
