"""Resident memory of this process (Linux; pure Python, usable in any venv): the
one place the benchmarks read it.

    rss_mib()               # VmRSS now
    rss_split_mib()         # (VmRSS, RssAnon, RssFile) now
    hwm_mib()               # VmHWM: the peak so far
    mem_available_mib()     # MemAvailable of the machine
    TreeUsage               # peak memory and disk of this process and its descendants (a `with` block)
    guard_available_memory  # stop a benchmark (and what it started) before the machine runs out of memory

Peak resident memory of a block of code:

    with PeakRss() as p:
        save()
    p.extra_mib   # high-water RSS during the block minus RSS when it started

Two measurements, the larger wins: the kernel's high-water mark VmHWM (reset at
the start by writing 5 to /proc/self/clear_refs, when the kernel allows it) and
a thread sampling VmRSS every `interval` seconds (misses spikes shorter than
that). Both count pages of this process only (not the page cache). Freed heap
memory is handed back first (malloc_trim), so a block cannot hide its needs in
memory an earlier step freed.
"""
import ctypes
import os
import stat
import threading
import time


def malloc_trim():
    """Returns freed heap memory to the OS, so reuse of it does not hide a block's needs."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _kib_field(path, field):
    """The kB value of the line `field:` of a /proc file laid out as /proc/<pid>/status is; 0 if absent."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def status_kib(field, pid="self"):
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM, ...) of this process or of `pid`; 0 if absent."""
    return _kib_field(f"/proc/{pid}/status", field)


def smaps_rollup_kib(field, pid="self"):
    """A kB field of /proc/<pid>/smaps_rollup (AnonHugePages: anonymous memory on huge pages;
    FilePmdMapped: file pages mapped 2 MiB at a time); 0 if absent or unreadable."""
    try:
        return _kib_field(f"/proc/{pid}/smaps_rollup", field)
    except OSError:
        return 0


def rss_mib(pid="self"):
    """Resident set size of this process (or of `pid`) in MiB (VmRSS)."""
    return status_kib("VmRSS", pid) / 1024


def rss_split_mib(pid="self"):
    """(VmRSS, RssAnon, RssFile) of this process (or of `pid`) in MiB, from one read of its status:
    anonymous memory (heap, tables) apart from mapped files' pages (libraries, a tier file's mapping)."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in ("VmRSS", "RssAnon", "RssFile"):
                got[name] = int(line.split()[1]) / 1024
    return got.get("VmRSS", 0.0), got.get("RssAnon", 0.0), got.get("RssFile", 0.0)


def hwm_mib():
    """Peak resident set size of this process so far in MiB (VmHWM)."""
    return status_kib("VmHWM") / 1024


