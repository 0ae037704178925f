"""Following the checkpoint root (docs/ARCHITECTURE.md, "Serving"): each poll applies the commits
that follow the served one in chain order, reloads from the newest chain when
the served one was withdrawn or replaced, counts a checkpoint that cannot be
served once and keeps the last good state; `start` / `stop` poll in the
background (apscheduler)."""
import logging
import time

import tensorflow as tf

from checkpoint.chain import WITHDRAWN_RESCANS, resolve_chain, scan, withdrawn
from checkpoint.errors import CheckpointError

__all__ = ["Polling"]

log = logging.getLogger("evstore.serving")


class _Withdrawn(Exception):
    """A checkpoint stopped being committed while it was staged."""


def _children(sc):
    """{(base, parent seq): [deltas naming it]} of a scan."""
    out = {}
    for m in sc.manifests.values():
        if m.kind == "delta":
            out.setdefault((m.base, m.parent), []).append(m)
    return out


def _judged_alone(gate, quality):
    return quality if quality is not None and gate.judged(quality) else None


def _log_applied(staged, apply_s, lag_s):
    """One INFO line per commit applied on top of the served one: its seq and
    kind, the apply time (stage + publish of its run), the rows it upserted and
    deleted, and how long after its commit it was served."""
    m = staged.manifest
    upserted = sum(int(keys.size) for _, keys, *_ in staged.evs.values())
    deleted = sum(int(erase.size) for erase, *_ in staged.evs.values())
    log.info("applied %s %d (chain of full %d) in %.3f s: %s rows upserted, %s deleted; served %.1f s after its "
             "commit", m.kind, m.seq, m.base, apply_s, f"{upserted:,}", f"{deleted:,}", lag_s)


