"""The interface of a served table: what a ServingModel's publisher and stager
ask of each EV's serving table, whichever kind the export holds.

Two kinds implement it: serving_loader/table.py's `Table` (a stock
DenseHashTable of the SavedModel, driven through TensorFlow's table ops) and
serving_loader/ev_table.py's `EvTable` (an evstore table, its rows in DRAM or
tiered). A reload replaces a stock table's rows in place (export, erase,
insert); an evstore table is replaced whole (`ReplaceableTable`).
"""
from typing import Protocol, runtime_checkable

__all__ = ["ServedTable", "ReplaceableTable"]


@runtime_checkable
class ServedTable(Protocol):
    """One EV's serving table. Every method runs under the publisher's write lock
    except `warm` (read lock) and `size` (read lock)."""

    #: True when the table cannot hold the key dtype's empty and deleted keys:
    #: their rows live beside it in the export (serving_loader/export.py).
    reserves_sentinels: bool
    #: True when `insert` uses the keys' training frequencies (a tier's cache policy).
    weighs_freqs: bool

    def size(self):
        """Rows served (an int or a scalar tensor)."""

    def insert(self, keys, values, freqs=None):
        """Upserts rows: `keys` [n], `values` float32 [n, dim], `freqs` [n] or None."""

    def erase(self, keys):
        """Removes `keys` (absent keys are ignored)."""

    def warm(self, keys):
        """Before the write lock: brings the rows of `keys` where an upsert finds
        them without I/O. Never raises."""

    def close(self):
        """Drops the rows the table owns; it serves no more."""


@runtime_checkable
class ReplaceableTable(ServedTable, Protocol):
    """A served table a reload replaces whole: a `replacement()` is filled
    outside the lock (streamed from the full), then adopted under it."""

    def replacement(self):
        """A new empty table like this one, with `load_bundle(dir, entry, clear)`,
        `insert`, `erase` and `close`."""

    def adopt(self, replacement):
        """Makes `replacement`'s rows this table's in one swap and drops the previous ones."""

    def stats(self):
        """{stats field: int} of the table (evstore.schema.STATS_FIELDS)."""
