"""Resident memory of this process (Linux; pure Python, usable in any venv): the
one place the benchmarks read it.

    rss_mib()               # VmRSS now
    hwm_mib()               # VmHWM: the peak so far
    mem_available_mib()     # MemAvailable of the machine

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
import threading


def malloc_trim():
    """Returns freed heap memory to the OS, so reuse of it does not hide a block's needs."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def status_kib(field, pid="self"):
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM, ...) of this process or of `pid`; 0 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mib(pid="self"):
    """Resident set size of this process (or of `pid`) in MiB (VmRSS)."""
    return status_kib("VmRSS", pid) / 1024


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