class Polling:
    """ServingModel's polling of its checkpoint root (a mixin: the state it reads and
    writes is ServingModel's, set up by its __init__)."""

    def poll(self):
        """Applies every checkpoint committed since the served one; returns `version`."""
        if self.storage is None:
            return self.version
        with self._poll_lock:
            # A checkpoint the writer's retention withdraws while this server
            # stages it is not a failure: scan again and serve what is committed.
            for _ in range(WITHDRAWN_RESCANS):
                sc = scan(self.storage)
                if not sc.manifests:
                    return self.version
                self.newest_committed = max(sc.manifests)
                if self.pinned:
                    return self.version
                try:
                    if self.version is not None and self._served_is_committed(sc):
                        self._follow_chain(sc)
                    self._maybe_reload(sc)
                except _Withdrawn as e:
                    log.info("%s was withdrawn while this server staged it (retention of its writer); "
                             "scanning again", e)
                    continue
                break
            return self.version

    def _still_committed(self, ms, error):
        """After staging `ms` failed with `error`: raises _Withdrawn when one
        of them is no longer committed (its manifest is gone: a writer removes
        the manifest before the files), else returns and the error counts."""
        try:
            gone = withdrawn(self.storage, ms)
        except OSError:
            return   # cannot tell: the staging error stands
        if gone:
            raise _Withdrawn(", ".join(gone)) from error

    def _served_is_committed(self, sc):
        m = sc.manifests.get(self.version)
        return m is not None and m.checksum == self._served_checksum

    def _follow_chain(self, sc):
        children = _children(sc)
        while True:
            # Without a gate, one commit at a time; with one, up to the first commit that passes it.
            pending = self._after_served(children, limit=None if self.gate else 1)
            if not pending:
                if self.gate is not None:
                    self.gate.clear()   # nothing newer in the served chain: nothing held back
                return
            run, judged = pending, None
            if self.gate is not None:
                run, judged = self.gate.select(self.version, pending)   # held until the run that passed is published
                if not run:
                    return   # held or waiting: the gate's status says why
            t0 = time.time()
            staged = []
            for m in run:
                try:
                    staged.append(self._stage(m))
                except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
                    self._still_committed([m], e)
                    self._refuse(m, f"cannot apply {m.dir}: {e}", retry=isinstance(e, OSError))
                    return
            for s in staged:
                self._warm(s)
            try:
                self._fleet_stage(run[-1])   # a sharded front: every shard stages it first (serving_loader/front.py)
            except OSError as e:
                self._refuse(run[-1], f"cannot apply {run[-1].dir}: {e}", retry=True)
                return
            self._lock.acquire_write()
            try:
                for s in staged:   # a held stretch is published with the commit that passed, in one step
                    self._publish(s)
            finally:
                self._lock.release_write()
            self._fleet_published(run[-1].seq)
            for m in run:
                self._record(m, t0)
            for st in staged:
                _log_applied(st, self.last_apply_s, self.last_lag_s)
            if self.gate is not None:
                self.gate.passed(judged, serving=run[-1].seq)

    def _after_served(self, children, limit=None):
        """The served chain's commits after the served one, in order (at most
        `limit`), stopping before one refused already (it waits for a new full)."""
        out, seq, checksum = [], self.version, self._served_checksum
        while limit is None or len(out) < limit:
            nxt = [m for m in children.get((self.base, seq), ())
                   if m.parent_checksum is None or m.parent_checksum == checksum]
            if not nxt:
                break
            m = max(nxt, key=lambda x: x.seq)   # a later branch from the same commit (train --from-seq) wins
            if (m.seq, m.checksum) in self._bad:
                break
            out.append(m)
            seq, checksum = m.seq, m.checksum
        return out

    def _maybe_reload(self, sc):
        try:
            chain = resolve_chain(sc, where=self.storage.url)
        except CheckpointError as e:
            if self.version is None or max(sc.manifests) > self.version:
                self._refuse(None, f"newest chain cannot be served: {e}", key=("chain", str(e)))
            return
        served = (self.version, self._served_checksum)
        if any((m.seq, m.checksum) == served for m in chain):
            return  # the served checkpoint is in the newest chain: _follow_chain applies the rest
        if (chain[-1].seq, chain[-1].checksum) in self._bad:
            return  # this chain was refused already: wait for a newer one
        judged = None
        if self.gate is not None:
            end, judged = self._gated_end(sc, chain)
            chain = chain[:end]
            if not chain:
                return   # held on the served version: the gate's status says why
        if self.version is not None:
            log.warning("served %s is not in the newest chain (%s..%s): it was withdrawn or the chain was "
                        "replaced; reloading", self.version, chain[0].dir, chain[-1].dir)
        t0 = time.time()
        before = self.version
        try:
            self._load_chain(chain)
        except (CheckpointError, OSError, tf.errors.OpError, ValueError) as e:
            self._still_committed(chain, e)
            self._refuse(chain[-1], f"cannot reload from {chain[0].dir}: {e}", retry=isinstance(e, OSError))
            return
        if self.gate is not None:
            self.gate.passed(judged, serving=chain[-1].seq, clear=False)
        for m in chain:   # every checkpoint this reload newly serves counts as applied
            if before is None or m.seq > before or m.seq == chain[-1].seq:
                self._record(m, t0)
        log.info("serving %d: loaded the chain of full %d (%d checkpoint%s) in %.3f s: %s rows served", chain[-1].seq,
                 chain[0].seq, len(chain), "" if len(chain) == 1 else "s", time.time() - t0,
                 f"{sum(self.rows().values()):,}")

    def _gated_end(self, sc, chain):
        """How much of the newest `chain` a gated reload serves, and the record
        that passed last: up to the last commit the gate admits. The full
        always loads when the served chain cannot go on (nothing served yet;
        the served commit withdrawn; a commit after it refused or missing): a
        full is never held back from repairing a broken chain. 0: hold the
        served version."""
        start, ref, holding = 0, self.gate.reference, self.gate.held is not None
        if self.version is None or not self._served_chain_intact(sc):
            start, ref, holding = 1, _judged_alone(self.gate.gate, chain[0].quality), False
        end, judged = start, None
        while end < len(chain):
            run, passed = self.gate.select(chain[end - 1].seq if end else self.version, chain[end:], reference=ref,
                                           holding=holding and end == 0, extend=holding and end == 0)
            if not run:
                break
            self.gate.clear(serving=run[-1].seq)   # what holds after `end` is the next select's
            end += len(run)
            judged = passed
            ref = passed or ref
        return end, judged

    def _served_chain_intact(self, sc):
        """The served commit is still committed (or its whole chain was removed
        by the writer's retention: it was committed) and every later commit of
        its chain follows from it."""
        if not self._served_is_committed(sc):
            fulls = [q for q, m in sc.manifests.items() if m.kind == "full"]
            return bool(fulls) and self.base < min(fulls)
        children, reachable, todo = _children(sc), set(), [(self.version, self._served_checksum)]
        while todo:   # every commit that follows from the served one, on any branch
            seq, checksum = todo.pop()
            for m in children.get((self.base, seq), ()):
                if ((m.parent_checksum is None or m.parent_checksum == checksum) and m.seq not in reachable
                        and (m.seq, m.checksum) not in self._bad):   # a refused commit waits for a new full
                    reachable.add(m.seq)
                    todo.append((m.seq, m.checksum))
        return all(q in reachable for q, m in sc.manifests.items() if m.base == self.base and q > self.version)

    def _refuse(self, m, msg, key=None, retry=False):
        """A checkpoint (or chain) that cannot be served: counted once; not
        retried unless the cause may pass (`retry`: an I/O error)."""
        key = key or (m.seq, m.checksum)
        if key in self._bad:
            return
        if not retry:
            self._bad[key] = msg
        if key in self._counted:
            self.last_error = msg
            return
        self._counted.add(key)
        self._fail(msg)

    def _fail(self, msg):
        self.failures += 1
        self.last_error = msg
        log.warning("%s (still serving %s)", msg, self.version)

    def start(self, every_s=1.0):
        """Polls the checkpoint root every `every_s` seconds (apscheduler)."""
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0:
            raise ValueError(f"every_s must be a positive number of seconds, got {every_s!r}")
        if self.storage is None:
            raise ValueError("no checkpoint_root to poll")
        if self._sched is not None:
            raise RuntimeError("already polling; stop() first")
        from checkpoint.schedule import background_scheduler
        self._sched = background_scheduler("serving")
        self._sched.add_job(self._poll_quietly, "interval", seconds=every_s, id="poll", max_instances=1,
                            coalesce=True)
        self._sched.start()

    def _poll_quietly(self):
        try:
            self.poll()
        except Exception as e:  # noqa: BLE001 - the poller must survive
            self._refuse(None, f"poll failed: {e!r}", key=("poll", repr(e)), retry=True)  # counted once

    def stop(self):
        if self._sched is not None:
            self._sched.shutdown(wait=True)
            self._sched = None
