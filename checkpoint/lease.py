"""One writer per root: a lease file, `<root>/WRITER.lease`.

A CheckpointManager takes the lease before its first save and holds it until
`close()` (or its process ends). The lease is a small JSON object:

    {"owner": "<random token>", "host": "pod-7", "pid": 4121,
     "acquired": 1795500000.1, "heartbeat": 1795500030.4, "timeout": 60.0}

* Taking it is an exclusive create (`open(path, "xb")`: O_CREAT|O_EXCL on a
  local disk, an exclusive create in fsspec's memory filesystem, a
  conditional put where the store has one): of two writers racing, exactly
  one creates it where the filesystem provides that primitive.
* A second writer finds it and is refused with LeaseHeldError naming the
  holder (host, pid, heartbeat age).
* The holder renews `heartbeat` every timeout/3 seconds from a daemon thread,
  and checks before every commit that the lease is still its own (a writer
  whose lease was taken over stops with LeaseLostError instead of writing).
* Stale: the heartbeat is older than `timeout`, or the holder is on this host
  and its pid is gone. A stale lease is taken over automatically; a fresh one
  only with `take_over=True` (the operator asserts the holder is gone). A
  takeover renames the old lease aside (atomic on a local disk; elsewhere a
  copy and delete) and creates a new one exclusively, so of two writers
  taking over at once one wins.
"""
import json
import logging
import os
import socket
import threading
import time
import uuid

from checkpoint.errors import CheckpointError

__all__ = ["Lease", "LeaseHeldError", "LeaseLostError", "LEASE_FILE", "process_lease"]

log = logging.getLogger("evstore.checkpoint")

LEASE_FILE = "WRITER.lease"


class LeaseHeldError(CheckpointError):
    """Another writer holds the root's lease."""


class LeaseLostError(CheckpointError):
    """This writer's lease was taken over: it must not write any more."""


