"""A serving shard: partition i of N of the large EVs, two versions readable while the fleet switches.

A model larger than one serving host is served by N shards and a front
(serving_loader/front.py, docs/guides/sharded-serving.md). Shard i holds, of
every EV it serves, the keys that `evstore.sharded.shard_index(key, N)` routes
to i (the route of a ShardedEmbeddingVariable, "mix64-v1"), in evstore tables
(tiered with `storage`, as a tiered replica's). It never polls: the front
drives it, in two phases per commit:

  * stage(target, fleet): read, outside any lock, this shard's rows of every
    commit from the served one up to `target` and hold them beside the served
    tables (`_Pending`). The model's Stager reads only this shard's partition
    (serving_loader/partition.py): the part `<ev>/part_i` of a checkpoint
    written with N shards of the same route (its byte ranges only,
    checkpoint/fetch.py); otherwise every part, keeping the keys routed here.
    Deltas become an overlay {key: row, or None for erased}; a new chain (a full, or a commit not after the served one: a
    rollback) is loaded into replacement tables. While staged, both versions
    are readable: `lookup(served)` and `lookup(target)`.
  * publish(target): under the write lock, the pending state becomes the
    served one (replacements adopted, the overlay's deltas applied); the
    previous version is no longer readable.

`fleet` in a stage call is the version the front serves: a pending target at
or below it is published first (its publish call was lost), and a stage of
the fleet's own version is published at once: a restarted shard (serving
nothing) rejoins at the fleet's version.

Invariants: the served tables hold exactly `version`'s partition; the pending
state, when there is one, reads exactly `pending.target`'s; a lookup names the
version it wants and is refused (VersionNotHeld) for any other, so an answer
never mixes versions.
"""
import threading

import numpy as np
import tensorflow as tf

from checkpoint.chain import resolve_chain, scan
from checkpoint.errors import CheckpointError
from evstore import ops
from serving_loader.disk_budget import DiskBudget
from serving_loader.model import ServingModel
from serving_loader.partition import Partition
from serving_loader.source import CommitSource
from serving_loader.streamed_reload import stream_chain

__all__ = ["ShardModel", "VersionNotHeld", "parse_shard"]


class VersionNotHeld(LookupError):
    """A lookup named a version this shard does not hold readable."""


def parse_shard(text):
    """"i/N" -> (i, N) with 0 <= i < N. ValueError otherwise."""
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"a shard is named i/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"shard {text!r}: i must be in [0, N), N >= 1")
    return i, n


def _key_list(keys):
    return keys.tolist()


class _Pending:
    """What one stage call read: `target`'s partition, readable before it is published."""

    def __init__(self, target, staged, fresh=None):
        self.target = target
        self.staged = staged   # [_Staged] in chain order (their evs emptied when `fresh` holds them)
        self.fresh = fresh     # {EV: replacement table} of a new chain, or None (deltas over the served tables)
        self.overlay = {}      # {EV: {key: row or None (erased)}}: the staged deltas over the served tables
        if fresh is None:
            for s in staged:
                for name, (erase, keys, values, _, _) in s.evs.items():
                    o = self.overlay.setdefault(name, {})
                    for k in _key_list(erase):
                        o[k] = None
                    for k, row in zip(_key_list(keys), values):
                        o[k] = row

    def close(self):
        for t in (self.fresh or {}).values():
            t.close()
        self.fresh = None


