"""The commit source (TF Serving's Source): which commits of the checkpoint root exist.

It scans the root (checkpoint/chain.py), remembers the newest committed
sequence number it saw, names the commits that follow a served one in chain
order and the root's newest chain, and tells a commit withdrawn by its
writer's retention from one that failed. It reads the root only.
"""
from checkpoint.chain import resolve_chain, scan, withdrawn
from checkpoint.shards import logical_entries

__all__ = ["CommitSource", "Withdrawn"]


class Withdrawn(Exception):
    """A checkpoint stopped being committed while it was staged."""


class CommitSource:
    """The commits of `storage` (a checkpoint.Storage)."""

    def __init__(self, storage):
        self.storage = storage
        self.newest_committed = None   # the newest committed sequence seen by the last scan

    def scan(self):
        """The root's committed checkpoints now (checkpoint.chain.Scan)."""
        sc = scan(self.storage)
        if sc.manifests:
            self.newest_committed = max(sc.manifests)
        return sc

    def retained(self):
        """Sequence numbers of the root's committed checkpoints, ascending."""
        return sorted(scan(self.storage).manifests)

    def newest_chain(self, sc, upto=None):
        """The chain (full first) of the newest commit, or of commit `upto`;
        raises CheckpointError when it cannot be resolved."""
        return resolve_chain(sc, upto=upto, where=self.storage.url)

    @staticmethod
    def children(sc):
        """{(base, parent seq): [deltas naming it]} of a scan."""
        out = {}
        for m in sc.manifests.values():
            if m.kind == "delta":
                out.setdefault((m.base, m.parent), []).append(m)
        return out

    @staticmethod
    def after(children, served, refused, limit=None):
        """The commits after `served` (a ServedVersion) in its chain, in order
        (at most `limit`), stopping before one in `refused` ((seq, checksum)s:
        it waits for a new full)."""
        out, seq, checksum = [], served.seq, served.checksum
        while limit is None or len(out) < limit:
            nxt = [m for m in children.get((served.base, seq), ())
                   if m.parent_checksum is None or m.parent_checksum == checksum]
            if not nxt:
                break
            m = max(nxt, key=lambda x: x.seq)   # a later branch from the same commit (train --from-seq) wins
            if (m.seq, m.checksum) in refused:
                break
            out.append(m)
            seq, checksum = m.seq, m.checksum
        return out

    @staticmethod
    def reachable(children, served, refused):
        """Sequence numbers of every commit that follows from `served` (a
        ServedVersion), on any branch, short of one in `refused` (a refused
        commit waits for a new full)."""
        reachable, todo = set(), [(served.seq, served.checksum)]
        while todo:
            seq, checksum = todo.pop()
            for m in children.get((served.base, seq), ()):
                if ((m.parent_checksum is None or m.parent_checksum == checksum) and m.seq not in reachable
                        and (m.seq, m.checksum) not in refused):
                    reachable.add(m.seq)
                    todo.append((m.seq, m.checksum))
        return reachable

    @staticmethod
    def is_committed(sc, served):
        """`served` (a ServedVersion) is still a committed checkpoint of the scan."""
        m = sc.manifests.get(served.seq)
        return m is not None and m.checksum == served.checksum

    def still_committed(self, ms, error):
        """After staging `ms` failed with `error`: raises Withdrawn when one of
        them is no longer committed (its manifest is gone: a writer removes the
        manifest before the files), else returns and the error counts."""
        try:
            gone = withdrawn(self.storage, ms)
        except OSError:
            return   # cannot tell: the staging error stands
        if gone:
            raise Withdrawn(", ".join(gone)) from error

    def nothing_to_serve(self, sc, wanted):
        """Why the root (scanned as `sc`) has nothing for an export serving the
        EVs `wanted`, or None."""
        where = f"checkpoint root {self.storage.url}"
        try:
            exists = self.storage.fs.isdir(self.storage.path)
        except OSError:
            exists = False
        if not exists and not sc.manifests:
            return f"{where} does not exist"
        if not sc.manifests:
            return f"{where} holds no committed checkpoint"
        want = set(wanted)
        held = set()
        for m in sc.manifests.values():
            held |= set(logical_entries(m))
        if want and not want & held:
            return (f"{where} holds none of the export's tables {sorted(want)} (its checkpoints hold "
                    f"{sorted(held)}): a checkpoint root of another model?")
        return None
