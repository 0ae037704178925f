"""The front of a sharded serving fleet (`evstore serve --shards host:port,...`).

It is a ServingModel of the same export (evstore tables) that serves the dense
weights and the EVs its shards do not hold, answers TF Serving's REST and gRPC
APIs as a single replica does, and reads the sharded EVs' rows from the
shards (serving_loader/shard_model.py) per request:

  * under the read lock, `version` is the fleet's version; the export's
    `lookup_keys_<signature>` function (serving_loader/export.py) gives the
    ids each EV lookup of the request will read; the front deduplicates them,
    routes them and asks each shard holding any of them once
    (serving_loader/shard_client.py) for its rows at `version`;
  * keys whose rows an earlier request of `version` brought are not asked
    again (a request whose rows are all here makes no call);
  * the rows go into the EV's table here (a per-version cache: every row in
    it is `version`'s, a key the shard has no row for with the EV's default),
    then the signature runs as on a single replica, so the answer equals a
    single replica's at `version` bit for bit;
  * a shard that does not answer fails the request with UNAVAILABLE (REST
    503) naming the shard; requests whose keys live elsewhere are served.

Publishing a commit is two-phase across the fleet: the front stages its own
part (dense weights, small EVs), has every shard stage its partition
(the walk's fleet, serving_loader/walk.py: Stage to all; one that cannot holds the whole fleet at its
version: the failure is counted and retried at the next poll), then under
its write lock publishes its part, empties the sharded EVs' caches and moves
`version`; after it, Publish tells the shards to drop the previous version.
Between the two, shards answer the old and the new version, and no request
of the old one is still in flight (they hold the read lock), so every answer
reads one version. Gate, pin and rollback are the front's (ServingModel's)
and therefore the fleet's. Each poll first has shards that serve another
version (a restarted one) stage and publish the fleet's: a killed shard
rejoins at the fleet's version.
"""
import threading

import numpy as np

from serving_loader.flat_call import FlatCall
from serving_loader.model import ServingModel
from serving_loader.shard_client import Fleet, ShardUnavailable
from serving_loader.tfs import ServingError
from serving_loader.walk import REPLACEMENTS

__all__ = ["FrontModel"]


