"""The publisher: a ServingModel's served state and the lock over it.

It owns what predictions read (each EV's served table, the dense weights, the
sentinel keys' rows) and `ServedVersion` (which commit that is), behind one
reader-writer lock: predictions read under `reading()`, a commit becomes the
served state under the write lock, all of a stretch in one step. Publishing
cannot fail on content: the stager (serving_loader/stager.py) validated
everything first. Nothing else writes the served state.
"""
import contextlib
import dataclasses

import tensorflow as tf

from serving_loader.export import sentinels
from serving_loader.rwlock import RWLock

__all__ = ["Publisher", "ServedVersion"]


@dataclasses.dataclass(frozen=True)
class ServedVersion:
    """Which commit is served: its sequence number and full, its manifest
    checksum (its identity: a delta applies only on the parent it names), its
    quality record and the precision its rows were read in. All None before
    the first commit."""
    seq: int = None
    base: int = None
    checksum: str = None
    quality: dict = None
    view: str = None


class Publisher:
    """The served tables (`ServedTable`s by EV name), dense variables (by name)
    and sentinel rows (EV name -> (rows variable, present variable)), and
    the lock over them."""

    def __init__(self, tables, dense, reserved, key_dtypes):
        self.tables = tables
        self.dense = dense
        self.reserved = reserved
        self._key_dtypes = key_dtypes     # EV name -> key dtype name (its sentinel keys)
        self.served = ServedVersion()
        self.after_publish = []   # callables run under the write lock after each published commit
        self._lock = RWLock()

    @contextlib.contextmanager
    def reading(self):
        """The block sees one served commit whole (predictions, stats)."""
        self._lock.acquire_read()
        try:
            yield self.served
        finally:
            self._lock.release_read()

    @contextlib.contextmanager
    def writing(self):
        """The block changes the served state: no prediction runs meanwhile."""
        self._lock.acquire_write()
        try:
            yield
        finally:
            self._lock.release_write()

    def warm(self, staged):
        """Before the write lock: reads the rows `staged` changes in each served
        table, as a prediction does, so a tiered table holds them in DRAM and
        its publish does not read them from disk under the lock (a no-op for
        tables in DRAM). Predictions go on meanwhile."""
        with self.reading():
            for s in staged:
                for name, (_, keys, *_) in s.evs.items():
                    if keys.size:
                        self.tables[name].warm(keys)

    def publish(self, staged):
        """Makes the staged commits (a stretch of the served chain, in order) the
        served state in one step."""
        with self.writing():
            for s in staged:
                self._publish_one(s)

    def replace(self, staged):
        """Replaces the served state by a whole staged chain (full first), in one
        step: every row of the previous chain is dropped first."""
        with self.writing():
            for name, table in self.tables.items():
                keys, _ = table.export()
                empty, deleted = sentinels(self._key_dtypes[name])
                keys = tf.boolean_mask(keys, tf.logical_and(tf.not_equal(keys, empty), tf.not_equal(keys, deleted)))
                if int(tf.size(keys)):
                    table.erase(keys)
            for _, present_var in self.reserved.values():
                present_var.assign(tf.zeros_like(present_var))
            for s in staged:
                self._publish_one(s)

    def adopt(self, fresh, staged):
        """Replaces each served table by its filled replacement (`fresh`, EV name ->
        table; adopted ones are removed from it) and publishes the chain's
        `staged` commits (their rows are in the replacements already), in one step."""
        with self.writing():
            for name, table in self.tables.items():
                table.adopt(fresh.pop(name))
            for s in staged:
                self._publish_one(s)

    def _publish_one(self, s):
        """Under the write lock: staged commit `s` becomes the served state."""
        for name, (erase, keys, values, reserved, freqs) in s.evs.items():
            table = self.tables[name]
            if erase.size:
                table.erase(erase)
            if keys.size:
                table.insert(keys, values, freqs)
            if reserved:
                rows_var, present_var = self.reserved[name]
                rows, present = rows_var.numpy(), present_var.numpy()
                for j, row in reserved.items():
                    present[j] = row is not None
                    if row is not None:
                        rows[j] = row
                rows_var.assign(rows)
                present_var.assign(present)
        for name, value in s.dense.items():
            self.dense[name].assign(value)
        m = s.manifest
        self.served = ServedVersion(m.seq, m.base, m.checksum, m.quality, s.view)
        for fn in self.after_publish:
            fn()

    def rows(self):
        """{EV name: rows in its serving table}."""
        with self.reading():   # a reload swaps evstore tables under the write lock
            return {n: int(t.size()) for n, t in self.tables.items()}

    def table_stats(self, fields):
        """{EV name: {field: int}} of tables with stats (evstore tables)."""
        with self.reading():
            return {n: {k: v for k, v in t.stats().items() if k in fields} for n, t in self.tables.items()}

    def close(self):
        """Drops every served table now; nothing is served any more."""
        with self.writing():
            tables, self.tables = self.tables, {}
            for t in tables.values():
                t.close()
