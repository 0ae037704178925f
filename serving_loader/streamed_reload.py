"""Reloading a chain into evstore serving tables (serving_loader/ev_table.py) in bounded memory.

A stock table's reload stages every checkpoint of the chain in memory, then
publishes (stager.py, publisher.py). A full of a table larger than memory cannot be staged
so; here it is streamed into a second table instead:

  * stage (no lock): the chain's deltas as any delta (in memory, validated);
    the data files of the full's EV entries this process reads (every part,
    or a serving shard's own part: the stager's partition, partition.py) and
    the served dense weights, streamed into a new table per EV
    (`EvTable.replacement()`, tiered like the served one, in chunks, a
    shard's keeping only keys routed to it when it reads other parts: DRAM
    stays at the cache budget) and the deltas applied to it. The files
    (checkpoint.fetch, verify="index"): a local root's hard-linked privately,
    an object store's read straight from it by the native loader
    (checkpoint/object_source.py, nothing written locally); either way the
    index checked against the manifest and every file's size first, each
    tensor's crc32c as it loads (a failure drops the replacements): each
    byte read once;
  * publish (write lock): each served table adopts its replacement (one swap
    of tables), the dense weights and the version as for any commit.

A failure anywhere before the publish drops the replacements (and their tier
directories) and leaves the served state as it was. While a reload runs the
process holds two tables per EV: the served one and the replacement, each
its index and per-key metadata; the replacement fills with a cache of an
eighth of the budget, at least 64 MiB (ev_table.loading_dram_bytes: the rows
it loads go to its tier) and gets the whole budget when adopted. So DRAM
during a reload stays within the budget + that loading cache + both tables'
per-key bytes + the loader's chunk buffers (docs/guides/tiered-storage.md, "Memory during a
reload").

Precision: a chain is served in its full's serving view dtype when it has
one and views are used (full_precision), else float32; the replacements keep
rows in it and the deltas are read in it (stager.py).
"""
from checkpoint.fetch import bundle_files, fetch
from checkpoint.index import parse_index
from checkpoint.remote_parts import bundle_subset
from checkpoint.tensor_read import read_index
from checkpoint.serving_view import VIEW_PREFIX
from evstore import schema
from evstore.storage import check_tier_room
from serving_loader.ev_table import FLOAT32
from serving_loader.stager import Staged

__all__ = ["load_streamed", "stream_chain", "staged_into_replacements", "full_precision"]


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
    closed if this fails. A sharded front reloads its own small EVs so."""
    fresh = {}
    try:
        for name, table in tables.items():
            fresh[name] = table.replacement()
        _apply(fresh, staged)
    except BaseException:
        _close(fresh)
        raise
    return fresh


def _apply(fresh, staged):
    for s in staged:   # publishing them sets the rest
        for name, (erase, keys, values, _, freqs) in s.evs.items():
            if erase.size:
                fresh[name].erase(erase)
            if keys.size:
                fresh[name].insert(keys, values, freqs)
        s.evs = {}


def _close(fresh):
    for t in fresh.values():
        t.close()


def _own_tensors(held, entries):
    """The main bundle's tensors of EV entries `entries` (their keys, rows,
    frequencies, versions, filtered keys; never optimizer slots)."""
    heads = tuple(e + "-" for e in entries)
    return [t for t in held if t.startswith(heads)]


def _rows_of(held, plan):
    """Rows EV entries `plan` ([(entry, shard_index, num_shards)]) bring, by
    the index's shapes: exact for a whole entry, the routed share of a
    filtered one (the route spreads keys evenly)."""
    total = 0
    for entry, _, count in plan:
        e = held.get(schema.tensor(entry, schema.KEYS))
        total += (e.shape[0] if e is not None and e.shape else 0) // count
    return total


def stream_chain(stager, tables, chain, check=lambda rows: None):
    """Stages `chain` (full first) into replacements of `tables` ({EV:
    EvTable}) without publishing: the deltas in memory (validated), the
    full's files of the entries this process reads (the stager's partition:
    a serving shard's own part, or every part with a key filter), checked
    (fetch's verify="index": the module docstring) and
    streamed into the replacements in chunks (DRAM stays at the tables'
    cache budget and a chunk's rows) and the deltas applied. `check({EV:
    rows})`, with the rows the full brings here by its index, runs before
    any row is read (it may raise to stop: a budget), then the tier disk room
    of the tiered replacements (evstore.storage.check_tier_room: TierSpaceError,
    an OSError).
    Returns ({EV: replacement}, [Staged] of the chain); the caller adopts or
    closes the replacements. Raises (the stager's errors, CheckpointError,
    OSError, tf.errors.OpError) with nothing left behind."""
    full, deltas = chain[0], chain[1:]
    plans = stager.plans(full)
    precision = full_precision(full, stager.use_serving_view)
    view = precision if precision != FLOAT32 else None
    staged = [stager.stage(m, precision) for m in deltas]
    entries = sorted({e for p in plans.values() for e, _, _ in p})
    fresh = {}
    try:
        index = read_index(stager.storage, full)
        _, held = parse_index(index, full.dir)
        rows = {n: _rows_of(held, p) for n, p in plans.items()}
        check(rows)
        # Each replacement's tier file beside the served one's: refused here when it cannot fit the disk.
        check_tier_room([need for need in (t.tier_need(n, rows.get(n, 0), precision) for n, t in tables.items())
                         if need is not None], f"the reload of {stager.storage.display(full.dir)}")
        own = _own_tensors(held, entries)
        if view:   # rows from the view's bundle (one data file for every EV, and its index), not `-values`
            own = [t for t in own if not any(t == schema.tensor(e, schema.VALUES) for e in entries)]
        files = bundle_subset(full, index, own + list(stager.dense_names))
        if view:
            files = sorted(set(files) | set(bundle_files(full, VIEW_PREFIX)))
        for name, table in tables.items():
            fresh[name] = table.replacement(precision)
        # These files for the native loader: the replacements are dropped if a tensor fails its check,
        # so a remote root's data files are read once, checked as they load (fetch's verify="index").
        with fetch(stager.storage, full, files=files, verify="index") as f:
            for name, table in fresh.items():
                for i, (entry, shard, count) in enumerate(plans[name]):   # a sharded EV's parts into its one table
                    table.load_bundle(f.dir, entry, clear=i == 0, shard_index=shard, num_shards=count, view=view)
            dense = {n: f[n] for n in stager.dense_names}
            head = Staged(full, {}, dense, view=precision, bytes_read=f.bytes_read + len(index))
        stager.check_dense(full, dense)
        _apply(fresh, staged)
    except BaseException:
        _close(fresh)
        raise
    return fresh, [head] + staged


def load_streamed(stager, publisher, chain, before_publish=lambda: None):
    """Stages `chain` (full first) into replacements of `publisher`'s evstore
    tables (stream_chain) and publishes it (`before_publish()` runs just
    before: it may raise to stop); returns the published Staged list. Raises
    (the stager's errors) before any change to the served state."""
    fresh, staged = stream_chain(stager, publisher.tables, chain)
    try:
        before_publish()
        publisher.adopt(fresh, staged)
        return staged
    finally:
        _close(fresh)
