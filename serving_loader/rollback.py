"""An operator's roll back of a ServingModel to a retained commit, whole or not at all: a walk
(serving_loader/walk.py) to a chosen commit instead of the newest."""
import logging
import time

import numpy as np

from serving_loader.walk import STAGE_ERRORS

__all__ = ["RollbackError", "rollback"]

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


def rollback(walk, seq, then="pin"):
    """Serves the retained commit `seq` through `walk` (a CommitWalk), whole or
    not at all, then pins or (then="resume") catches up. Returns the served
    sequence number. Raises RollbackError (ServingModel.rollback says when)."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 1:
        raise RollbackError(400, f"a rollback names a commit by its sequence number (an integer >= 1), "
                                 f"got {seq!r}")
    if then not in ("pin", "resume"):
        raise RollbackError(400, f'then must be "pin" or "resume", got {then!r}')
    if walk.source is None:
        raise RollbackError(409, "no checkpoint root: this server serves its export as it is")
    seq = int(seq)
    with walk.lock:
        sc = walk.source.scan()
        if seq not in sc.manifests:
            kept = sorted(sc.manifests)
            raise RollbackError(404, f"commit {seq} is not retained in {walk.source.storage.url} (retained: "
                                     f"{_ranges(kept) or 'none'})")
        t0 = time.time()
        before = walk.publisher.served.seq
        try:
            walk.load_chain(walk.source.newest_chain(sc, upto=seq))
        except STAGE_ERRORS as e:
            walk.metrics.rollback_failures += 1
            msg = " ".join(f"rollback to {seq} failed, still serving {before}: {e}".split())
            walk.metrics.fail(msg, before)
            raise RollbackError(409, msg) from None
        walk.metrics.rolled_back(before, seq, then, t0)
        walk.policy.rolled_back(then)
        log.info("rolled back from %s to %s (%s)", before, seq, "pinned" if walk.policy.pinned else "resuming")
    return walk.poll() if then == "resume" else walk.publisher.served.seq