class Lease:
    """The writer lease of a Storage root (see the module docstring)."""

    def __init__(self, storage, timeout=60.0, take_over=False):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"lease_timeout must be a positive number of seconds, got {timeout!r}")
        self.storage = storage
        self.timeout = float(timeout)
        self.take_over = take_over
        self.path = storage.join(LEASE_FILE)
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._thread = None

    def _record(self, acquired=None):
        now = time.time()
        return {"owner": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "acquired": acquired or now, "heartbeat": now, "timeout": self.timeout}

    def read(self):
        """The lease on the root ({} if none)."""
        try:
            # One whole-object read: open() then read() is a HEAD and a GET on S3, and s3fs fails
            # the GET (FileExpired) when the holder's heartbeat replaced the object in between.
            return json.loads(self.storage.fs.cat_file(self.path).decode() or "{}")
        except FileNotFoundError:
            return {}
        except ValueError:
            return {"owner": "?", "host": "?", "pid": -1, "heartbeat": 0}   # torn or foreign: stale

    def _create(self):
        """Exclusive create; False if a lease exists."""
        self.storage.makedirs(self.storage.path)
        data = json.dumps(self._record()).encode()
        try:
            with self.storage.fs.open(self.path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError):   # no exclusive create here: check, then put (not atomic)
            if self.storage.fs.exists(self.path):
                return False
            self.storage.fs.pipe_file(self.path, data)
        return True

    def describe(self, rec):
        age = time.time() - float(rec.get("heartbeat", 0))
        return (f"writer {rec.get('owner', '?')[:8]} on host {rec.get('host', '?')} pid {rec.get('pid', '?')} "
                f"(heartbeat {age:.0f} s ago)")

    def _stale(self, rec):
        if time.time() - float(rec.get("heartbeat", 0)) > float(rec.get("timeout", self.timeout)):
            return "its heartbeat is older than its timeout"
        if rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int) and rec["pid"] > 0:
            try:
                os.kill(rec["pid"], 0)
            except ProcessLookupError:
                return "its process is gone"
            except PermissionError:
                pass
        return None

    def acquire(self):
        """Takes the lease or raises LeaseHeldError naming the holder."""
        if self.held:
            return
        for _ in range(3):
            if self._create():
                break
            rec = self.read()
            if not rec:
                continue   # released meanwhile: try again
            if rec.get("owner") == self.token:
                break
            why = self._stale(rec) or ("take_over=True" if self.take_over else None)
            if why is None:
                raise LeaseHeldError(
                    f"{self.storage.url} is being written by {self.describe(rec)}: one writer per root. If that "
                    f"writer is gone, wait until its heartbeat is {rec.get('timeout', self.timeout):.0f} s old or "
                    "pass CheckpointManager(..., take_over=True)")
            log.warning("taking over the lease of %s from %s (%s)", self.storage.url, self.describe(rec), why)
            self._set_aside(rec)
        else:
            raise LeaseHeldError(f"{self.storage.url}: could not take the writer lease (contended)")
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="evstore-lease", daemon=True)
        self._thread.start()

    def _set_aside(self, rec):
        aside = self.storage.join(f"{LEASE_FILE}.taken-{self.token}")
        try:
            if self.storage.local:
                os.rename(self.path, aside)
            else:
                self.storage.fs.mv(self.path, aside)
        except FileNotFoundError:
            return   # another writer moved it first; our exclusive create decides
        try:
            with self.storage.fs.open(aside, "rb") as f:
                moved = json.loads(f.read().decode() or "{}")
        except (OSError, ValueError):
            moved = {}
        if moved and moved.get("owner") != rec.get("owner"):
            # We moved a lease someone else had just taken: put it back (if the place is still free).
            try:
                with self.storage.fs.open(self.path, "xb") as f:
                    f.write(json.dumps(moved).encode())
            except (FileExistsError, OSError, ValueError):
                pass
        try:
            self.storage.fs.rm_file(aside)
        except (FileNotFoundError, OSError):
            pass

    def check(self):
        """Raises LeaseLostError unless the root's lease is still this writer's."""
        if not self.held:
            return
        rec = self.read()
        if rec.get("owner") != self.token:
            self.held = False
            self._stop.set()
            who = self.describe(rec) if rec else "nobody (the lease file was removed)"
            raise LeaseLostError(f"this writer's lease on {self.storage.url} was taken over by {who}; it stops "
                                 "writing (one writer per root)")

    def renew(self):
        rec = self.read()
        if rec.get("owner") != self.token:
            return False
        new = self._record(acquired=rec.get("acquired"))
        data = json.dumps(new).encode()
        if self.storage.local:
            tmp = f"{self.path}.{self.token}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        else:
            self.storage.fs.pipe_file(self.path, data)
        return True

    def _beat(self):
        while not self._stop.wait(self.timeout / 3):
            try:
                if not self.renew():
                    log.error("the writer lease of %s was taken over; saves will fail", self.storage.url)
                    return
            except Exception:  # noqa: BLE001 - keep beating; a save's check() reports a real loss
                log.exception("renewing the writer lease of %s failed", self.storage.url)

    def release(self):
        """Stops the heartbeat and removes the lease if it is still this writer's."""
        self._stop.set()
        if not self.held:
            return
        self.held = False
        try:
            if self.read().get("owner") == self.token:
                self.storage.fs.rm_file(self.path)
        except Exception:  # noqa: BLE001 - best effort (at exit a remote filesystem may be gone, e.g.
            pass           # s3fs's client raises its own errors); an unreleased lease goes stale on its own


_LEASES = {}
_LEASES_LOCK = threading.Lock()


def process_lease(storage, timeout=60.0, take_over=False):
    """The lease of `storage`'s root for this process: CheckpointManagers of
    one process on one root share it (they are one writer to other processes)."""
    with _LEASES_LOCK:
        lease = _LEASES.get(storage.url)
        if lease is None or not lease.held:
            lease = Lease(storage, timeout=timeout, take_over=take_over)
            _LEASES[storage.url] = lease
        return lease


def _release_all():
    with _LEASES_LOCK:
        for lease in _LEASES.values():
            lease.release()
        _LEASES.clear()


import atexit  # noqa: E402

atexit.register(_release_all)
