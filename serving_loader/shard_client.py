"""The front's client of its serving shards (serving_loader/shard_service.py).

`Fleet(["host:port", ...])`: shard i at the i-th address (each shard checks
it was started as i/N). `lookup(version, {EV: keys})` deduplicates each EV's
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
from serving_loader.shard_service import SERVICE
from serving_loader.tensor_proto import array_to_tensor, tensor_to_array
from serving_loader.tfs import ServingError

__all__ = ["Fleet", "ShardUnavailable"]

log = logging.getLogger("evstore.serving")


class ShardUnavailable(ConnectionError):
    """A shard did not answer, or cannot serve what was asked of it."""


def parse_addresses(text):
    """"host:port,host:port" -> [address]; ValueError when malformed."""
    out = [a.strip() for a in str(text).split(",") if a.strip()]
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a shard address is host:port, got {a!r}")
    if not out:
        raise ValueError("--shards lists no shard")
    return out


class Fleet:
    """Clients of the shards at `addresses` (shard i at addresses[i]).

    `timeout_s`: a Lookup's deadline; `stage_timeout_s`: a Stage's (it reads
    a commit; a full takes longer)."""

    def __init__(self, addresses, timeout_s=5.0, stage_timeout_s=600.0):
        self.addresses = list(addresses)
        self.count = len(self.addresses)
        self.timeout_s = timeout_s
        self.stage_timeout_s = stage_timeout_s
        self._channels = [grpc.insecure_channel(a, options=[("grpc.max_receive_message_length", -1),
                                                            ("grpc.max_send_message_length", -1)])
                          for a in self.addresses]
        self._calls = [{m: ch.unary_unary(f"/{SERVICE}/{m}") for m in ("Lookup", "Stage", "Publish", "Status")}
                       for ch in self._channels]
        self._pool = futures.ThreadPoolExecutor(max(2, self.count), thread_name_prefix="fleet")
        self.evs = None      # {EV: {"dim", "key_dtype"}} the shards serve (describe())

    def _name(self, i):
        return f"shard {i}/{self.count} at {self.addresses[i]}"

    def _why(self, i, e):
        if isinstance(e, grpc.RpcError) and e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                          grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"{self._name(i)} is unavailable ({e.code().name}: {e.details()})"
        if isinstance(e, grpc.RpcError):
            return f"{self._name(i)}: {e.code().name}: {e.details()}"
        return f"{self._name(i)}: {e}"

    # -- control
    def _control(self, method, body, timeout):
        """[(status dict or None, error message or None)] of every shard."""
        data = json.dumps(body).encode()
        fs = [self._pool.submit(c[method], data, timeout=timeout) for c in self._calls]
        out = []
        for i, f in enumerate(fs):
            try:
                out.append((json.loads(f.result()), None))
            except Exception as e:  # noqa: BLE001 - reported per shard
                out.append((None, self._why(i, e)))
        return out

    def status(self):
        return self._control("Status", {}, self.timeout_s)

    def describe(self, wait_s=60.0):
        """Waits (up to `wait_s`) until every shard answers, checks they are
        shards 0..N-1 of N serving the same EVs, and returns those EVs.
        Raises ValueError for a misconfigured fleet, ShardUnavailable when a
        shard does not answer in time."""
        deadline = time.monotonic() + wait_s
        while True:
            answers = self.status()
            errors = [e for _, e in answers if e]
            if not errors:
                break
            if time.monotonic() >= deadline:
                raise ShardUnavailable("; ".join(errors))
            time.sleep(0.2)
        evs = None
        for i, (st, _) in enumerate(answers):
            if st["index"] != i or st["count"] != self.count:
                raise ValueError(f"{self.addresses[i]} is shard {st['index']}/{st['count']}, listed as shard "
                                 f"{i}/{self.count}: --shards lists the shards in order")
            if evs is not None and st["evs"] != evs:
                raise ValueError(f"{self._name(i)} serves EVs {st['evs']}, shard 0 serves {evs}")
            evs = st["evs"]
        self.evs = evs
        return evs

    def stage(self, target, fleet):
        """Every shard stages `target` (the fleet serves `fleet`). Raises
        ShardUnavailable naming every shard that could not."""
        errors = [e for _, e in self._control("Stage", {"target": target, "fleet": fleet}, self.stage_timeout_s)
                  if e]
        if errors:
            raise ShardUnavailable(f"not every shard could stage commit {target}, the fleet holds "
                                   f"{fleet}: " + "; ".join(errors))

    def publish(self, target):
        """Every shard publishes `target`; a shard that misses it publishes it
        at the next stage or rejoin (logged here)."""
        for _, e in self._control("Publish", {"target": target}, self.timeout_s):
            if e:
                log.warning("publish of %s: %s (it publishes it when it next stages)", target, e)

    def rejoin(self, version):
        """Shards that serve another version than the fleet's `version` (a
        restarted one serves nothing) stage and publish it. Returns [(shard
        index, message)] of shards that could not (their rows answer nothing
        until then)."""
        problems = []
        for i, (st, e) in enumerate(self.status()):
            if e:
                problems.append((i, e))
                continue
            if st["version"] == version:
                continue
            try:
                self._calls[i]["Stage"](json.dumps({"target": version, "fleet": version}).encode(),
                                        timeout=self.stage_timeout_s)
                log.info("%s rejoined the fleet at version %s", self._name(i), version)
            except grpc.RpcError as e2:
                problems.append((i, self._why(i, e2)))
        return problems

    # -- reads
    def lookup(self, version, keys):
        """{EV: (distinct keys, float32 rows [n, dim])} of `keys` ({EV: 1-D
        array}) at `version`, one Lookup per shard holding any of them.
        Raises ShardUnavailable naming the shards that did not answer it."""
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
                calls.append((i, self._calls[i]["Lookup"].future(req.SerializeToString(), timeout=self.timeout_s)))
        out = {name: (uniq, np.empty([len(uniq), self.evs[name]["dim"]], np.float32))
               for name, (uniq, _) in routed.items()}
        errors = []
        for i, f in calls:
            try:
                resp = predict_pb2.PredictResponse.FromString(f.result())
            except grpc.RpcError as e:
                errors.append(self._why(i, e))
                continue
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

    def close(self):
        self._pool.shutdown(wait=False)
        for ch in self._channels:
            ch.close()
