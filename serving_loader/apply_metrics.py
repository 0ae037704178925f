"""A ServingModel's counters of applied checkpoints (freshness, apply latency,
bytes fetched, failures, rollbacks) and their snapshot for monitoring."""
import logging
import time

__all__ = ["ApplyMetrics"]

log = logging.getLogger("evstore.serving")


class ApplyMetrics:
    """Counters only: every part of a ServingModel reports here, none reads it back."""

    def __init__(self):
        self.applied = 0
        self.applied_seqs = []       # sequence numbers published, in order (a reload publishes its last)
        self.failures = 0
        self.last_error = None
        self.freshness_s = []        # commit -> served, per applied checkpoint (bounded)
        self.apply_latency_s = []    # stage + publish, per applied checkpoint (bounded)
        self.fetched_bytes_total = 0   # bytes read from the root for published checkpoints
        self.last_fetched_bytes = None # ... for the last one
        self.last_lag_s = None         # commit (its manifest's wall time) -> served, last checkpoint
        self.last_apply_s = None       # stage + publish, last checkpoint
        self.last_applied_wall = None
        self.rollbacks = 0
        self.rollback_failures = 0
        self.last_rollback = None      # {"from", "to", "then", "seconds", "wall_time"} of the last one done

    def record(self, m, t0):
        """Commit `m`, whose apply started at `t0` (wall time), is served."""
        now = time.time()
        self.applied += 1
        self.applied_seqs = (self.applied_seqs + [m.seq])[-10000:]
        self.apply_latency_s = (self.apply_latency_s + [now - t0])[-1000:]
        self.freshness_s = (self.freshness_s + [max(0.0, now - m.wall_time)])[-1000:]
        self.last_lag_s, self.last_apply_s = self.freshness_s[-1], self.apply_latency_s[-1]
        self.last_applied_wall = now

    def fetched(self, nbytes):
        """A published commit read `nbytes` from the root."""
        self.fetched_bytes_total += nbytes
        self.last_fetched_bytes = nbytes

    def fail(self, msg, version):
        """A failure (counted), while `version` stays served."""
        self.failures += 1
        self.last_error = msg
        log.warning("%s (still serving %s)", msg, version)

    def rolled_back(self, before, seq, then, t0):
        self.rollbacks += 1
        self.last_rollback = {"from": before, "to": seq, "then": then, "seconds": round(time.time() - t0, 6),
                              "wall_time": time.time()}

    def samples(self):
        """(applied, freshness samples, apply-latency samples)."""
        return self.applied, list(self.freshness_s), list(self.apply_latency_s)

    def snapshot(self):
        """The counters for monitoring."""
        return {"applied": self.applied, "applied_seqs": list(self.applied_seqs), "failures": self.failures,
                "last_error": self.last_error, "freshness_s": list(self.freshness_s),
                "apply_latency_s": list(self.apply_latency_s), "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "fetched_bytes_total": self.fetched_bytes_total, "last_fetched_bytes": self.last_fetched_bytes,
                "last_lag_s": self.last_lag_s, "last_apply_s": self.last_apply_s}
