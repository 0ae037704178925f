"""The front's client of its serving shards (serving_loader/shard_service.py).

`Fleet(["host:port", ...])`: shard i at the i-th address (each shard checks
it was started as i/N); `Fleet([["host:port", "host:port"], ...])`: replicas
of each shard, the front failing over between them. `lookup(version, {EV: keys})` deduplicates each EV's
keys, routes them (evstore.sharded.shard_index, the trainer's route) and
sends one Lookup to each shard that holds any of them, all in flight at once;
`stage` / `publish` / `status` go to every shard in parallel.

Failures are ShardUnavailable (a ConnectionError, so the front's poll treats
a failed stage as transient: the fleet holds its version and retries), its
message naming the shard, its address and why.
"""
import json
import logging
import time
from concurrent import futures

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from evstore.sharded import shard_index
from serving_loader.shard_service import AUTH_HEADER, SERVICE
from serving_loader.tensor_proto import array_to_tensor, tensor_to_array
from serving_loader.tfs import ServingError

__all__ = ["Fleet", "ShardUnavailable"]

log = logging.getLogger("evstore.serving")


class ShardUnavailable(ConnectionError):
    """A shard did not answer, or cannot serve what was asked of it."""


def parse_addresses(text):
    """"host:port|host:port,host:port" -> [[replica address] per shard]
    (commas separate shards, `|` the replicas of one shard); ValueError when
    malformed."""
    out = []
    for shard in str(text).split(","):
        if not shard.strip():
            continue
        replicas = [a.strip() for a in shard.split("|")]
        for a in replicas:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"a shard address is host:port (replicas of one shard joined by |), got {a!r}")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"shard {len(out)} lists a replica twice: {shard.strip()!r}")
        out.append(replicas)
    if not out:
        raise ValueError("--shards lists no shard")
    return out


class _WithMetadata:
    """A unary-unary callable that sends `metadata` with every call."""

    def __init__(self, call, metadata):
        self._call, self._md = call, metadata

    def __call__(self, data, timeout):
        return self._call(data, timeout=timeout, metadata=self._md)

    def future(self, data, timeout):
        return self._call.future(data, timeout=timeout, metadata=self._md)


