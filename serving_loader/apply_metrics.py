"""A ServingModel's counters of applied checkpoints (freshness, apply latency,
bytes fetched) and their snapshot for monitoring."""
import time

__all__ = ["ApplyMetrics"]


class ApplyMetrics:
    """ServingModel's apply counters and metrics snapshot (a mixin: the state it
    reads and writes is ServingModel's, set up by its __init__)."""

    def _record(self, m, t0):
        now = time.time()
        self.applied += 1
        self.applied_seqs = (self.applied_seqs + [m.seq])[-10000:]
        self.apply_latency_s = (self.apply_latency_s + [now - t0])[-1000:]
        self.freshness_s = (self.freshness_s + [max(0.0, now - m.wall_time)])[-1000:]
        self.last_lag_s, self.last_apply_s = self.freshness_s[-1], self.apply_latency_s[-1]
        self.last_applied_wall = now

    def apply_samples(self, wait=True):
        """(applied, freshness samples, apply-latency samples) as of one moment
        (taken under the poll lock). With wait=False returns None instead of
        waiting while a checkpoint is being applied."""
        if not self._poll_lock.acquire(blocking=wait):
            return None
        try:
            return self.applied, list(self.freshness_s), list(self.apply_latency_s)
        finally:
            self._poll_lock.release()

    def metrics(self):
        """A snapshot for monitoring: version, applied, failures, rows per table,
        freshness and apply latency samples (seconds)."""
        return {"version": self.version, "base": self.base, "applied": self.applied,
                "applied_seqs": list(self.applied_seqs), "failures": self.failures,
                "last_error": self.last_error, "rows": self.rows(), "freshness_s": list(self.freshness_s),
                "apply_latency_s": list(self.apply_latency_s), "pinned": self.pinned,
                "newest_committed": self.newest_committed, "rollbacks": self.rollbacks,
                "rollback_failures": self.rollback_failures, "last_rollback": self.last_rollback,
                "serving_view": self.serving_view, "fetched_bytes_total": self.fetched_bytes_total,
                "last_fetched_bytes": self.last_fetched_bytes, "last_lag_s": self.last_lag_s,
                "last_apply_s": self.last_apply_s}
