"""ShardedEmbeddingVariable: one embedding table split by key over N devices.

Layout: N ordinary EmbeddingVariables (`sev.shards`, named `<name>/part_<i>`),
each a resource on its own device: a parameter-server task under
`tf.distribute.experimental.ParameterServerStrategy`, the devices given, or
the local CPU. Key k lives in shard `shard_index(k, N)`, a mixing hash of the
key (native/core/shard.h; its name in manifests is schema.SHARD_ROUTE), never `k % N`: patterned ids
(multiples of 1000, field ids in the high bits) would pile onto one shard.

A training lookup deduplicates the ids where they are (the worker), sends each
shard its distinct keys with their occurrence counts (so frequencies and
admission equal an unsharded EV's), runs the shard's lookup on the shard's
device and stitches the rows back. The gradient reaching shard i is
`IndexedSlices(summed row gradients, distinct keys of shard i)`, applied by
the fused optimizer kernel on shard i's device: one request and one reply per
shard per direction, O(distinct keys) bytes.

Each shard is an EmbeddingVariable, so everything per table (filters,
eviction, export snapshots, checkpoints) works shard by shard on the device
that holds it; the checkpoint manager writes each shard's bundle on its
device and a chain saved with N shards restores into M (checkpoint/).
"""
import weakref

import numpy as np
import tensorflow as tf

from evstore import schema
from evstore._ops import gen
from evstore.group import embedding_lookup_group
from evstore.variable import EmbeddingVariable, UnshardedEmbeddingVariable

__all__ = ["ShardedEmbeddingVariable", "shard_index"]


def shard_index(keys, num_shards):
    """The shard (int32, keys' shape) of each key in an EV of `num_shards` shards.

    Integer keys: Mix64(int64(key) ^ seed) % num_shards (core/shard.h). A string
    key routes as the int64 whose bits are its FarmHash Fingerprint64, i.e.
    `shard_index(tf.bitcast(tf.fingerprint(keys), tf.int64), n)` for a
    vector of keys: reproducible with stock TensorFlow, pinned by golden values."""
    keys = tf.convert_to_tensor(keys)
    if keys.dtype not in (tf.int32, tf.int64, tf.string):
        raise TypeError(f"keys must be int32, int64 or string, got {keys.dtype.name}")
    return gen.ev_shard_index(keys, num_shards=int(num_shards))