class Fleet:
    """Clients of the shards at `addresses` (shard i at addresses[i]: one
    "host:port", or a list of its replicas' addresses).

    Replicas: every replica of a shard stages and publishes every commit; a
    Lookup goes to one replica of each shard (rotating among those at the
    fleet's version), and to the next when it does not answer or does not
    hold the version asked (each Lookup names it, so an answer still reads
    one version). A commit is published once at least one replica of every
    shard staged it; a replica that did not is not used until the front's
    rejoin check finds it at the fleet's version (`usable`).

    `timeout_s`: a Lookup's deadline; `stage_timeout_s`: a Stage's (it reads
    a commit; a full takes longer); `token`: the fleet's bearer token, sent
    with every call; `tls_ca`: PEM of the certificates that sign the shards'
    (TLS to every shard; shard_service.py)."""

    def __init__(self, addresses, timeout_s=5.0, stage_timeout_s=600.0, token=None, tls_ca=None):
        self.addresses = [[a] if isinstance(a, str) else list(a) for a in addresses]
        self.count = len(self.addresses)
        self.timeout_s = timeout_s
        self.stage_timeout_s = stage_timeout_s
        self._replicas = [(i, r) for i in range(self.count) for r in range(len(self.addresses[i]))]
        # A restarted shard is reconnected within a second or two (grpc's default backoff grows to 120 s).
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls_ca is None:
            self._channels = {(i, r): grpc.insecure_channel(self.addresses[i][r], options=options)
                              for i, r in self._replicas}
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channels = {(i, r): grpc.secure_channel(self.addresses[i][r], creds, options=options)
                              for i, r in self._replicas}
        md = None if token is None else ((AUTH_HEADER, f"Bearer {token}"),)
        self._calls = {k: {m: _WithMetadata(ch.unary_unary(f"/{SERVICE}/{m}"), md)
                           for m in ("Lookup", "Stage", "Publish", "Status")}
                       for k, ch in self._channels.items()}
        self.usable = {k: True for k in self._replicas}   # at the fleet's version, answering
        self._next = [0] * self.count                     # the replica each shard's next Lookup tries first
        self._pool = futures.ThreadPoolExecutor(max(2, len(self._replicas)), thread_name_prefix="fleet")
        self.evs = None      # {EV: {"dim", "key_dtype"}} the shards serve (describe())

    def _name(self, i, r=0):
        rep = f" replica {r}" if len(self.addresses[i]) > 1 else ""
        return f"shard {i}/{self.count}{rep} at {self.addresses[i][r]}"

    def _why(self, k, e):
        if isinstance(e, grpc.RpcError) and e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                          grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"{self._name(*k)} is unavailable ({e.code().name}: {e.details()})"
        if isinstance(e, grpc.RpcError):
            return f"{self._name(*k)}: {e.code().name}: {e.details()}"
        return f"{self._name(*k)}: {e}"

    # -- control
    def _control(self, method, body, timeout, replicas=None):
        """{(shard, replica): (status dict or None, error message or None)} of
        every replica (or of `replicas`)."""
        data = json.dumps(body).encode()
        keys = self._replicas if replicas is None else replicas
        fs = {k: self._pool.submit(self._calls[k][method], data, timeout=timeout) for k in keys}
        out = {}
        for k, f in fs.items():
            try:
                out[k] = (json.loads(f.result()), None)
            except Exception as e:  # noqa: BLE001 - reported per replica
                out[k] = (None, self._why(k, e))
        return out

    def status(self):
        """[(status or None, error or None)] of every replica, shard by shard."""
        got = self._control("Status", {}, self.timeout_s)
        return [got[k] for k in self._replicas]

    def describe(self, wait_s=60.0):
        """Waits (up to `wait_s`) until every replica answers (or, after 5 s,
        at least one of each shard), checks they are shards 0..N-1 of N
        serving the same EVs, and returns those EVs. Raises ValueError for a
        misconfigured fleet, ShardUnavailable when a shard has no replica
        answering in time."""
        start = time.monotonic()
        deadline = start + wait_s
        while True:
            answers = self._control("Status", {}, self.timeout_s)
            down = [i for i in range(self.count) if all(answers[k][1] for k in self._replicas if k[0] == i)]
            if not any(e for _, e in answers.values()) or (not down and time.monotonic() - start >= min(wait_s, 5)):
                break
            if time.monotonic() >= deadline:
                raise ShardUnavailable("; ".join(answers[k][1] for k in self._replicas if k[0] in down))
            time.sleep(0.2)
        evs = None
        for (i, r), (st, e) in answers.items():
            if e:
                self.usable[i, r] = False
                log.warning("%s (it is used once it answers at the fleet's version)", e)
                continue
            if st["index"] != i or st["count"] != self.count:
                raise ValueError(f"{self.addresses[i][r]} is shard {st['index']}/{st['count']}, listed as shard "
                                 f"{i}/{self.count}: --shards lists the shards in order")
            if evs is not None and st["evs"] != evs:
                raise ValueError(f"{self._name(i, r)} serves EVs {st['evs']}, another serves {evs}")
            evs = st["evs"]
        self.evs = evs
        return evs

    def stage(self, target, fleet):
        """Every replica stages `target` (the fleet serves `fleet`). Raises
        ShardUnavailable naming the shards none of whose replicas could; a
        replica that could not (of a shard another replica staged) is not
        used from the publish on, until it rejoins."""
        got = self._control("Stage", {"target": target, "fleet": fleet}, self.stage_timeout_s)
        failed = [i for i in range(self.count) if all(got[k][1] for k in self._replicas if k[0] == i)]
        if failed:
            raise ShardUnavailable(f"not every shard could stage commit {target}, the fleet holds "
                                   f"{fleet}: " + "; ".join(got[k][1] for k in self._replicas if k[0] in failed))
        self._staged = {k for k, (_, e) in got.items() if not e}
        for k, (_, e) in got.items():
            if e:
                log.warning("%s (not used until it rejoins at the fleet's version)", e)

    def publish(self, target):
        """Every replica that staged `target` publishes it; the others are not
        used until they rejoin. A replica that misses the publish publishes
        it when it next stages or rejoins (logged here)."""
        staged = getattr(self, "_staged", set(self._replicas))
        for k in self._replicas:
            if k not in staged:
                self.usable[k] = False
        for k, (_, e) in self._control("Publish", {"target": target}, self.timeout_s).items():
            if e and k in staged:
                log.warning("publish of %s: %s (it publishes it when it next stages)", target, e)

    def rejoin(self, version):
        """Replicas that serve another version than the fleet's `version` (a
        restarted one serves nothing) stage and publish it; every replica
        found at `version` is used again. Returns [(replica key, message)] of
        replicas that could not (a shard none of whose replicas is at the
        version answers nothing until then)."""
        problems = []
        for k, (st, e) in self._control("Status", {}, self.timeout_s).items():
            if e:
                self.usable[k] = False
                problems.append((k, e))
                continue
            if st["version"] != version:
                self.usable[k] = False
                try:
                    self._calls[k]["Stage"](json.dumps({"target": version, "fleet": version}).encode(),
                                            timeout=self.stage_timeout_s)
                    log.info("%s rejoined the fleet at version %s", self._name(*k), version)
                except grpc.RpcError as e2:
                    problems.append((k, self._why(k, e2)))
                    continue
            self.usable[k] = True
        return problems

    # -- reads
    def lookup(self, version, keys):
        """{EV: (distinct keys, float32 rows [n, dim])} of `keys` ({EV: 1-D
        array}) at `version`, one Lookup per shard holding any of them (to
        its next usable replica; to the others in turn when it does not
        answer). Raises ShardUnavailable naming the shards none of whose
        replicas answered it."""
        routed = {}
        for name, k in keys.items():
            uniq = np.unique(k)
            kd = tf.as_dtype(self.evs[name]["key_dtype"])
            idx = shard_index(tf.constant(uniq, kd), self.count).numpy() if len(uniq) else np.zeros([0], np.int32)
            routed[name] = (uniq, idx)
        calls = []
        for i in range(self.count):
            req = predict_pb2.PredictRequest()
            req.model_spec.version.value = version
            for name, (uniq, idx) in routed.items():
                mine = uniq[idx == i]
                if len(mine):
                    array_to_tensor(mine, req.inputs[name])
            if req.inputs:
                data = req.SerializeToString()
                order = self._order(i)
                calls.append((i, data, order, self._calls[i, order[0]]["Lookup"].future(data, timeout=self.timeout_s)))
        out = {name: (uniq, np.empty([len(uniq), self.evs[name]["dim"]], np.float32))
               for name, (uniq, _) in routed.items()}
        errors = []
        for i, data, order, f in calls:
            raw, why = self._answer(i, data, order, f)
            if raw is None:
                errors.append(why)
                continue
            resp = predict_pb2.PredictResponse.FromString(raw)
            for name, (uniq, idx) in routed.items():
                mine = idx == i
                if mine.any():
                    dim = self.evs[name]["dim"]
                    try:
                        rows = tensor_to_array(name, resp.outputs[name],
                                               (np.float32, [int(mine.sum()), dim], "DT_FLOAT"))
                    except ServingError as e:
                        errors.append(f"{self._name(i)} answered rows that do not fit: {e.message}")
                        break
                    out[name][1][mine] = rows
        if errors:
            raise ShardUnavailable("; ".join(errors))
        return out

    def _order(self, i):
        """Shard i's replicas in the order a Lookup tries them: the usable ones
        rotating (spreading the load), then the others."""
        n = len(self.addresses[i])
        if n == 1:
            return [0]
        first = self._next[i] % n
        self._next[i] = first + 1
        turn = [(first + j) % n for j in range(n)]
        return [r for r in turn if self.usable[i, r]] + [r for r in turn if not self.usable[i, r]]

    def _answer(self, i, data, order, f):
        """(raw PredictResponse, None) from the first of shard i's replicas
        `order` that answers (`f`: the call in flight to order[0]), or (None,
        why none did)."""
        whys = []
        for j, r in enumerate(order):
            try:
                if j:
                    f = self._calls[i, r]["Lookup"].future(data, timeout=self.timeout_s)
                return f.result(), None
            except grpc.RpcError as e:
                whys.append(self._why((i, r), e))
                if len(order) > 1:   # a replica down or not at the version: the others take its Lookups
                    self.usable[i, r] = False
        return None, "; ".join(whys)

    def close(self):
        self._pool.shutdown(wait=False)
        for ch in self._channels.values():
            ch.close()