class FrontModel(ServingModel):
    """The front of the shards at `shards` (["host:port"], shard i at
    shards[i]; or [["host:port", ...]], the replicas of each shard) for serving export `export_dir` (written with
    tables="evstore") and the trainer's `checkpoint_root`.

    `gate`, `allow_empty`, `storage_options`: as ServingModel's. `wait_s`:
    how long to wait for every shard to answer at start. `timeout_s`: a
    request's deadline at each shard. `max_cached_rows`: a sharded EV's
    cache here (rows fetched for requests at the served version) is emptied
    at the next poll once it holds more rows (it is emptied at every
    publish anyway), so a fleet that publishes nothing for a long while
    does not pull its whole model into the front. `token`: the fleet's
    bearer token (--shard-token-file), sent with every call to the shards;
    `tls_ca`: PEM of the CA certificates of the shards' TLS (--shard-tls-ca).

    Raises ValueError (an export of stock tables or one without lookup_keys
    functions: re-export it; shards that are not 0..N-1 of one fleet),
    ShardUnavailable (a shard did not answer within `wait_s`),
    NothingToServeError (as ServingModel's).
    """

    def __init__(self, export_dir, checkpoint_root, shards, storage_options=None, allow_empty=False, gate=None,
                 wait_s=60.0, timeout_s=5.0, max_cached_rows=1_000_000, token=None, tls_ca=None):
        super().__init__(export_dir, None, gate=gate)
        if self.table_kind != "evstore":
            raise ValueError(f"{export_dir} serves its EVs from stock tables; a sharded fleet needs an export "
                             "written with export_serving_model(..., tables=\"evstore\")")
        self._keys_fns = {}   # signature -> (public call of its lookup_keys function, FlatCall or None)
        for key in self.signature_defs:
            fn = getattr(self._loaded, f"lookup_keys_{key}", None)
            if fn is not None:
                self._keys_fns[key] = (fn, self._flat_keys(fn, key))
        if self.signature not in self._keys_fns:
            raise ValueError(f"{export_dir} has no lookup_keys functions (written before sharded serving): "
                             "export it again with export_serving_model(..., tables=\"evstore\")")
        self.fleet = Fleet(shards, timeout_s=timeout_s, token=token, tls_ca=tls_ca)
        evs = self.fleet.describe(wait_s)
        self.remote = {}   # sharded EV -> its table here (rows of `version` fetched for requests)
        tables = self.publisher.tables
        for name, info in evs.items():
            t = tables.get(name)
            if t is None or t.dim != info["dim"] or t.key_dtype.name != info["key_dtype"]:
                raise ValueError(f"the shards serve EV {name!r} {info}, which this export does not serve so")
            self.remote[name] = tables.pop(name)
        self._cache_lock = threading.Lock()
        self.max_cached_rows = int(max_cached_rows)
        # A reload or rollback reads the chain's own part (small EVs, dense) into memory, never the
        # sharded EVs' rows; the shards stage theirs before each publish and publish after it.
        self.walk.reload = REPLACEMENTS
        self.walk.fleet = self.fleet
        self.publisher.after_publish.append(self._drop_cached_rows)
        if checkpoint_root is not None:
            self._attach_root(checkpoint_root, storage_options, allow_empty=allow_empty)

    # -- the fleet's publish
    def poll(self):
        if self.storage is not None and self.version is not None:
            with self.walk.lock:   # shards serving another version (restarted) stage and publish the fleet's
                for k, problem in self.fleet.rejoin(self.version):
                    self.walk.refuse(None, f"{problem}: not used until it is back (requests that need a shard "
                                     "none of whose replicas is up fail)", key=("rejoin", k), retry=True)
        self._trim_caches()
        return super().poll()

    def _trim_caches(self):
        with self.publisher.reading():
            big = [t for t in self.remote.values() if t.size() > self.max_cached_rows]
        if big:
            with self.publisher.writing():
                for t in big:
                    t.adopt(t.replacement())

    def _drop_cached_rows(self):
        """Under the write lock, after a publish: the rows cached here were the previous version's."""
        for t in self.remote.values():
            t.adopt(t.replacement())

    # -- requests
    def _fill_rows(self, signature, inputs):
        if self.version is None or not self.remote:
            return   # nothing served yet: every EV reads its default, as on a single replica
        fn, flat = self._keys_fns.get(signature, (None, None))
        if fn is None:
            raise ServingError("UNIMPLEMENTED", f"signature {signature!r} has no lookup_keys function in the export")
        keys = flat(inputs) if flat is not None else None
        if keys is None:
            keys = fn(*[inputs[n] for n in self._positional(signature, inputs)])
        want = {}
        for n, table in self.remote.items():
            k = np.unique(keys[n].numpy())
            if len(k):
                k = k[~table.held(k)]   # rows this request's version already brought here
            if len(k):
                want[n] = k
        if not want:
            return
        try:
            got = self.fleet.lookup(self.version, want)
        except ShardUnavailable as e:
            raise ServingError("UNAVAILABLE", f"version {self.version}: {e}") from None
        with self._cache_lock:
            for n, (k, rows) in got.items():
                if len(k):
                    self.remote[n].insert(k, rows)   # the cache is dropped whole at a publish

    def _positional(self, signature, inputs):
        """The input names of `signature`, in its lookup_keys function's parameter order."""
        if signature == self.signature:
            return [i["name"] for i in self.mapping["inputs"]]
        return list(self.signature_defs[signature].inputs) if signature in self.signature_defs else list(inputs)

    def _flat_keys(self, fn, key):
        """A FlatCall of lookup_keys function `fn` (its public call costs ~0.5 ms of argument binding per
        request), or None (the public call then)."""
        cfs = getattr(fn, "concrete_functions", None) or []
        if len(cfs) != 1:
            return None
        return FlatCall.build(cfs[0], f"lookup_keys_{key}", positional=self._positional(key, {}))

    def admin_status(self):
        out = super().admin_status()
        out["shards"] = [st if st is not None else {"error": e} for st, e in self.fleet.status()]
        return out

    def close(self):
        super().close()
        for t in getattr(self, "remote", {}).values():
            t.close()
        self.remote = {}
        if getattr(self, "fleet", None) is not None:
            self.fleet.close()
