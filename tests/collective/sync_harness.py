"""Runs scripts as MultiWorkerMirroredStrategy worker processes on loopback
ports (bounded in time, process groups always cleaned up)."""
import os
import signal
import subprocess
import sys

from evstore_app.cluster import _free_ports, _tail as tail  # noqa: F401  (tail: for the tests)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def env():
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), TF_CPP_MIN_LOG_LEVEL="2")
    e.pop("TF_CONFIG", None)
    return e


def start(argv, log_path):
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable] + [str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env(), start_new_session=True)


def wait_all(procs, logs, timeout=240):
    """Waits for every process; kills all of them on timeout. Returns the exit codes."""
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        raise AssertionError("timed out:\n" + "\n".join(f"--- {lg}\n{tail(lg)}" for lg in logs))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def ports(n):
    """n distinct free loopback ports, "p1,p2,..."."""
    return ",".join(str(p) for p in _free_ports(n))
