"""The trainer's own guard (`evstore train --guard EXPR`): stop committing when quality collapses.

At every commit the quality record of the examples trained since the last
commit (evstore.quality) is judged by a gate expression (the syntax of
`evstore serve --gate`, evstore/gate.py), where `served` is the record of
the last run of commits that passed. Like the server's gate, the guard
judges runs of at least `min_examples` examples: a smaller commit is written
unjudged and judged with the next ones (merged records, evstore.quality.merge).
When a run fails, that save is refused before anything is sealed or written
(its quality callable raises, so the commit protocol aborts), the trainer
stops after the batch in progress, no final delta is committed, and with
`restore` the trainer's model is restored to the last commit that passed
(`last_good`). A later `evstore train` on the same root resumes from the
newest commit's input position; `evstore train --from-seq LAST_GOOD` from
the last good one (needed when unjudged commits followed it).
"""
from evstore.gate import Gate
from evstore.quality import merge

__all__ = ["Guard", "GuardTripped"]


class GuardTripped(Exception):
    """A commit refused by the trainer's guard (its message says why)."""


class Guard:
    """Wraps `trainer.quality` as the manager's quality callable; trips once.
    `min_examples`: None for evstore.gate.DEFAULT_MIN_EXAMPLES."""

    def __init__(self, expression, trainer, min_examples=None):
        self.gate = Gate.parse(expression, min_examples=min_examples)
        self.trainer = trainer
        self.tripped = None     # {"reason", "position", "examples", "last_good", "quality"} once tripped
        self.reference = None   # `served`: the record of the newest run of commits the guard passed
        self.last_good = None   # seq of the newest commit that ends a run that passed (or a resumed chain's end)
        self._unjudged = []     # records of the commits written since then, too small to judge
        self._seen = None       # the last commit folded in

    def _fold(self, m):
        """Commit `m` (its record judged already, or from a resumed chain) is in the chain."""
        if m.quality is None:
            return
        self._unjudged.append(m.quality)
        run = merge(self._unjudged) or m.quality
        if self.gate.judged(run):
            self.reference, self.last_good, self._unjudged = run, m.seq, []

    def quality(self):
        q = self.trainer.quality()
        last = self.trainer.manager.last_committed
        if self._seen is None and last is not None:   # a resumed run: the chain's records
            for m in self.trainer.manager.chain(last.seq):
                self._fold(m)
            self.last_good = last.seq   # the chain the operator resumed is taken as good
        elif last is not None and last is not self._seen:
            self._fold(last)
        self._seen = last
        run = merge(self._unjudged + [q]) or q
        why = self.gate.decide(run, self.reference)
        if why is None and self.tripped is None:
            return q
        if self.tripped is None:
            self.tripped = {"reason": why, "position": self.trainer.position, "examples": self.trainer.examples,
                            "last_good": self.last_good if self.last_good is not None else
                            (None if last is None else last.seq),
                            "newest": None if last is None else last.seq, "quality": q}
            self.trainer.stop_event.set()
        raise GuardTripped(f"the trainer's guard {self.gate.text!r} refused this commit: {self.tripped['reason']}")

    def message(self, restored):
        t = self.tripped
        last, newest = t["last_good"], t["newest"]
        if newest == last:
            return (f"evstore train: guard tripped at row {t['position']:,} ({t['reason']}); stopped committing: "
                    f"the newest commit is {last}" + (", restored into the trainer" if restored else "") +
                    f". Fix the data, then run again to resume from commit {last}")
        return (f"evstore train: guard tripped at row {t['position']:,} ({t['reason']}); stopped committing: "
                f"the last good commit is {last}" + (", restored into the trainer" if restored else "") +
                f" (commits after it up to {newest} were too small to judge alone). Fix the data, then run "
                f"again with --from-seq {last} to resume from it")
