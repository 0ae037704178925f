"""`perf record -g` of this process, switched on only around the blocks to profile (Linux
perf's control FIFO), so that a profile holds a benchmark's timed windows and not its setup:

    rec = PerfRecord("out.data")
    rec.on(); ...timed block...; rec.off()
    rec.close()   # perf writes out.data; `perf report -i out.data`
"""
import os
import shutil
import subprocess
import tempfile


class PerfRecord:
    """`perf record -g` of this process, enabled only inside `on()` blocks (a control FIFO)."""

    def __init__(self, out):
        self.dir = tempfile.mkdtemp(prefix="perf-ctl-")
        self.ctl, self.ack = os.path.join(self.dir, "ctl"), os.path.join(self.dir, "ack")
        os.mkfifo(self.ctl)
        os.mkfifo(self.ack)
        self.proc = subprocess.Popen(["perf", "record", "-g", "-D", "-1", "--control", f"fifo:{self.ctl},{self.ack}",
                                      "-o", out, "-p", str(os.getpid())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ctl_f = open(self.ctl, "w")
        self.ack_f = open(self.ack, "r")

    def _cmd(self, c):
        self.ctl_f.write(c + "\n")
        self.ctl_f.flush()
        self.ack_f.readline()

    def on(self):
        self._cmd("enable")

    def off(self):
        self._cmd("disable")

    def close(self):
        self.ctl_f.close()
        self.ack_f.close()
        self.proc.send_signal(2)
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
