"""The walk of a commit through serving (docs/ARCHITECTURE.md, "Serving"):
source -> stage -> policy -> publish.

Each poll asks the commit source (source.py) what is committed, the policy
(policy.py) what of it to serve (pin, quality gate, refusals), the stager
(stager.py) to read and check it, and the publisher (publisher.py) to make it
the served state; the metrics (apply_metrics.py) count the outcome. It
follows the served chain commit by commit, reloads from the newest chain when
the served one was withdrawn or replaced, counts a checkpoint that cannot be
served once and keeps the last good state; `start` / `stop` poll in the
background (apscheduler). A rollback (rollback.py) is a walk to a chosen
commit."""
import logging
import threading
import time

import tensorflow as tf

from checkpoint.chain import WITHDRAWN_RESCANS
from checkpoint.errors import CheckpointError
from serving_loader.source import Withdrawn
from serving_loader.streamed_reload import load_streamed, staged_into_replacements

__all__ = ["CommitWalk", "STAGE_ERRORS"]

log = logging.getLogger("evstore.serving")

# What staging a commit can raise for a commit that cannot be served (the served state stays).
STAGE_ERRORS = (CheckpointError, OSError, tf.errors.OpError, ValueError)


def _log_applied(staged, apply_s, lag_s):
    """One INFO line per commit applied on top of the served one: its seq and
    kind, the apply time (stage + publish of its run), the rows it upserted and
    deleted, and how long after its commit it was served."""
    m = staged.manifest
    upserted = sum(int(keys.size) for _, keys, *_ in staged.evs.values())
    deleted = sum(int(erase.size) for erase, *_ in staged.evs.values())
    log.info("applied %s %d (chain of full %d) in %.3f s: %s rows upserted, %s deleted; served %.1f s after its "
             "commit", m.kind, m.seq, m.base, apply_s, f"{upserted:,}", f"{deleted:,}", lag_s)


# How a reload replaces the served state (CommitWalk.reload).
REPLACE = "replace"            # stock tables: staged in memory, the tables rewritten in place
STREAM = "stream"              # evstore tables: the full streamed into replacement tables (streamed_reload.py)
REPLACEMENTS = "replacements"  # evstore tables whose rows fit in memory: staged, then into replacements


