"""The quality gate's language and its judgement (docs/guides/quality-gate.md): the one definition,
used by `evstore serve --gate` (serving_loader/gate.py) and the trainer's `--guard`.

A gate is a list of clauses, all of which a commit must pass to be served:

    auc >= reference - 0.01, reference.auc >= 0.5 + (served - 0.5) / 2

Each clause is `<metric> <op> <expression>`: the metric is a field of the
quality record (evstore.quality: auc, logloss, examples, label_rate), or
`reference.<metric>` (the reference model's, below), the op one of >=, <=,
>, <, and the expression arithmetic (+ - * /, parentheses, numbers) over

  served               the served commits' value of the same metric (their
                       record, measured on the examples they trained on)
  served.<metric>      any metric of it
  reference            the same metric of the commit's own examples scored
                       by the reference model, the model the commit replaces
                       (the record's `reference`, evstore.quality): like with
                       like, whatever the window's difficulty
  reference.<metric>   any metric of that

`served` and `reference` answer different questions and a gate wants both
(docs/guides/quality-gate.md): `auc >= reference - 0.01` holds a model that
is worse than the one it replaces on the same examples, but passes a model
that learned poisoned labels (on poisoned examples the reference scores
worse still); `reference.auc >= 0.5 + (served - 0.5) / 2` holds a window on
which the trusted model lost more than half its lift over chance (poisoned
labels), and not a window that is merely harder. DEFAULT_GATE is measured
to do both; its last clause judges records without a reference.

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
    judged, nor one that refers to a value that is missing (no served
    commit yet, a record without `reference`); every clause judged must hold.
"""
import ast
import operator
import typing

from evstore.quality import FIELDS, merge

__all__ = ["Gate", "GateError", "Admission", "DEFAULT_GATE", "DEFAULT_MIN_EXAMPLES"]

# Not worse than the model it replaces on the same examples, on a window where that model keeps at least half
# its lift over chance; records without a reference: the model itself keeps half the served lift. Measured
# to hold poisoned stretches and to serve good models on windows of different difficulty
# (docs/guides/quality-gate.md, "Choosing a gate"). `evstore serve --gate` without EXPR.
DEFAULT_GATE = ("auc >= reference - 0.01, reference.auc >= 0.5 + (served - 0.5) / 2, "
                "auc >= 0.5 + (served - 0.5) / 2")
_REFS = ("served", "reference")
DEFAULT_MIN_EXAMPLES = 1000   # the examples a record needs to be judged (serve --gate and train --guard)

_OPS = {ast.GtE: (">=", operator.ge), ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt),
        ast.Lt: ("<", operator.lt)}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class GateError(ValueError):
    """A malformed gate expression; the message is one line naming the clause."""


class _Missing(Exception):
    """A value the clause needs is not recorded: the clause is not judged."""


class _Clause:
    def __init__(self, text, metric, op, expr, of_reference=False):
        self.text, self.metric, self.op, self.expr = text, metric, op, expr
        self.of_reference = of_reference   # the left side is reference.<metric>

    def _eval(self, node, records):
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, records)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = self._eval(node.left, records), self._eval(node.right, records)
            if isinstance(node.op, ast.Div) and b == 0:
                raise _Missing()
            return _ARITH[type(node.op)](a, b)
        if isinstance(node, ast.Name):   # `served` / `reference`: the same metric
            name, field = node.id, self.metric
        else:                            # `served.<metric>` / `reference.<metric>`
            name, field = node.value.id, node.attr
        v = (records[name] or {}).get(field)
        if v is None:
            raise _Missing()
        return float(v)

    def check(self, quality, served):
        """None when the clause holds or is not judged, else why it fails."""
        value = ((quality.get("reference") or {}) if self.of_reference else quality).get(self.metric)
        if value is None:
            return None
        try:
            bound = self._eval(self.expr, {"served": served, "reference": quality.get("reference")})
        except _Missing:
            return None
        sym, fn = _OPS[type(self.op)]
        if fn(float(value), bound):
            return None
        name = f"reference.{self.metric}" if self.of_reference else self.metric
        return f"{name} {value:.4g} is not {sym} {bound:.4g} ({self.text})"


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
    of_reference = (isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name) and
                    left.value.id == "reference" and left.attr in FIELDS)
    if not of_reference and (not isinstance(left, ast.Name) or left.id not in FIELDS):
        raise GateError(f"{where}: the left side must be one of the metrics {', '.join(FIELDS)} or "
                        "reference.<metric>")
    _check_expr(right, where)
    return _Clause(part, left.attr if of_reference else left.id, tree.ops[0], right, of_reference)


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
        if node.id not in _REFS:
            raise GateError(f"{where}: unknown name {node.id!r} (the right side may use numbers, served, "
                            f"reference, served.<metric> and reference.<metric>: {', '.join(FIELDS)})")
    elif isinstance(node, ast.Attribute):
        if not (isinstance(node.value, ast.Name) and node.value.id in _REFS and node.attr in FIELDS):
            raise GateError(f"{where}: {ast.unparse(node)!r} is not served.<metric> or reference.<metric> "
                            f"({', '.join(FIELDS)})")
    else:
        raise GateError(f"{where}: {ast.unparse(node)!r} is not allowed (numbers, + - * /, parentheses, served, "
                        "reference, served.<metric>, reference.<metric>)")
