"""A second table for an EmbeddingVariable, filled while nothing reads it and
then made the EV's in one swap, or dropped: a load that may fail half-way
(a restore streaming the checkpoint's tensors, each checked only once read)
leaves the EV as it was.

    staging = StagingTable(ev)      # empty, like ev's table, on ev's device
    try:
        ...load into staging...
    except BaseException:
        staging.close()             # ev untouched
        raise
    adopt(ev, staging)              # ev now holds the loaded table; the old one is dropped

The staging table is created as the EV's own was (dim, key dtype, segments,
admission filter, tiered storage with a private directory of its own, the
EV's initializer bank and default value) and declares the EV's optimizer
slots at their initial values, so after `adopt` the EV is what loading into
its cleared table would have made it. Memory: until `adopt`, both tables
(for a tiered EV, both DRAM caches, and both tier files on disk).

Disk: `check_room` refuses, before any staging table is made, loads whose
tiered staging tables cannot fit their tier files on their file systems'
free space. What it counts is a lower bound of what the loads write: each
row a load brings in that the staging table's DRAM budget cannot hold is
written once (a record of dim x (1 + slots) floats: evstore.storage.record_bytes),
so a refusal never stops a load that could fit. More is written than it
counts when later loads rewrite rows (a chain's deltas: dead records until
compaction, at most about as many as the live ones); such a load that runs
out of disk still fails as before, with ResourceExhaustedError, before any
table is adopted.
"""
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import gen_resource_variable_ops

from evstore._ops import gen
from evstore.storage import TierNeed, check_tier_room, record_bytes

__all__ = ["StagingTable", "adopt", "can_stage", "check_room", "place"]


def can_stage(ev):
    """Whether a staging table can be made for `ev` (an EV built eagerly: its bank is known)."""
    return getattr(ev, "_bank", None) is not None


def place(ev):
    """Where `ev`'s staging table lives, as a routed load (EvLoadBundleRouted) needs its targets
    together: (device, tiered or not)."""
    return ev.device, getattr(ev, "_storage", None) is not None


class StagingTable:
    """An empty table like `ev`'s on `ev`'s device (`resource_handle`, `key_dtype`, `dim`, `name`:
    what checkpoint.bundle.load_ev needs); `close()` drops it.

    Raises:
      RuntimeError: `ev` was built in a graph (can_stage is False).
    """

    def __init__(self, ev):
        if not can_stage(ev):
            raise RuntimeError(f"EmbeddingVariable '{ev.name}' was built in a graph: no staging table for it")
        self.name, self.key_dtype, self.dim = ev.name, ev.key_dtype, ev.dim
        with tf.device(ev.device or None):
            self.resource_handle = gen.ev_handle_op(shared_name=_context.anonymous_name(), key_dtype=ev.key_dtype)
            try:
                ev._create_table_at(self.resource_handle, ev._bank, ev._default_value)
                names, inits = gen.ev_slots(ev.resource_handle, key_dtype=ev.key_dtype)
                if int(tf.size(names)):   # reading no keys declares the slots at their initial values
                    gen.ev_read_rows(self.resource_handle, tf.constant([], ev.key_dtype), names, inits, dim=ev.dim)
            except BaseException:
                self.close()
                raise

    @property
    def device(self):
        return self.resource_handle.device

    def close(self):
        """Drops the table (and its tier directory); idempotent."""
        if self.resource_handle is not None:
            gen_resource_variable_ops.destroy_resource_op(self.resource_handle, ignore_lookup_error=True)
            self.resource_handle = None


def adopt(ev, staging):
    """Makes `staging`'s table `ev`'s (EvSwapTables: one pointer swap on ev's device) and drops the one
    it held. No other op may run on `ev` meanwhile (a restore holds its manager's lock)."""
    gen.ev_swap_tables(ev.resource_handle, staging.resource_handle, key_dtype=ev.key_dtype)
    staging.close()


def check_room(loads, what="this load"):
    """Refuses loads whose tiered staging tables' tier files cannot fit the free space of their file
    systems (the module docstring, "Disk"), before any table is made or any row read.

    Each EV's tier directory is measured on the task holding it (a parameter server's own disk).

    Args:
      loads: [(ev, rows, slots)]: an EV (not tiered: nothing to check), the rows a load into its
        staging table brings in at least, and the slot names they carry (besides the EV's own).
      what: the load, as the error names it.
    Raises:
      TierSpaceError: naming, per file system short of space, the bytes needed and free, each EV's
        rows x record bytes less its DRAM budget, and what its live table's tier file holds.
    """
    needs = []
    for ev, rows, slots in loads:
        storage = getattr(ev, "_storage", None)
        if storage is None or rows <= 0:
            continue
        names, _ = gen.ev_slots(ev.resource_handle, key_dtype=ev.key_dtype)
        record = record_bytes(ev.dim, len({n.decode() for n in names.numpy()} | set(slots)))
        needs.append(TierNeed(ev.name, storage.path, ev.device, rows, record, storage.dram_bytes,
                              lambda ev=ev: int(ev.stats()["disk_bytes"])))
    check_tier_room(needs, what)