class CommitWalk:
    """Drives commits of `source` through `stager`, `policy` and `publisher`,
    reporting to `metrics`. `reload`: how a reload replaces the served state
    (REPLACE, STREAM or REPLACEMENTS). `fleet`: None for one replica; for a
    sharded fleet's front, its shards (serving_loader/shard_client.py's Fleet:
    `stage(seq, served_seq)` before each publish, raising OSError when one
    cannot, which holds the fleet's version; `publish(seq)` after it)."""

    def __init__(self, source, stager, policy, publisher, metrics, reload=REPLACE, fleet=None):
        self.source, self.stager, self.policy = source, stager, policy
        self.publisher, self.metrics = publisher, metrics
        self.reload, self.fleet = reload, fleet
        self.lock = threading.Lock()   # one walk at a time: polls, pin, resume, rollback
        self._sched = None

    def poll(self):
        """Applies every checkpoint committed since the served one; returns the served seq."""
        if self.source is None:
            return self.publisher.served.seq
        with self.lock:
            # A checkpoint the writer's retention withdraws while this server
            # stages it is not a failure: scan again and serve what is committed.
            for _ in range(WITHDRAWN_RESCANS):
                sc = self.source.scan()
                if not sc.manifests:
                    break
                if self.policy.pinned:
                    break
                try:
                    served = self.publisher.served
                    if served.seq is not None and self.source.is_committed(sc, served):
                        self._follow_chain(sc)
                    self._maybe_reload(sc)
                except Withdrawn as e:
                    log.info("%s was withdrawn while this server staged it (retention of its writer); "
                             "scanning again", e)
                    continue
                break
            return self.publisher.served.seq

    def _follow_chain(self, sc):
        children = self.source.children(sc)
        while True:
            served = self.publisher.served
            pending = self.source.after(children, served, self.policy.refused, limit=self.policy.stretch_limit())
            if not pending:
                self.policy.caught_up()
                return
            run, judged = self.policy.admit(served.seq, pending)
            if not run:
                return   # held or waiting: the gate's status says why
            t0 = time.time()
            staged = []
            for m in run:
                try:
                    staged.append(self.stager.stage(m))
                except STAGE_ERRORS as e:
                    self.source.still_committed([m], e)
                    self.refuse(m, f"cannot apply {m.dir}: {e}", retry=isinstance(e, OSError))
                    return
            self.publisher.warm(staged)
            try:
                self._fleet_stage(run[-1])
            except OSError as e:
                self.refuse(run[-1], f"cannot apply {run[-1].dir}: {e}", retry=True)
                return
            self.publisher.publish(staged)   # a held stretch is published with the commit that passed, in one step
            self._fleet_published(run[-1].seq)
            self._published(staged)
            for m in run:
                self.metrics.record(m, t0)
            for s in staged:
                _log_applied(s, self.metrics.last_apply_s, self.metrics.last_lag_s)
            self.policy.serving(run[-1].seq, judged)

    def _maybe_reload(self, sc):
        try:
            chain = self.source.newest_chain(sc)
        except CheckpointError as e:
            served = self.publisher.served.seq
            if served is None or max(sc.manifests) > served:
                self.refuse(None, f"newest chain cannot be served: {e}", key=("chain", str(e)))
            return
        served = self.publisher.served
        if any((m.seq, m.checksum) == (served.seq, served.checksum) for m in chain):
            return  # the served checkpoint is in the newest chain: _follow_chain applies the rest
        if self.policy.is_refused(chain[-1]):
            return  # this chain was refused already: wait for a newer one
        end, judged = self.policy.reload_end(served.seq, chain, lambda: self._served_chain_intact(sc))
        chain = chain[:end]
        if not chain:
            return   # held on the served version: the gate's status says why
        if served.seq is not None:
            log.warning("served %s is not in the newest chain (%s..%s): it was withdrawn or the chain was "
                        "replaced; reloading", served.seq, chain[0].dir, chain[-1].dir)
        t0 = time.time()
        before = served.seq
        try:
            self.load_chain(chain)
        except STAGE_ERRORS as e:
            self.source.still_committed(chain, e)
            self.refuse(chain[-1], f"cannot reload from {chain[0].dir}: {e}", retry=isinstance(e, OSError))
            return
        self.policy.reloaded(chain[-1].seq, judged)
        for m in chain:   # every checkpoint this reload newly serves counts as applied
            if before is None or m.seq > before or m.seq == chain[-1].seq:
                self.metrics.record(m, t0)
        log.info("serving %d: loaded the chain of full %d (%d checkpoint%s) in %.3f s: %s rows served", chain[-1].seq,
                 chain[0].seq, len(chain), "" if len(chain) == 1 else "s", time.time() - t0,
                 f"{sum(self.publisher.rows().values()):,}")

    def load_chain(self, chain):
        """Stages every checkpoint of `chain` (raising before any change if one
        fails), then replaces the served state with it in one step (`reload`:
        how; a fleet's shards stage it first and publish after)."""
        if self.reload == STREAM:
            staged = load_streamed(self.stager, self.publisher, chain, lambda: self._fleet_stage(chain[-1]))
        else:
            staged = [self.stager.stage(m) for m in chain]
            if self.reload == REPLACEMENTS:
                fresh = staged_into_replacements(self.publisher.tables, staged)
                try:
                    self._fleet_stage(chain[-1])
                    self.publisher.adopt(fresh, staged)
                finally:
                    for t in fresh.values():
                        t.close()
            else:
                self._fleet_stage(chain[-1])
                self.publisher.replace(staged)
        self._fleet_published(chain[-1].seq)
        self._published(staged)

    def _fleet_stage(self, m):
        if self.fleet is not None:
            self.fleet.stage(m.seq, self.publisher.served.seq)

    def _fleet_published(self, seq):
        if self.fleet is not None:
            self.fleet.publish(seq)

    def _published(self, staged):
        for s in staged:
            self.metrics.fetched(s.bytes_read)
            self.policy.published(s.manifest.quality)

    def _served_chain_intact(self, sc):
        """The served commit is still committed (or its whole chain was removed
        by the writer's retention: it was committed) and every later commit of
        its chain follows from it."""
        served = self.publisher.served
        if not self.source.is_committed(sc, served):
            fulls = [q for q, m in sc.manifests.items() if m.kind == "full"]
            return bool(fulls) and served.base < min(fulls)
        reachable = self.source.reachable(self.source.children(sc), served, self.policy.refused)
        return all(q in reachable for q, m in sc.manifests.items() if m.base == served.base and q > served.seq)

    def refuse(self, m, msg, key=None, retry=False):
        """A checkpoint (or chain) that cannot be served: counted once; not
        retried unless the cause may pass (`retry`: an I/O error)."""
        new = self.policy.refuse(key or (m.seq, m.checksum), retry=retry)
        if new is None:
            return
        if new:
            self.metrics.fail(msg, self.publisher.served.seq)
        else:
            self.metrics.last_error = msg

    def start(self, every_s=1.0):
        """Polls the checkpoint root every `every_s` seconds (apscheduler)."""
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0:
            raise ValueError(f"every_s must be a positive number of seconds, got {every_s!r}")
        if self.source is None:
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
            self.refuse(None, f"poll failed: {e!r}", key=("poll", repr(e)), retry=True)  # counted once

    def stop(self):
        if self._sched is not None:
            self._sched.shutdown(wait=True)
            self._sched = None
