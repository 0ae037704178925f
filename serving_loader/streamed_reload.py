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
process holds two tables per EV: the served one and the replacement (each
its index and its DRAM cache).
"""
from checkpoint.errors import CheckpointError
from checkpoint.fetch import fetch
from checkpoint.shards import logical_entries
from serving_loader.stager import Staged

__all__ = ["load_streamed", "staged_into_replacements"]


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
    staged = [stager.stage(m) for m in deltas]
    fresh = {}
    try:
        for name, table in publisher.tables.items():
            fresh[name] = table.replacement()
        with fetch(stager.storage, full) as f:   # the whole bundle, verified, in a local directory
            for name, table in fresh.items():
                for i, entry in enumerate(parts[name]):   # a sharded EV's parts into its one table
                    table.load_bundle(f.dir, entry, clear=i == 0)
            dense = {n: f[n] for n in publisher.dense}
            head = Staged(full, {}, dense, bytes_read=f.bytes_read)
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
