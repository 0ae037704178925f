"""A serving shard's disk budget: the row bytes its tiered tables may hold at once.

A shard's tables (tiered: rows in a DRAM cache over a file on local disk,
evstore.TieredStorage) hold its partition's rows; a row is `dim` float32
values (one tier record: evstore.storage.record_bytes(dim); serving tables
hold no optimizer slots). The budget
counts every row the shard holds at once: the served version's, plus, while
a new chain (a full, a rollback) is streamed into replacement tables, the
new version's, which exist together until the swap. A commit that would
take the shard past it is refused before any row of it is read (a
CheckpointError naming the shard, the commit, the bytes and the budget), so
the fleet holds its version (docs/guides/sharded-serving.md, "Budgets").

What the file takes on disk is at most these row bytes (rows in the DRAM
cache are not written; `stats()["disk_bytes"]` is the exact figure), plus,
between compactions, dead records of rows rewritten by deltas (at most about
as many again, native/core/log_space.h).
"""
from checkpoint.errors import CheckpointError
from evstore.storage import record_bytes

__all__ = ["DiskBudget"]


class DiskBudget:
    """At most `disk_bytes` (a positive int, or None: no bound) of rows for
    tables of dims `dims` ({EV: dim}); `who` names the process in errors."""

    def __init__(self, disk_bytes, dims, who):
        if disk_bytes is not None and (isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int)
                                       or disk_bytes <= 0):
            raise ValueError(f"a disk budget is a positive number of bytes, got {disk_bytes!r}")
        self.disk_bytes = disk_bytes
        self.dims = dict(dims)
        self.who = who
        self._record = {name: record_bytes(dim) for name, dim in self.dims.items()}

    def row_bytes(self, rows):
        """Bytes of `rows` ({EV: row count})."""
        return sum(int(n) * self._record[name] for name, n in rows.items())

    def check(self, m, held, incoming, what):
        """Raises CheckpointError when `held` ({EV: rows kept}) and `incoming`
        ({EV: rows commit `m` brings}) exceed the budget; `what` says why
        both are held."""
        if self.disk_bytes is None:
            return
        need = self.row_bytes(held) + self.row_bytes(incoming)
        if need > self.disk_bytes:
            raise CheckpointError(
                f"{self.who}: commit {m.seq} needs {need:,} bytes of rows on disk ({what}: "
                f"{sum(held.values()) + sum(incoming.values()):,} rows), above this shard's disk budget of "
                f"{self.disk_bytes:,} bytes (--tier-disk-bytes): raise it or serve the model on more shards")
