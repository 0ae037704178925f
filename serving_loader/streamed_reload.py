"""Reloading a chain into evstore serving tables (serving_loader/ev_table.py) in bounded memory.

A stock table's reload stages every checkpoint of the chain in memory, then
publishes (stager.py, publisher.py). A full of a table larger than memory cannot be staged
so; here it is staged on disk and streamed into a second table instead:

  * stage (no lock): the chain's deltas as any delta (in memory, validated);
    the full's whole main bundle in a private local directory, every file
    checked against the manifest (checkpoint.fetch), then streamed into a new
    table per EV (`EvTable.replacement()`, tiered like the served one, in
    chunks: DRAM stays at the cache budget) and the deltas applied to it;
  * publish (write lock): each served table adopts its replacement (one swap
    of tables), the dense weights and the version as for any commit.

A failure anywhere before the publish drops the replacements (and their tier
directories) and leaves the served state as it was. While a reload runs the
process holds two tables per EV: the served one and the replacement, each
its index and per-key metadata; the replacement fills with a cache of an
eighth of the budget (ev_table.loading_dram_bytes: the rows it loads go to
its tier) and gets the whole budget when adopted. So DRAM during a reload
stays within the budget + an eighth of it + both tables' per-key bytes + the
loader's chunk buffers (docs/guides/tiered-storage.md, "Memory during a
reload").
"""
from checkpoint.errors import CheckpointError
from checkpoint.fetch import bundle_files, fetch
from checkpoint.serving_view import VIEW_PREFIX
from checkpoint.shards import logical_entries
from serving_loader.ev_table import FLOAT32
from serving_loader.stager import Staged

__all__ = ["load_streamed", "staged_into_replacements", "full_precision"]


def full_precision(full, use_serving_view):
    """The precision a chain of full `full` is served in: its serving view's
    dtype when it has one and views are used, else float32. The chain's
    deltas are read in it (their view's rows when theirs is the same, else
    their float32 rows, encoded as the view encodes them)."""
    view = (full.serving_view or {}).get("dtype")
    return view if view and use_serving_view else FLOAT32


def staged_into_replacements(tables, staged):
    """{EV: replacement table} of `tables` ({EV: EvTable}) holding the chain
    `staged` ([Staged], full first; each in memory) applied in order; their
    `evs` are emptied (publishing them sets the rest). The replacements are
    closed if this fails. A sharded fleet reloads so (its front and shards
    read only their own rows, which fit in memory)."""
    fresh = {}
    try:
        for name, table in tables.items():
            fresh[name] = table.replacement()
        for s in staged:
            for name, (erase, keys, values, _, freqs) in s.evs.items():
                if erase.size:
                    fresh[name].erase(erase)
                if keys.size:
                    fresh[name].insert(keys, values, freqs)
            s.evs = {}
    except BaseException:
        for t in fresh.values():
            t.close()
        raise
    return fresh


def load_streamed(stager, publisher, chain, before_publish=lambda: None):
    """Stages `chain` (full first) into replacements of `publisher`'s evstore
    tables and publishes it (`before_publish()` runs just before: it may raise
    to stop); returns the published Staged list. Raises (the stager's errors)
    before any change to the served state."""
    full, deltas = chain[0], chain[1:]
    parts = logical_entries(full)
    missing = sorted(set(publisher.tables) - set(parts))
    if missing:
        raise CheckpointError(f"{full.dir} holds no EV {missing} that the export serves")
    precision = full_precision(full, stager.use_serving_view)
    staged = [stager.stage(m, precision) for m in deltas]
    fresh = {}
    view = precision if precision != FLOAT32 else None
    files = bundle_files(full) + (bundle_files(full, VIEW_PREFIX) if view else [])
    try:
        for name, table in publisher.tables.items():
            fresh[name] = table.replacement(precision)
        with fetch(stager.storage, full, files=files) as f:   # the bundle (and view), verified, in a local directory
            for name, table in fresh.items():
                for i, entry in enumerate(parts[name]):   # a sharded EV's parts into its one table
                    table.load_bundle(f.dir, entry, clear=i == 0, view=view)
            dense = {n: f[n] for n in publisher.dense}
            head = Staged(full, {}, dense, view=precision, bytes_read=f.bytes_read)
        stager.check_dense(full, dense)
        for s in staged:   # the deltas go into the replacements; publishing them sets the rest
            for name, (erase, keys, values, _, freqs) in s.evs.items():
                if erase.size:
                    fresh[name].erase(erase)
                if keys.size:
                    fresh[name].insert(keys, values, freqs)
            s.evs = {}
        before_publish()
        publisher.adopt(fresh, [head] + staged)
        return [head] + staged
    finally:
        for table in fresh.values():
            table.close()