def _ps_strategy():
    """The active ParameterServerStrategy, or None."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return strategy
    return None


def _resolve_devices(shards, devices):
    if devices is not None:
        if isinstance(devices, str):
            raise TypeError("devices must be a list of device strings, got a single string")
        devices = [str(d) for d in devices]
        if not devices:
            raise ValueError("devices must not be empty")
        shards = len(devices) if shards is None else shards
    strategy = _ps_strategy()
    # TF 2.21's ParameterServerStrategy has no public list of its parameter
    # servers (extended.parameter_devices is the base class's local device).
    num_ps = int(getattr(strategy.extended, "_num_ps", 0)) if strategy is not None else 0
    ps_devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(num_ps)]
    if shards is None:
        shards = len(ps_devices) or 1
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    shards = int(shards)
    if devices is None:
        if ps_devices:
            devices = ps_devices
        else:
            devices = [None] * shards   # the current device scope (local CPU)
    return [devices[i % len(devices)] for i in range(shards)]


class ShardedEmbeddingVariable(EmbeddingVariable, tf.Module, sharded_implementation=True):
    """An EmbeddingVariable split by key over `shards` unsharded EmbeddingVariables.

    Built by `evstore.EmbeddingVariable(name, dim, ..., shards=N, devices=None)`
    (every other argument is an EmbeddingVariable's, given to each shard).
    `devices`: one device string per shard (shard i goes to devices[i % len]);
    None places shard i on parameter server `i % num_ps` under a
    ParameterServerStrategy scope, else on the current (local) device. With
    `devices` and no `shards` there is one shard per device; with neither
    under a ParameterServerStrategy, one per parameter server.

    `evstore.embedding_lookup` (and the sparse lookups) and evstore optimizers
    work on it as on an EmbeddingVariable, with equal results: take
    gradients with respect to `sev.trainable_variables` (the shard EVs) and
    apply them with `opt.apply_gradients(zip(grads, sev.trainable_variables))`.

    It is an EmbeddingVariable (`isinstance(sev, evstore.EmbeddingVariable)`):
    its shards are `UnshardedEmbeddingVariable`s.

    Raises:
      ValueError / TypeError: bad `shards` or `devices`, or any argument an
        EmbeddingVariable refuses.
    """

    def __init__(self, name, dim, shards=None, devices=None, **ev_kwargs):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        super().__init__(name=None)
        self._ev_name = name
        self._devices = _resolve_devices(shards, devices)
        evs = []
        for i, dev in enumerate(self._devices):
            with tf.device(dev):
                evs.append(UnshardedEmbeddingVariable(f"{name}/part_{i}", dim, **ev_kwargs))
        for ev in evs:   # a shard found on its own (e.g. via its proxy) is saved with its siblings
            ev._sharded_parent = weakref.ref(self)
        self._shards = evs

    # ---- variable-like surface ---------------------------------------------
    @property
    def name(self):
        return self._ev_name

    @property
    def sharded(self):
        return True

    @property
    def shards(self):
        """The shard EVs, shard i holding the keys k with shard_index(k, N) == i."""
        return tuple(self._shards)

    @property
    def num_shards(self):
        return len(self._shards)

    @property
    def devices(self):
        """Each shard's device (its resource's device string)."""
        return [ev.device for ev in self._shards]

    @property
    def dim(self):
        return self._shards[0].dim

    @property
    def key_dtype(self):
        return self._shards[0].key_dtype

    @property
    def filter(self):
        return self._shards[0].filter

    @property
    def default_value(self):
        return self._shards[0].default_value

    @property
    def evict_policies(self):
        return self._shards[0].evict_policies

    @property
    def trainable(self):
        return self._shards[0].trainable

    @property
    def variables(self):
        return list(self._shards)

    def __repr__(self):
        return (f"<evstore.ShardedEmbeddingVariable '{self.name}' dim={self.dim} shards={self.num_shards} "
                f"key_dtype={self.key_dtype.name}>")

    def _key_tensor(self, ids, what="keys"):
        return self._shards[0]._key_tensor(ids, what)

    # ---- routing -----------------------------------------------------------
    def shard_index(self, keys):
        """The shard of each key (int32, keys' shape)."""
        return gen.ev_shard_index(self._key_tensor(keys), num_shards=self.num_shards)

    def _route(self, flat):
        """(per-shard keys, per-shard positions in `flat`) for a key vector."""
        n = self.num_shards
        part = gen.ev_shard_index(flat, num_shards=n)
        keys = tf.dynamic_partition(flat, part, n)
        pos = tf.dynamic_partition(tf.range(tf.size(flat)), part, n)
        return part, keys, pos

    def _per_key(self, keys, fn):
        """fn(shard, shard_keys) per shard, stitched back to keys' shape."""
        keys = self._key_tensor(keys)
        flat = tf.reshape(keys, [-1])
        _, parts, pos = self._route(flat)
        outs = [fn(ev, k) for ev, k in zip(self._shards, parts)]
        return tf.reshape(tf.dynamic_stitch(pos, outs), tf.shape(keys))

    def _lookup(self, ids, training, proxy=None):
        """Rows of `ids` (ids.shape + [dim]): the grouped lookup of this one EV
        (evstore/group.py holds the one routing path: dedup, route, exchange)."""
        return embedding_lookup_group([self], [ids], training=training, proxies=[proxy])[0]

    # ---- inspection and maintenance (summed or routed over the shards) ------
    def size(self):
        """Admitted keys over all shards (int64 scalar tensor)."""
        return tf.add_n([ev.size() for ev in self._shards])

    def stats(self):
        """`EmbeddingVariable.stats()` summed over the shards."""
        per = [ev.stats() for ev in self._shards]
        return {k: sum(p[k] for p in per[1:]) + per[0][k] for k in list(schema.STATS_FIELDS) + ["bytes"]}

    def evict(self, global_step=None):
        """Runs the eviction policies on every shard (on its device); returns the total evicted."""
        return tf.add_n([ev.evict(global_step) for ev in self._shards])

    def frequency(self, keys):
        return self._per_key(keys, lambda ev, k: ev.frequency(k))

    def version(self, keys):
        return self._per_key(keys, lambda ev, k: ev.version(k))

    def admitted(self, keys):
        return self._per_key(keys, lambda ev, k: ev.admitted(k))

    def remove(self, keys):
        """Erases keys from their shards; returns how many were present."""
        flat = tf.reshape(self._key_tensor(keys), [-1])
        _, parts, _ = self._route(flat)
        return tf.add_n([ev.remove(k) for ev, k in zip(self._shards, parts)])

    def keep_from(self, source, keys):
        """`EmbeddingVariable.keep_from` routed by key: shard i keeps from
        shard i of `source`, a ShardedEmbeddingVariable of as many shards (the
        same route), dim and key dtype. Returns how many keys were copied."""
        if not isinstance(source, ShardedEmbeddingVariable) or source.num_shards != self.num_shards:
            raise ValueError(f"ShardedEmbeddingVariable '{self.name}' ({self.num_shards} shards) keeps rows only of "
                             f"a sharded EV of as many shards, got {source!r}")
        flat = tf.reshape(self._key_tensor(keys), [-1])
        _, parts, _ = self._route(flat)
        return tf.add_n([own.keep_from(src, k) for own, src, k in zip(self._shards, source.shards, parts)])

    def zero_row_keys(self):
        return tf.concat([ev.zero_row_keys() for ev in self._shards], 0)

    def export(self):
        """Every shard's `export()` concatenated (small tables, debugging; eager only).

        Rows come shard by shard; within a shard in table order."""
        if not tf.executing_eagerly():
            raise RuntimeError("ShardedEmbeddingVariable.export() runs eagerly; export each of `shards` in a graph")
        parts = [ev.export() for ev in self._shards]
        out = {k: tf.concat([p[k] for p in parts], 0)
               for k in ("keys", "values", "versions", "freqs", "filtered_keys", "filtered_freqs")}
        names = sorted({s for p in parts for s in p["slots"]})
        out["slots"] = {}
        for s in names:
            out["slots"][s] = tf.concat([p["slots"].get(s, tf.zeros([tf.shape(p["keys"])[0], self.dim]))
                                         for p in parts], 0)
        return out

    def load(self, keys, values, versions=None, freqs=None, slots=None, filtered_keys=None,
             filtered_freqs=None, clear=False):
        """`EmbeddingVariable.load` routed by key: each shard gets its keys' rows."""
        keys = tf.reshape(self._key_tensor(keys), [-1])
        n = tf.shape(keys)[0]
        values = tf.convert_to_tensor(values, tf.float32)
        versions = tf.fill([n], tf.constant(-1, tf.int64)) if versions is None else tf.cast(versions, tf.int64)
        freqs = tf.zeros([n], tf.int64) if freqs is None else tf.cast(freqs, tf.int64)
        fk = self._key_tensor(tf.zeros([0], self.key_dtype) if filtered_keys is None else filtered_keys)
        ff = tf.zeros([0], tf.int64) if filtered_freqs is None else tf.cast(filtered_freqs, tf.int64)
        nsh = self.num_shards
        part = gen.ev_shard_index(keys, num_shards=nsh)
        fpart = gen.ev_shard_index(fk, num_shards=nsh)
        split = lambda x, p: tf.dynamic_partition(x, p, nsh)  # noqa: E731
        ks, vs, vers, fs = split(keys, part), split(values, part), split(versions, part), split(freqs, part)
        fks, ffs = split(fk, fpart), split(ff, fpart)
        sl = {s: split(tf.convert_to_tensor(v, tf.float32), part) for s, v in (slots or {}).items()}
        ops = [ev.load(ks[i], vs[i], vers[i], fs[i], {s: sl[s][i] for s in sl} or None, fks[i], ffs[i], clear=clear)
               for i, ev in enumerate(self._shards)]
        return tf.group(ops)