class ShardModel(ServingModel):
    """Shard `index` of `count` of a serving export of evstore tables.

    Args:
      export_dir: the export (written with `tables="evstore"`).
      checkpoint_root, storage_options: the trainer's root (as ServingModel's).
      index, count: this shard's partition (0 <= index < count).
      evs: names of the EVs sharded (None: every EV of the export); the
        front serves the others.
      storage: an evstore.TieredStorage (rows in a DRAM cache over disk) or
        None (all rows in DRAM).
      disk_bytes: the shard's disk budget (disk_budget.py): a commit whose
        rows would take the shard past it is refused (CheckpointError) and the
        fleet holds its version. None: no bound.
    Attributes: `version` (published), `pending_target` (staged, or None),
      `bytes_read_last` (bytes of the root read by the last stage call).
    Raises ValueError for an export of stock tables or an unknown EV.
    """

    def __init__(self, export_dir, checkpoint_root, index, count, evs=None, storage_options=None, storage=None,
                 disk_bytes=None):
        super().__init__(export_dir, None, storage=storage)
        if self.table_kind != "evstore":
            raise ValueError(f"{export_dir} serves its EVs from stock tables; a serving shard needs an export "
                             "written with export_serving_model(..., tables=\"evstore\")")
        self._tables = self.publisher.tables   # this shard's served tables (the publisher's; it never polls)
        evs = sorted(self._tables) if evs is None else sorted(evs)
        unknown = sorted(set(evs) - set(self._tables))
        if unknown or not evs:
            raise ValueError(f"the export serves EVs {sorted(self._tables)}; cannot shard {unknown or evs}")
        for name in set(self._tables) - set(evs):   # the front serves these
            self._tables.pop(name).close()
        self.publisher.dense.clear()      # the front serves the dense weights
        self.publisher.reserved.clear()
        self.index, self.count = int(index), int(count)
        self.stager.partition = Partition(self.index, self.count)
        self.budget = DiskBudget(disk_bytes, {n: t.dim for n, t in self._tables.items()},
                                 f"shard {self.index}/{self.count}")
        self._attach_root(checkpoint_root, storage_options, allow_empty=True, poll=False)
        self.pending = None
        self.bytes_read_last = 0
        self._stage_lock = threading.Lock()

    @property
    def pending_target(self):
        return self.pending.target if self.pending is not None else None

    # -- the two phases
    def stage(self, target, fleet=None):
        """Makes commit `target` readable beside the served version (see the
        module docstring); `fleet`: the version the front serves. Returns
        status(). Raises CheckpointError / OSError / tf.errors.OpError when
        the commit cannot be staged (the served version stays)."""
        with self._stage_lock:
            if self.pending is not None and fleet is not None and self.pending.target <= fleet:
                self._publish_pending()
            if self.version == target:
                return self.status()
            if self.pending is not None:
                if self.pending.target == target:
                    return self.status()
                self._drop_pending()
            sc = scan(self.storage)
            m = sc.manifests.get(target)
            if m is None:
                raise CheckpointError(f"commit {target} is not committed in {self.storage.url}")
            pending = self._stage_follow(sc, target)
            if pending is None:
                pending = self._stage_chain(resolve_chain(sc, upto=target, where=self.storage.url))
            self.bytes_read_last = sum(s.bytes_read for s in pending.staged)
            self.pending = pending
            if fleet == target:   # the fleet serves it already (rejoining, or its publish call was lost)
                self._publish_pending()
            return self.status()

    def _stage_follow(self, sc, target):
        """The deltas after the served commit up to `target` as an overlay, or
        None when `target` does not follow the served commit."""
        served = self.publisher.served
        if self.version is None or target <= self.version or not CommitSource.is_committed(sc, served):
            return None
        run, seq, checksum, children = [], served.seq, served.checksum, CommitSource.children(sc)
        while seq != target:
            nxt = [m for m in children.get((self.base, seq), ())
                   if m.seq <= target and (m.parent_checksum is None or m.parent_checksum == checksum)]
            if not nxt:
                return None
            m = min(nxt, key=lambda x: x.seq)
            run.append(m)
            seq, checksum = m.seq, m.checksum
        pending = _Pending(target, [self.stager.stage(m) for m in run])
        self._check_growth(run[-1], pending)
        return pending

    def _check_growth(self, m, pending):
        """The disk budget against the rows the served partition holds once
        `pending`'s deltas are applied."""
        if self.budget.disk_bytes is None:
            return
        held, added = self.rows(), {}
        for name, over in pending.overlay.items():
            keys = np.array(list(over), dtype=self._tables[name].key_dtype.as_numpy_dtype)
            have = self._tables[name].held(keys) if len(keys) else np.zeros([0], bool)
            fresh = np.array([over[k] is not None for k in keys.tolist()], bool)
            added[name] = int((fresh & ~have).sum()) - int((~fresh & have).sum())
        self.budget.check(m, held, added, "the served partition and the rows its deltas add")

    def _stage_chain(self, chain):
        """A new chain (full + deltas) streamed into replacement tables: the
        full's part files read in chunks (from the object store through an
        object source on a remote root: nothing on local disk; DRAM stays at
        the tables' cache budget, whatever the partition's size)."""
        held = self.rows() if self.version is not None else {}   # until the swap, both versions' rows
        fresh, staged = stream_chain(self.stager, self._tables, chain, check=lambda rows: self.budget.check(
            chain[0], held, rows, "the served partition and the new full's, until the swap" if held
            else "the full's partition"))
        return _Pending(chain[-1].seq, staged, fresh)

    def publish(self, target):
        """Makes the staged `target` the served version (a no-op when it is
        served already). Returns status(). Raises VersionNotHeld when
        `target` is neither served nor staged."""
        with self._stage_lock:
            if self.version == target:
                return self.status()
            if self.pending is None or self.pending.target != target:
                raise VersionNotHeld(f"shard {self.index}/{self.count} has not staged version {target} "
                                     f"(serving {self.version}, staged {self.pending_target})")
            self._publish_pending()
            return self.status()

    def _publish_pending(self):
        p, self.pending = self.pending, None
        if p.fresh is not None:
            self.publisher.adopt(p.fresh, p.staged)
        else:
            self.publisher.publish(p.staged)
        for s in p.staged:
            self.apply_metrics.fetched(s.bytes_read)
        self.apply_metrics.applied += len(p.staged)
        self.apply_metrics.applied_seqs.append(p.target)

    def _drop_pending(self):
        p, self.pending = self.pending, None
        with self.publisher.writing():   # no lookup reads its tables any more
            pass
        p.close()

    # -- reads
    def lookup(self, version, keys):
        """{EV: float32 rows [n, dim]} of `keys` ({EV: 1-D array of keys routed
        here}) at `version`; a key without a row reads the EV's default.
        Raises VersionNotHeld for a version not readable here, KeyError for
        an EV not served."""
        with self.publisher.reading():
            pending = self.pending
            if version is not None and version == self.version:
                return {n: self._find(self._tables[n]._h, n, k) for n, k in keys.items()}
            if pending is not None and version == pending.target:
                out = {}
                for n, k in keys.items():
                    base = pending.fresh[n].resource_handle if pending.fresh is not None else self._tables[n]._h
                    rows = self._find(base, n, k)
                    over = pending.overlay.get(n)
                    if over:
                        rows = np.array(rows)
                        default = self._tables[n].default
                        for j, key in enumerate(_key_list(k)):
                            if key in over:
                                row = over[key]
                                rows[j] = default if row is None else row
                    out[n] = rows
                return out
            raise VersionNotHeld(f"shard {self.index}/{self.count} holds version {self.version}"
                                 f"{'' if pending is None else f' and staged {pending.target}'}, not {version}")

    def _find(self, handle, name, keys):
        if name not in self._tables:
            raise KeyError(name)
        t = self._tables[name]
        return ops.ev_find(handle, tf.constant(keys, t.key_dtype), dim=t.dim).numpy()

    def status(self):
        """{"index", "count", "evs": {EV: {"dim", "key_dtype"}}, "version", "staged", "rows", "disk_budget",
        "row_bytes" (of the served rows), "tables": {EV: the DRAM and disk stats of its table}, ...}."""
        return {"index": self.index, "count": self.count, "version": self.version, "staged": self.pending_target,
                "evs": {n: {"dim": t.dim, "key_dtype": t.key_dtype.name} for n, t in self._tables.items()},
                "rows": self.rows(), "bytes_read_last": self.bytes_read_last, "last_error": self.last_error,
                "applied": self.applied, "fetched_bytes_total": self.fetched_bytes_total,
                "disk_budget": self.budget.disk_bytes, "row_bytes": self.budget.row_bytes(self.rows()),
                "tables": self.publisher.table_stats(("index_bytes", "meta_bytes", "cache_rows", "disk_bytes"))}

    def close(self):
        with self._stage_lock:
            if self.pending is not None:
                self._drop_pending()
        super().close()
