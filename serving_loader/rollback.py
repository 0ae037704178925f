"""An operator's hold and roll back of a ServingModel: pin, resume, rollback to a retained commit
(whole or not at all), and the admin status."""
import logging
import time

import numpy as np
import tensorflow as tf

from checkpoint.chain import resolve_chain, scan
from checkpoint.errors import CheckpointError

__all__ = ["RollbackError", "Rollback"]

log = logging.getLogger("evstore.serving")


class RollbackError(Exception):
    """A rollback that was refused or failed; the served state is unchanged.
    `status`: the HTTP status an admin endpoint answers with (400 bad request,
    404 commit not retained, 409 no checkpoint root or the commit cannot be
    served)."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def _ranges(seqs):
    """"1-3, 7, 9-12" for [1, 2, 3, 7, 9, 10, 11, 12]."""
    out, start = [], None
    for i, q in enumerate(seqs):
        if start is None:
            start = q
        if i + 1 == len(seqs) or seqs[i + 1] != q + 1:
            out.append(str(start) if start == q else f"{start}-{q}")
            start = None
    return ", ".join(out)


class Rollback:
    """ServingModel's pin, resume, rollback and admin status (a mixin: the state it
    reads and writes is ServingModel's, set up by its __init__)."""

    def pin(self):
        """Stops applying new commits (waits for an apply in progress); returns `version`."""
        with self._poll_lock:
            self.pinned = True
            return self.version

    def resume(self):
        """Applies new commits again, starting now (catches up before
        returning; a failure is reported as by any poll). Returns `version`."""
        with self._poll_lock:
            self.pinned = False
        return self.poll()

    def retained(self):
        """Sequence numbers of the root's committed checkpoints, ascending (the
        commits `rollback` can serve, if their chain is intact)."""
        if self.storage is None:
            return []
        return sorted(scan(self.storage).manifests)

    def rollback(self, seq, then="pin"):
        """Serves the retained commit `seq`, whole or not at all, then stays
        pinned (then="pin", the default) or resumes applying new commits
        (then="resume": catches up before returning). Returns `version`.

        Raises:
          RollbackError: a bad argument (status 400), `seq` not a retained
            commit (404), no checkpoint root or the commit's chain cannot be
            staged (409; counted in `rollback_failures`, `last_error` says
            why). The served state and the pin are then unchanged.
        """
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 1:
            raise RollbackError(400, f"a rollback names a commit by its sequence number (an integer >= 1), "
                                     f"got {seq!r}")
        if then not in ("pin", "resume"):
            raise RollbackError(400, f'then must be "pin" or "resume", got {then!r}')
        if self.storage is None:
            raise RollbackError(409, "no checkpoint root: this server serves its export as it is")
        seq = int(seq)
        with self._poll_lock:
            sc = scan(self.storage)
            if seq not in sc.manifests:
                kept = sorted(sc.manifests)
                raise RollbackError(404, f"commit {seq} is not retained in {self.storage.url} (retained: "
                                         f"{_ranges(kept) or 'none'})")
            t0 = time.time()
            before = self.version
            try:
                self._load_chain(resolve_chain(sc, upto=seq, where=self.storage.url))
            except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
                self.rollback_failures += 1
                msg = " ".join(f"rollback to {seq} failed, still serving {before}: {e}".split())
                self._fail(msg)
                raise RollbackError(409, msg) from None
            self.rollbacks += 1
            if self.gate is not None:
                self.gate.clear()   # the operator's choice; the gate judges the commits after it
            self.last_rollback = {"from": before, "to": seq, "then": then, "seconds": round(time.time() - t0, 6),
                                  "wall_time": time.time()}
            self.pinned = then == "pin"
            log.info("rolled back from %s to %s (%s)", before, seq, "pinned" if self.pinned else "resuming")
        return self.poll() if then == "resume" else self.version

    def admin_status(self):
        """The operator's view: served version and base, pin, newest commit
        seen, rollbacks and their failures, the last rollback, the last error."""
        return {"version": self.version, "base": self.base, "pinned": self.pinned,
                "newest_committed": self.newest_committed, "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "failures": self.failures, "last_error": self.last_error, "serving_view": self.serving_view,
                **(self.gate.status() if self.gate is not None else {})}
