"""The trainer's own guard (`evstore train --guard EXPR`): stop committing when quality collapses.

At every commit the quality record of the examples trained since the last
commit (evstore.quality) is judged by a gate expression (the syntax of
`evstore serve --gate`, serving_loader/gate.py), where `served` is the last
commit's record. When it fails, that save is refused before anything is
sealed or written (its quality callable raises, so the commit protocol
aborts: the chain ends at the last good commit), the trainer stops after the
batch in progress, no final delta is committed, and with `restore` the
trainer's model is restored to the last good commit. A later `evstore
train` on the same root resumes exactly from that commit's input position.
"""
from serving_loader.gate import Gate

__all__ = ["Guard", "GuardTripped"]


class GuardTripped(Exception):
    """A commit refused by the trainer's guard (its message says why)."""


class Guard:
    """Wraps `trainer.quality` as the manager's quality callable; trips once."""

    def __init__(self, expression, trainer, min_examples=1000):
        self.gate = Gate.parse(expression, min_examples=min_examples)
        self.trainer = trainer
        self.tripped = None     # {"reason", "position", "examples", "last_good"} once tripped
        self.reference = None   # `served`: the newest committed record the gate judges (enough examples)
        self._seen = None       # the last commit folded into the reference

    def quality(self):
        q = self.trainer.quality()
        last = self.trainer.manager.last_committed
        if self._seen is None and last is not None:   # the newest judged record of the chain (a resumed run)
            for m in self.trainer.manager.chain(last.seq):
                self.reference = self.gate.reference_after(self.reference, m.quality)
        elif last is not None and last is not self._seen:
            self.reference = self.gate.reference_after(self.reference, last.quality)
        self._seen = last
        why = self.gate.decide(q, self.reference)
        if why is None and self.tripped is None:
            return q
        if self.tripped is None:
            self.tripped = {"reason": why, "position": self.trainer.position, "examples": self.trainer.examples,
                            "last_good": None if last is None else last.seq, "quality": q}
            self.trainer.stop_event.set()
        raise GuardTripped(f"the trainer's guard {self.gate.text!r} refused this commit: {self.tripped['reason']}")

    def message(self, restored):
        t = self.tripped
        last = t["last_good"]
        return (f"evstore train: guard tripped at row {t['position']:,} ({t['reason']}); stopped committing: the "
                f"newest commit is {last}" + (", restored into the trainer" if restored else "") +
                f". Fix the data, then run again to resume from commit {last}")
