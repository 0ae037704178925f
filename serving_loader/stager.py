"""The stager (TF Serving's loader): reads and checks one commit for serving (docs/ARCHITECTURE.md, "Serving").

Staging reads and checks, without any lock, what a commit changes in the served
state (`Staged`); the publisher (serving_loader/publisher.py) then makes it the
served state under the write lock, which cannot fail on content, since staging
validated everything. A chain for evstore tables is staged by streaming its
full into replacement tables (serving_loader/streamed_reload.py)."""
import numpy as np
import tensorflow as tf

from checkpoint.errors import CheckpointError
from checkpoint.fetch import fetch
from serving_loader import served_tensors
from serving_loader.export import sentinels
from serving_loader.partition import WHOLE

__all__ = ["Stager", "Staged"]


class Staged:
    """A checkpoint read into memory, ready to publish."""

    def __init__(self, manifest, evs, dense, view="float32", bytes_read=0):
        self.manifest = manifest
        self.evs = evs        # name -> (erase_keys, upsert_keys, upsert_values, reserved, freqs or None)
        self.dense = dense    # name -> np.ndarray
        self.view = view      # the precision its rows were read in
        self.bytes_read = bytes_read


class Stager:
    """Stages commits of `storage` for the served tables of `publisher` (their
    names, kinds and dense shapes: it reads no served rows and changes
    nothing), as the serving map `mapping` describes them; reads a commit's
    serving view when `use_serving_view`. `partition` (partition.py) says
    which keys this process holds: WHOLE, or a serving shard's Partition
    (only its part's tensors are read when the trainer's shards match, else
    every part's, keeping the keys routed to it)."""

    def __init__(self, storage, mapping, publisher, use_serving_view, partition=WHOLE):
        self.storage = storage
        self.mapping = mapping
        self._tables = publisher.tables
        self._dense = publisher.dense
        self._reserved = publisher.reserved
        self.use_serving_view = use_serving_view
        self.partition = partition

    def precision(self):
        """The precision the served tables keep rows in: "float32", or the
        view dtype of evstore tables loaded from a full with a view (every
        table of a chain has its full's: serving_loader/ev_table.py)."""
        return next((t.precision for t in self._tables.values() if getattr(t, "precision", "float32") != "float32"),
                    "float32")

    def stage(self, m, precision=None):
        """Reads and checks what checkpoint `m` changes in the served state,
        nothing else (checkpoint/fetch.py: keys, values or the serving view,
        filtered and deleted keys, the served dense weights; never optimizer
        state). Raises CheckpointError for anything that cannot be served.

        `precision`: the precision of the tables the rows go into (None: the
        served tables'). A table in a view's precision gets the view's rows
        undecoded when the commit's view is that precision, else the float32
        rows (which it encodes as the view would); a float32 table gets the
        view's rows decoded when `use_serving_view`.

        Each byte staged is read once, on a local root too: fetch reads the
        named tensors into memory and checks them there (a data file of
        served tensors whole against the manifest, a tensor beside unserved
        ones against its index entry) before anything here returns, so a
        changed byte is refused naming the file (and tensor) and no served
        table changes; the whole-bundle `verify` modes of restores do not
        apply to named reads."""
        plans = self.plans(m)
        precision = precision or self.precision()
        view = (m.serving_view or {}).get("dtype")
        use_view = view == precision if precision != "float32" else self.use_serving_view
        plan = served_tensors.plan(m, {n: [e for e, _, _ in p] for n, p in plans.items()}, list(self._dense),
                                   use_view,
                                   freqs=[n for n, t in self._tables.items() if t.weighs_freqs])
        with fetch(self.storage, m, plan.tensors) as t:
            evs = {}
            for name in self._tables:
                try:
                    keys, values, erase = plan.ev_arrays(t, name, self.mapping["evs"][name]["dim"],
                                                         decode=precision == "float32")
                except ValueError as e:
                    raise CheckpointError(f"{m.dir}: EV {name!r}: {e}") from None
                freqs = None
                if self._tables[name].weighs_freqs:
                    freqs = plan.ev_freqs(t, name)
                    if len(freqs) != len(keys):
                        raise CheckpointError(f"{m.dir}: EV {name!r} has {len(freqs)} frequencies for "
                                              f"{len(keys)} keys")
                if any(n > 1 for _, _, n in plans[name]):   # parts of another layout: keep this partition's keys
                    kd = self.mapping["evs"][name]["key_dtype"]
                    mine = self.partition.keep(keys, kd)
                    keys, values = keys[mine], values[mine]
                    freqs = None if freqs is None else freqs[mine]
                    erase = erase[self.partition.keep(erase, kd)]
                evs[name] = self.checked(m, name, erase, keys, values) + (freqs,)
            dense = {n: t[n] for n in self._dense}
            bytes_read = t.bytes_read
        self.check_dense(m, dense)
        return Staged(m, evs, dense, view=plan.view if precision == "float32" else precision, bytes_read=bytes_read)

    @property
    def dense_names(self):
        """The dense weights served here."""
        return list(self._dense)

    def plans(self, m):
        """{served EV: [(entry, shard_index, num_shards)]} of commit `m`: the
        entries this process reads (a sharded EV's parts apply to its one
        table; num_shards > 1: keep only the keys routed to shard_index).
        Raises CheckpointError when an EV served here is missing."""
        plans = {n: self.partition.plan(m, n) for n in self._tables}
        missing = sorted(n for n, p in plans.items() if not p)
        if missing:
            raise CheckpointError(f"{m.dir} holds no EV {missing} that the export serves")
        return plans

    def check_dense(self, m, dense):
        for n, v in dense.items():
            if tuple(v.shape) != tuple(self._dense[n].shape) or v.dtype != self._dense[n].dtype.as_numpy_dtype:
                raise CheckpointError(f"{m.dir}: dense {n!r} is {v.dtype} {list(v.shape)}, the export serves "
                                      f"{self._dense[n].dtype.name} {self._dense[n].shape.as_list()}")

    def checked(self, m, name, erase, keys, values):
        """Validates an EV's staged tensors completely (publish must not fail
        half-way): dtypes, dim, row counts; splits off the sentinel keys, which
        live beside a stock table. Returns (erase, keys, values, reserved) with
        reserved = {j: row or None (erased)} for sentinel key j (sentinels())."""
        info = self.mapping["evs"][name]
        kd = tf.as_dtype(info["key_dtype"]).as_numpy_dtype
        if keys.dtype != kd or erase.dtype != kd:
            raise CheckpointError(f"{m.dir}: EV {name!r} has {keys.dtype} keys, the export serves {info['key_dtype']}")
        if isinstance(values, served_tensors.ViewRows):   # checked against the view by its decoder
            if values.shape != (len(keys), info["dim"]):
                raise CheckpointError(f"{m.dir}: EV {name!r} has view rows of shape {values.shape[1:]} for "
                                      f"{len(keys)} keys, the export serves dim {info['dim']}")
        elif values.dtype != np.float32 or values.ndim != 2 or values.shape != (len(keys), info["dim"]):
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