def mem_available_mib():
    """MemAvailable from /proc/meminfo in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


class PeakRss:
    def __init__(self, interval=0.002):
        self.interval = interval
        self.start_mib = self.end_mib = self.peak_mib = self.hwm_mib = self.sampled_mib = 0.0
        self.hwm_reset = False

    def __enter__(self):
        malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.start_mib = rss_mib()
        self.sampled_mib = self.start_mib
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.sampled_mib = max(self.sampled_mib, rss_mib())
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.end_mib = rss_mib()
        self.sampled_mib = max(self.sampled_mib, self.end_mib)
        self.hwm_mib = status_kib("VmHWM") / 1024 if self.hwm_reset else 0.0
        self.peak_mib = max(self.sampled_mib, self.hwm_mib)
        return False

    @property
    def extra_mib(self):
        """Peak above the RSS at the start."""
        return self.peak_mib - self.start_mib

    @property
    def transient_mib(self):
        """Peak above the larger of the start and end RSS (what a block needs beyond what it keeps)."""
        return self.peak_mib - max(self.start_mib, self.end_mib)

    def as_dict(self):
        return {"extra_mib": self.extra_mib, "transient_mib": self.transient_mib, "start_mib": self.start_mib,
                "end_mib": self.end_mib, "peak_mib": self.peak_mib,
                "sampled_peak_mib": self.sampled_mib, "hwm_mib": self.hwm_mib, "hwm_reset": self.hwm_reset}


def descendants(pid):
    """Process ids of every descendant of `pid` (Linux /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _open_file_bytes(pid):
    """Bytes of the regular files process `pid` holds open (a server's spooled, already unlinked objects)."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def _tree_bytes(path):
    total = 0
    for d, _, files in os.walk(path):
        for n in files:
            try:
                total += os.lstat(os.path.join(d, n)).st_size
            except OSError:
                pass
    return total


class TreeUsage:
    """Memory and disk of this process and all its descendants while the `with` block runs.

        with TreeUsage(label=fn, disk_dirs=[work], open_files_of=lambda cmd: "moto.server" in cmd) as u:
            ...
        u.as_dict()   # {"rss_sum_peak_mib", "rss_peak_mib": {label: VmHWM}, "disk_peak_mib"}

    rss_sum_peak_mib: the largest sum of VmRSS over the tree, sampled every `interval` s (misses spikes
    shorter than that); rss_peak_mib: each label's largest VmHWM (the kernel's exact peak of one
    process; the largest instance of a label). disk_peak_mib: the largest sum of the files under
    `disk_dirs` plus the regular files that processes whose command line `open_files_of` accepts hold
    open (moto's spooled objects are unlinked temp files), sampled every `disk_interval` s.
    """

    def __init__(self, label=lambda cmdline: cmdline[:60], disk_dirs=(), open_files_of=lambda cmdline: False,
                 interval=0.2, disk_interval=1.0):
        self.label, self.disk_dirs, self.open_files_of = label, list(disk_dirs), open_files_of
        self.interval, self.disk_interval = interval, disk_interval
        self.sum_peak = self.disk_peak = 0.0
        self.hwm = {}
        self._names = {}

    def _sample(self):
        last_disk = 0.0
        while not self._stop.is_set():
            pids = [os.getpid()] + descendants(os.getpid())
            total = 0.0
            for p in pids:
                if p not in self._names:
                    self._names[p] = self.label(_cmdline(p)) if p != os.getpid() else "this process"
                try:
                    total += status_kib("VmRSS", p) / 1024
                    name = self._names[p]
                    if name:
                        self.hwm[name] = max(self.hwm.get(name, 0.0), status_kib("VmHWM", p) / 1024)
                except OSError:
                    pass
            self.sum_peak = max(self.sum_peak, total)
            now = time.monotonic()
            if now - last_disk >= self.disk_interval:
                last_disk = now
                disk = sum(_tree_bytes(d) for d in self.disk_dirs)
                disk += sum(_open_file_bytes(p) for p in pids if self.open_files_of(_cmdline(p)))
                self.disk_peak = max(self.disk_peak, disk / 2**20)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        return False

    def as_dict(self):
        return {"rss_sum_peak_mib": round(self.sum_peak), "disk_peak_mib": round(self.disk_peak),
                "rss_peak_mib": {k: round(v) for k, v in sorted(self.hwm.items())}}


def guard_available_memory(min_mib, interval=0.5, on_low=None):
    """Starts a daemon thread that, once the machine's MemAvailable falls under `min_mib`, SIGKILLs every
    descendant of this process and exits it (status 3) after `on_low(available_mib)` (a clean-up): a benchmark at
    size stops itself before it pushes a shared machine into the OOM killer."""
    import signal
    import sys

    def watch():
        while True:
            avail = mem_available_mib()
            if avail < min_mib:
                print(f"MemAvailable {avail:.0f} MiB < {min_mib} MiB: stopping this benchmark", file=sys.stderr,
                      flush=True)
                for p in descendants(os.getpid()):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                if on_low is not None:
                    on_low(avail)
                os._exit(3)
            time.sleep(interval)

    threading.Thread(target=watch, daemon=True).start()
