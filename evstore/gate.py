"""The quality gate's language and its judgement (docs/guides/quality-gate.md): the one definition,
used by `evstore serve --gate` (serving_loader/gate.py) and the trainer's `--guard`.

A gate is a list of clauses, all of which a commit must pass to be served:

    auc >= served - 0.01, logloss <= served * 1.05

Each clause is `<metric> <op> <expression>`: the metric is a field of the
quality record (evstore.quality: auc, logloss, examples, label_rate), the
op one of >=, <=, >, <, and the expression arithmetic (+ - * /,
parentheses, numbers) over `served` (the reference's value of the same
metric) and `served.<metric>` (any metric of the reference).

Rules (what `Gate.decide` and `Gate.admit` do):
  * a record covering fewer than `min_examples` examples
    (DEFAULT_MIN_EXAMPLES: figures of fewer are noise) is not judged alone:
    `admit` merges the records of the commits since the served one (or since
    the last that failed) until they cover `min_examples`, and judges that;
    the commits wait meanwhile. The reference, `served`, is the merged record
    of the run that passed last;
  * a commit without a quality record (written before quality existed, or by
    a trainer that gives none) is not judged: it passes when nothing waits or
    failed before it, else it waits with them;
  * a clause whose metric the record lacks (None: an AUC of one class) is not
    judged, nor one that refers to a served value that is missing (no
    reference); every clause judged must hold.
"""
import ast
import operator
import typing

from evstore.quality import FIELDS, merge

__all__ = ["Gate", "GateError", "Admission", "DEFAULT_GATE", "DEFAULT_MIN_EXAMPLES"]

DEFAULT_GATE = "auc >= served - 0.01, logloss <= served * 1.05"
DEFAULT_MIN_EXAMPLES = 1000   # the examples a record needs to be judged (serve --gate and train --guard)

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
    def parse(cls, text=DEFAULT_GATE, min_examples=None):
        """The Gate of `text` ("default": DEFAULT_GATE); records of fewer than
        `min_examples` examples (an integer >= 0; None: DEFAULT_MIN_EXAMPLES)
        are not judged alone."""
        if min_examples is None:
            min_examples = DEFAULT_MIN_EXAMPLES
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

    def decide(self, quality, served):
        """None if a commit with quality record `quality` may be served after
        one with `served` (either may be None: not recorded), else the reason
        it may not (one line)."""
        if not self.judged(quality):
            return None
        fails = [r for r in (c.check(quality, served) for c in self.clauses) if r is not None]
        return "; ".join(fails) if fails else None

    def admit(self, pending, served, holding=False):
        """Which of `pending` to serve. `pending`: the commits after the served
        one, in chain order (objects with .seq and .quality); `served`: the
        reference record; `holding`: commits before them are held already.

        The commits are judged on the examples accumulated since the served
        commit (`merge` of their records), or since the last commit that failed:
        a run is judged once it covers `min_examples` examples, and until then
        its commits wait (a small commit is never served unjudged). Returns an
        Admission: `run`, the commits to apply now (up to and including the
        commit that ends a run that passes; [] to hold); `failed`, [(seq,
        reason)] of the commits held back before it; `waiting`, the commits
        after the last judged one (too few examples so far); `judged`, the
        merged record of the run that passed (None: nothing passed)."""
        failed, stretch, waiting = [], [], []
        for i, m in enumerate(pending):
            if m.quality is None:
                if not (failed or holding or waiting):
                    return Admission(list(pending[:i + 1]), failed, [], None)   # legacy: not judged, passes
                waiting.append(m)   # no evidence that the damage is over, nor that this stretch is sound
                continue
            stretch.append(m.quality)
            waiting.append(m)
            q = merge(stretch) or m.quality   # records without `hist` (a caller's, older) are judged alone
            if not self.judged(q):
                continue
            why = self.decide(q, served)
            if why is None:
                return Admission(list(pending[:i + 1]), failed, [], q)
            failed.extend((w.seq, why if w is m else f"judged with commit {m.seq}: {why}") for w in waiting)
            stretch, waiting = [], []
        return Admission([], failed, [m.seq for m in waiting], None)


class Admission(typing.NamedTuple):
    """What `Gate.admit` decided (its docstring)."""
    run: list
    failed: list
    waiting: list
    judged: dict | None


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
