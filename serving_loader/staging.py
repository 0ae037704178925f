"""Staging and publishing a checkpoint (docs/ARCHITECTURE.md, "Serving").

Staging reads and checks, without any lock, what a commit changes in the served
state (Staged); publishing makes it the served state under the write lock and
cannot fail on content, since staging validated everything."""
import numpy as np
import tensorflow as tf

from checkpoint.errors import CheckpointError
from checkpoint.fetch import fetch
from checkpoint.shards import logical_entries
from serving_loader import served_tensors
from serving_loader.ev_table import EVSTORE
from serving_loader.export import sentinels

__all__ = ["Staging"]


class _Staged:
    """A checkpoint read into memory, ready to publish."""

    def __init__(self, manifest, evs, dense, view="float32", bytes_read=0):
        self.manifest = manifest
        self.evs = evs        # name -> (erase_keys, upsert_keys, upsert_values, reserved, freqs or None)
        self.dense = dense    # name -> np.ndarray
        self.view = view      # the precision its rows were read in
        self.bytes_read = bytes_read


class Staging:
    """ServingModel's staging and publishing of checkpoints (a mixin: the state it
    reads and writes is ServingModel's, set up by its __init__)."""

    def _stage(self, m):
        """Reads and checks what checkpoint `m` changes in the served state,
        nothing else (checkpoint/fetch.py: keys, values or the serving view,
        filtered and deleted keys, the served dense weights; never optimizer
        state). Raises CheckpointError for anything that cannot be served."""
        parts = logical_entries(m)   # a sharded EV's parts apply to its one table
        missing = sorted(set(self._tables) - set(parts))
        if missing:
            raise CheckpointError(f"{m.dir} holds no EV {missing} that the export serves")
        plan = served_tensors.plan(m, {n: parts[n] for n in self._tables}, list(self._dense), self.use_serving_view,
                                   freqs=[n for n, t in self._tables.items() if t.weighs_freqs])
        with fetch(self.storage, m, plan.tensors) as t:
            evs = {}
            for name in self._tables:
                try:
                    keys, values, erase = plan.ev_arrays(t, name, self.mapping["evs"][name]["dim"])
                except ValueError as e:
                    raise CheckpointError(f"{m.dir}: EV {name!r}: {e}") from None
                freqs = None
                if self._tables[name].weighs_freqs:
                    freqs = plan.ev_freqs(t, name)
                    if len(freqs) != len(keys):
                        raise CheckpointError(f"{m.dir}: EV {name!r} has {len(freqs)} frequencies for "
                                              f"{len(keys)} keys")
                evs[name] = self._checked(m, name, erase, keys, values) + (freqs,)
            dense = {n: t[n] for n in self._dense}
            bytes_read = t.bytes_read
        self._check_dense(m, dense)
        return _Staged(m, evs, dense, view=plan.view, bytes_read=bytes_read)

    def _check_dense(self, m, dense):
        for n, v in dense.items():
            if tuple(v.shape) != tuple(self._dense[n].shape) or v.dtype != self._dense[n].dtype.as_numpy_dtype:
                raise CheckpointError(f"{m.dir}: dense {n!r} is {v.dtype} {list(v.shape)}, the export serves "
                                      f"{self._dense[n].dtype.name} {self._dense[n].shape.as_list()}")

    def _checked(self, m, name, erase, keys, values):
        """Validates an EV's staged tensors completely (publish must not fail
        half-way): dtypes, dim, row counts; splits off the sentinel keys, which
        live beside a stock table. Returns (erase, keys, values, reserved) with
        reserved = {j: row or None (erased)} for sentinel key j (sentinels())."""
        info = self.mapping["evs"][name]
        kd = tf.as_dtype(info["key_dtype"]).as_numpy_dtype
        if keys.dtype != kd or erase.dtype != kd:
            raise CheckpointError(f"{m.dir}: EV {name!r} has {keys.dtype} keys, the export serves {info['key_dtype']}")
        if values.dtype != np.float32 or values.ndim != 2 or values.shape != (len(keys), info["dim"]):
            raise CheckpointError(f"{m.dir}: EV {name!r} has rows of shape {values.shape[1:]} for {len(keys)} keys, "
                                  f"the export serves dim {info['dim']}")
        if not self._tables[name].reserves_sentinels:
            return erase, keys, values, {}
        empty, deleted = sentinels(info["key_dtype"])
        reserved = {}
        for j, k in enumerate((empty, deleted)):
            if (erase == k).any():
                reserved[j] = None
            hit = np.flatnonzero(keys == k)
            if hit.size:
                reserved[j] = values[hit[-1]]
        if reserved:
            if name not in self._reserved:
                raise CheckpointError(f"{m.dir}: EV {name!r} holds key {(empty, deleted)[min(reserved)]!r}, which this export "
                                      "cannot serve (written before sentinel keys were served): re-export it "
                                      "with export_serving_model")
            keep = (keys != empty) & (keys != deleted)
            keys, values = keys[keep], values[keep]
            erase = erase[(erase != empty) & (erase != deleted)]
        return erase, keys, values, reserved

    def _warm(self, s):
        """Before the write lock: reads the rows staged `s` changes in each served
        table, as a prediction does, so a tiered table holds them in DRAM and
        its publish does not read them from disk under the lock (a no-op for
        tables in DRAM). Predictions go on meanwhile."""
        self._lock.acquire_read()
        try:
            for name, (_, keys, *_) in s.evs.items():
                if keys.size:
                    self._tables[name].warm(keys)
        finally:
            self._lock.release_read()

    def _fleet_stage(self, m):
        """Before commit `m` is published here: a sharded serving front has every
        shard stage it (serving_loader/front.py), raising OSError (the fleet
        holds its version) when one cannot. A no-op for one replica."""

    def _fleet_published(self, seq):
        """After commit `seq` was published here (a sharded front tells its
        shards; a no-op for one replica)."""

    def _fill_rows(self, signature, inputs):
        """Under the read lock, before signature `signature` runs on `inputs`:
        a sharded front fetches the rows it looks up from its shards. A no-op
        for one replica."""

    def _publish(self, s):
        """Under the write lock: make the staged checkpoint the served state.
        Everything was validated by _stage, so no step here fails on content."""
        for name, (erase, keys, values, reserved, freqs) in s.evs.items():
            table = self._tables[name]
            if erase.size:
                table.erase(erase)
            if keys.size:
                table.insert(keys, values, freqs)
            if reserved:
                rows_var, present_var = self._reserved[name]
                rows, present = rows_var.numpy(), present_var.numpy()
                for j, row in reserved.items():
                    present[j] = row is not None
                    if row is not None:
                        rows[j] = row
                rows_var.assign(rows)
                present_var.assign(present)
        for name, value in s.dense.items():
            self._dense[name].assign(value)
        self.version = s.manifest.seq
        self.base = s.manifest.base
        self.serving_view = s.view
        self.fetched_bytes_total += s.bytes_read
        self.last_fetched_bytes = s.bytes_read
        self._served_checksum = s.manifest.checksum
        self.served_quality = s.manifest.quality
        if self.gate is not None:
            self.gate.served(s.manifest.quality)

    def _load_chain(self, chain):
        """Stages every checkpoint of `chain` (raising before any change if one
        fails), then under the write lock replaces the served state with it.
        Evstore tables stream the full instead (serving_loader/streamed_reload.py)."""
        if self.table_kind == EVSTORE:
            return self._load_chain_streamed(chain)
        staged = [self._stage(m) for m in chain]
        self._fleet_stage(chain[-1])
        self._lock.acquire_write()
        try:
            for name, table in self._tables.items():  # drop the previous chain's rows
                keys, _ = table.export()
                empty, deleted = sentinels(self.mapping["evs"][name]["key_dtype"])
                keys = tf.boolean_mask(keys, tf.logical_and(tf.not_equal(keys, empty), tf.not_equal(keys, deleted)))
                if int(tf.size(keys)):
                    table.erase(keys)
            for _, present_var in self._reserved.values():
                present_var.assign(tf.zeros_like(present_var))
            for s in staged:
                self._publish(s)
        finally:
            self._lock.release_write()
        self._fleet_published(chain[-1].seq)
