"""The quality gate of a served model: which commits a server applies (docs/guides/quality-gate.md).

A gate is a list of clauses, all of which a commit must pass to be served:

    auc >= served - 0.01, logloss <= served * 1.05

Each clause is `<metric> <op> <expression>`: the metric is a field of the
commit's quality record (evstore.quality: auc, logloss, examples,
label_rate), the op one of >=, <=, >, <, and the expression arithmetic
(+ - * /, parentheses, numbers) over `served` (the served commit's value
of the same metric) and `served.<metric>` (any metric of the served commit).

Rules (what `Gate.decide` does):
  * a commit without a quality record (written before quality existed, or by
    a trainer that gives none) passes: it is not judged; nor is one whose
    record covers fewer than `min_examples` examples (default 1000: figures
    of fewer are noise), which also never becomes the reference: `served`
    is the newest served commit that was judged (`GateState.reference`);
  * a clause whose metric the commit lacks (None: an AUC of one class) is not
    judged, nor one that refers to a served value that is missing (the
    served commit has no record); every clause judged must hold.

`Gate.admit` walks the commits after the served one in chain order and
returns those to apply now: up to and including the first that passes (the
chain is applied up to it), or none (the server holds). A commit that is not
judged passes unless one before it failed: it cannot end a hold. `GateState` keeps
what a server reports: the held version, why, the commits held back.
"""
import ast
import logging
import operator

from evstore.quality import FIELDS

__all__ = ["Gate", "GateError", "GateState", "DEFAULT_GATE", "register_metrics"]

log = logging.getLogger("evstore.serving")

DEFAULT_GATE = "auc >= served - 0.01, logloss <= served * 1.05"
DEFAULT_MIN_EXAMPLES = 1000

_OPS = {ast.GtE: (">=", operator.ge), ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt),
        ast.Lt: ("<", operator.lt)}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class GateError(ValueError):
    """A malformed gate expression; the message is one line naming the clause."""


class _Missing(Exception):
    """A value the clause needs is not recorded: the clause is not judged."""


class _Clause:
    def __init__(self, text, metric, op, expr):
        self.text, self.metric, self.op, self.expr = text, metric, op, expr

    def _eval(self, node, served):
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, served)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = self._eval(node.left, served), self._eval(node.right, served)
            if isinstance(node.op, ast.Div) and b == 0:
                raise _Missing()
            return _ARITH[type(node.op)](a, b)
        field = self.metric if isinstance(node, ast.Name) else node.attr   # `served` / `served.<metric>`
        v = (served or {}).get(field)
        if v is None:
            raise _Missing()
        return float(v)

    def check(self, quality, served):
        """None when the clause holds or is not judged, else why it fails."""
        value = quality.get(self.metric)
        if value is None:
            return None
        try:
            bound = self._eval(self.expr, served)
        except _Missing:
            return None
        sym, fn = _OPS[type(self.op)]
        if fn(float(value), bound):
            return None
        return f"{self.metric} {value:.4g} is not {sym} {bound:.4g} ({self.text})"


class Gate:
    """A parsed gate expression (module docstring). `Gate.parse(text)`
    raises GateError (a ValueError) with a one-line message for anything
    malformed."""

    def __init__(self, text, clauses, min_examples=DEFAULT_MIN_EXAMPLES):
        self.text = text
        self.clauses = clauses
        self.min_examples = min_examples

    def __repr__(self):
        return f"Gate({self.text!r})"

    @classmethod
    def parse(cls, text=DEFAULT_GATE, min_examples=DEFAULT_MIN_EXAMPLES):
        """The Gate of `text` ("default": DEFAULT_GATE); commits of fewer than
        `min_examples` examples are not judged (an integer >= 0)."""
        if isinstance(min_examples, bool) or not isinstance(min_examples, int) or min_examples < 0:
            raise GateError(f"the gate's min_examples must be an integer >= 0, got {min_examples!r}")
        if text == "default":
            text = DEFAULT_GATE
        if not isinstance(text, str) or not text.strip():
            raise GateError(f"a gate is one or more clauses like {DEFAULT_GATE!r}, got {text!r}")
        clauses = []
        for i, part in enumerate(text.split(","), 1):
            part = " ".join(part.split())
            clauses.append(_parse_clause(part, i))
        return cls(text, clauses, min_examples)

    def judged(self, quality):
        """Whether a commit with this quality record is judged (and can be a reference)."""
        return quality is not None and quality.get("examples", 0) >= self.min_examples

    def reference_after(self, reference, quality):
        """The reference once a commit with record `quality` is served."""
        return quality if self.judged(quality) else reference

    def decide(self, quality, served):
        """None if a commit with quality record `quality` may be served after
        one with `served` (either may be None: not recorded), else the reason
        it may not (one line)."""
        if not self.judged(quality):
            return None
        fails = [r for r in (c.check(quality, served) for c in self.clauses) if r is not None]
        return "; ".join(fails) if fails else None

    def admit(self, pending, served, holding=False):
        """`pending`: the commits after the served one, in chain order (objects
        with .seq and .quality); `holding`: commits before them are held
        already. Returns (the commits to apply now: up to and including the
        first that passes, or [] to hold; [(seq, reason)] of the commits held
        back before it)."""
        failed = []
        for i, m in enumerate(pending):
            if (failed or holding) and not self.judged(m.quality):   # no evidence that the damage is over
                n = "no quality" if m.quality is None else f"{m.quality.get('examples', 0)} examples"
                failed.append((m.seq, f"not judged ({n}; min_examples {self.min_examples}): it cannot end a hold"))
                continue
            why = self.decide(m.quality, served)
            if why is None:
                return list(pending[:i + 1]), failed
            failed.append((m.seq, why))
        return [], failed


