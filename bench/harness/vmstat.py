"""The kernel's memory-management counters (/proc/vmstat, Linux; pure Python): what a
timed block cost the machine's memory manager, so that a run slowed by the kernel
(direct compaction, reclaim, dirty-page write-back) shows as such beside its CPU figures.

    v0 = vmstat()
    ...timed block...
    delta = vmstat_delta(v0)   # {"compact_stall": ..., "pgscan_direct": ..., "nr_dirty_start": ...}

Counters are machine-wide (every process's), so read them beside the block's own CPU
split (user / system): a block whose system time rose while compact_stall or
pgscan_direct climbed paid the kernel's memory work itself. Absent counters read 0.
"""

# Event counters: their increase over the block.
EVENTS = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback", "pgscan_direct", "pgscan_kswapd",
          "pgsteal_direct", "pgsteal_kswapd", "pgmajfault", "workingset_refault_file", "allocstall_normal")
# Gauges (pages): their values at the start and the end of the block.
GAUGES = ("nr_dirty", "nr_writeback", "nr_free_pages", "nr_file_pages")


def vmstat():
    """/proc/vmstat as a dict of ints ({} where it cannot be read)."""
    try:
        with open("/proc/vmstat") as f:
            return {k: int(v) for k, v in (line.split() for line in f)}
    except OSError:
        return {}


def vmstat_delta(start):
    """The events' increase since `start` (a vmstat() dict) and the gauges at start and now."""
    now = vmstat()
    out = {k: now.get(k, 0) - start.get(k, 0) for k in EVENTS}
    for k in GAUGES:
        out[k + "_start"], out[k + "_end"] = start.get(k, 0), now.get(k, 0)
    return out
