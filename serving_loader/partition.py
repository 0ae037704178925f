"""Which keys of a commit a serving process holds: all of them, or one shard's partition.

A Stager (stager.py) and the streamed reload (streamed_reload.py) ask their
partition which checkpoint entries of an EV to read and which of their keys
to keep. `WHOLE` (a replica, a front) reads every part of an EV and keeps
every key. `Partition(i, N)` (a serving shard, shard_model.py) keeps the keys
`evstore.sharded.shard_index(key, N)` routes to i (route "mix64-v1", the
trainer's): of an EV written as N shards of that route it reads only the part
`<ev>/part_i` (every key in it is routed to i, nothing is filtered); of any
other layout it reads every part and keeps the keys routed to i
(checkpoint.shards.load_plan, as a restore from N into M shards does).
"""
import numpy as np
import tensorflow as tf

from checkpoint.shards import load_plan, logical_entries
from evstore.schema import SHARD_ROUTE
from evstore.sharded import shard_index

__all__ = ["WHOLE", "Partition"]


class _Whole:
    """Every key of every part."""

    index, count = 0, 1

    def plan(self, m, name):
        """[(entry, shard_index, num_shards)] of EV `name` in commit `m` to
        read; num_shards 1 keeps every key of the entry."""
        return [(p, 0, 1) for p in logical_entries(m).get(name, [])]

    def keep(self, keys, key_dtype):
        """Bool mask of `keys` (1-D ndarray) held here."""
        return np.ones([len(keys)], bool)

    def __repr__(self):
        return "WHOLE"


WHOLE = _Whole()


class Partition(_Whole):
    """Shard `index` of `count` (0 <= index < count)."""

    def __init__(self, index, count):
        if not 0 <= index < count:
            raise ValueError(f"shard {index}/{count}: need 0 <= index < count")
        self.index, self.count = int(index), int(count)

    def plan(self, m, name):
        return load_plan(m, name, {"ev": name, "index": self.index, "count": self.count, "route": SHARD_ROUTE})

    def keep(self, keys, key_dtype):
        if not len(keys):
            return np.zeros([0], bool)
        return shard_index(tf.constant(keys, tf.as_dtype(key_dtype)), self.count).numpy() == self.index

    def __repr__(self):
        return f"Partition({self.index}/{self.count})"
