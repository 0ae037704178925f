"""The serving policy (TF Serving's AspiredVersionPolicy): which commits to serve.

Three rules, each with its state here:
  * the operator's pin: while pinned, no new commit is applied;
  * the quality gate (serving_loader/gate.py; None: every commit passes): of
    the commits after the served one, apply up to the first that passes, or
    hold the served version;
  * refusals: a commit (or chain) that could not be served is not tried again
    (unless the cause may pass: an I/O error) until a newer full replaces it;
    each is counted as a failure once.
"""

__all__ = ["ServingPolicy"]


def _judged_alone(gate, quality):
    return quality if quality is not None and gate.judged(quality) else None


class ServingPolicy:
    """`gate`: a GateState or None."""

    def __init__(self, gate=None):
        self.gate = gate
        self.pinned = False
        self.refused = {}        # (seq, checksum) or another key -> why, of what is not retried
        self._counted = set()    # keys whose failure was counted

    # ---- refusals
    def refuse(self, key, retry=False):
        """A commit (or chain) `key` could not be served. Returns None when it
        was refused already (nothing to report), False when its failure was
        counted already (report it, do not count it), True for a new failure."""
        if key in self.refused:
            return None
        if not retry:
            self.refused[key] = True
        if key in self._counted:
            return False
        self._counted.add(key)
        return True

    def is_refused(self, m):
        return (m.seq, m.checksum) in self.refused

    # ---- the gate
    def stretch_limit(self):
        """How many commits after the served one to consider at once: one
        without a gate; with one, all (up to the first that passes)."""
        return None if self.gate else 1

    def admit(self, version, pending):
        """Of the commits `pending` after the served `version`: (those to apply
        now, the quality record that passed or None). All of them without a
        gate; [] holds the served version (or waits: the gate's status says why)."""
        if self.gate is None:
            return pending, None
        return self.gate.select(version, pending)   # held until the run that passed is published

    def caught_up(self):
        """Nothing newer in the served chain: nothing is held back."""
        if self.gate is not None:
            self.gate.clear()

    def serving(self, seq, judged):
        """Commit `seq` was published after a stretch the gate admitted with
        record `judged` (the reference from now on, when not None)."""
        if self.gate is not None:
            self.gate.passed(judged, serving=seq)

    def reloaded(self, seq, judged):
        """A reload up to commit `seq` was published (`judged`: reload_end's record)."""
        if self.gate is not None:
            self.gate.passed(judged, serving=seq, clear=False)

    def published(self, quality):
        """A commit with quality record `quality` became the served one."""
        if self.gate is not None:
            self.gate.served(quality)

    def reload_end(self, version, chain, intact):
        """How much of the newest `chain` a reload serves, and the record that
        passed last: up to the last commit the gate admits (all of it, None,
        without a gate). The full always loads when the served chain cannot go
        on (nothing served yet, or `intact()` False: the served commit
        withdrawn, a commit after it refused or missing): a full is never held
        back from repairing a broken chain. 0: hold the served version."""
        if self.gate is None:
            return len(chain), None
        start, ref, holding = 0, self.gate.reference, self.gate.held is not None
        if version is None or not intact():
            start, ref, holding = 1, _judged_alone(self.gate.gate, chain[0].quality), False
        end, judged = start, None
        while end < len(chain):
            run, passed = self.gate.select(chain[end - 1].seq if end else version, chain[end:], reference=ref,
                                           holding=holding and end == 0, extend=holding and end == 0)
            if not run:
                break
            self.gate.clear(serving=run[-1].seq)   # what holds after `end` is the next select's
            end += len(run)
            judged = passed
            ref = passed or ref
        return end, judged

    # ---- the operator
    def rolled_back(self, then):
        """The operator served a chosen commit: the gate judges the commits after
        it; pinned unless `then` is "resume"."""
        if self.gate is not None:
            self.gate.clear()
        self.pinned = then == "pin"