def _parse_clause(part, i):
    where = f"gate clause {i} {part!r}"
    if not part:
        raise GateError(f"gate clause {i} is empty (clauses are separated by commas)")
    try:
        tree = ast.parse(part, mode="eval").body
    except SyntaxError as e:
        raise GateError(f"{where}: not an expression ({e.msg})") from None
    if not isinstance(tree, ast.Compare) or len(tree.ops) != 1:
        raise GateError(f"{where}: a clause is <metric> <op> <expression>, op one of >=, <=, >, <")
    if type(tree.ops[0]) not in _OPS:
        raise GateError(f"{where}: the comparison must be one of >=, <=, >, <")
    left, right = tree.left, tree.comparators[0]
    if not isinstance(left, ast.Name) or left.id not in FIELDS:
        raise GateError(f"{where}: the left side must be one of the metrics {', '.join(FIELDS)}")
    _check_expr(right, where)
    return _Clause(part, left.id, tree.ops[0], right)


def _check_expr(node, where):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise GateError(f"{where}: {node.value!r} is not a number")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check_expr(node.operand, where)
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        _check_expr(node.left, where)
        _check_expr(node.right, where)
    elif isinstance(node, ast.Name):
        if node.id != "served":
            raise GateError(f"{where}: unknown name {node.id!r} (the right side may use numbers, served and "
                            f"served.<metric>: {', '.join(FIELDS)})")
    elif isinstance(node, ast.Attribute):
        if not (isinstance(node.value, ast.Name) and node.value.id == "served" and node.attr in FIELDS):
            raise GateError(f"{where}: {ast.unparse(node)!r} is not served.<metric> ({', '.join(FIELDS)})")
    else:
        raise GateError(f"{where}: {ast.unparse(node)!r} is not allowed (numbers, + - * /, parentheses, served, "
                        "served.<metric>)")


class GateState:
    """What a gated server reports: whether it holds, at which version, why,
    and how many commits the gate has held back in all."""

    def __init__(self, gate):
        self.gate = gate
        self.held = None             # {"version", "since", "reason", "commits"} while holding, else None
        self.held_back_total = 0     # distinct commits that failed the gate
        self.reference = None        # quality record `served` means: the newest served commit judged
        self._failed = set()         # (seq, checksum) counted in held_back_total

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
        """A commit with record `quality` was published."""
        self.reference = self.gate.reference_after(self.reference, quality)

    def clear(self, serving=None):
        """Nothing is held back (any more); `serving`: the commit now served."""
        if self.held is not None and serving is not None:
            log.info("commit %d passes the quality gate: serving again (held at %s)", serving, self.held["version"])
        self.held = None

    def status(self):
        """The gate's part of the admin status."""
        return {"gate": self.gate.text, "gate_min_examples": self.gate.min_examples, "reference": self.reference,
                "held": self.held is not None,
                "held_version": None if self.held is None else self.held["version"],
                "held_reason": None if self.held is None else self.held["reason"],
                "held_commits": [] if self.held is None else list(self.held["commits"]),
                "held_back_total": self.held_back_total}


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
        info = GaugeMetricFamily("evstore_serving_gate_info", "The gate expression and, while holding, why "
                                 "(value 1)", labels=["gate", "reason"])
        info.add_metric([st["gate"], st["held_reason"] or ""], 1)
        yield info

    def describe(self):
        return []


def register_metrics(registry, model):
    """Adds the quality gate's metrics of `model` (a gated ServingModel) to a prometheus_client registry."""
    registry.register(_Collector(model))
