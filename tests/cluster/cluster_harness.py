"""Test helpers for multi-process cluster tests: run a chief script as a real
subprocess against a LocalCluster, answering its `ACTION` lines (kill /
restart a task) and collecting its `RESULT <json>` line; always bounded in
time and always cleaning up the chief's process group."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def cluster_logs(lc):
    """The tails of every task's log (for assertion messages)."""
    return "\n".join(f"--- {job}-{task}:\n{_tail(lc.log_path(job, task), 15)}"
                     for job in ("ps", "worker") for task in range(len(lc.spec[job])))


def run_chief(lc, script, args, timeout=180.0, log_path=None, actions=None, stop_on=None, lines_out=None):
    """Runs `python script args...` as the chief of `lc`; returns the parsed RESULT.

    `lc`: a LocalCluster, or a tests/host_cluster.HostCluster (the chief then
    runs on the cluster's chief host).

    `script` is a file in this directory, or a list (an argv prefix, e.g.
    `["-m", "evstore_app", "train-cluster"]`; then the RESULT is the last stdout
    line, parsed as JSON). `ACTION <verb> <job> <task>` lines are carried
    out as `lc.<verb>(job, task)` (kill, restart, or a method a test's own
    wrapper of `lc` adds) and answered with `ok`; `actions` (a list) records
    them. `stop_on`: a line on which the chief is SIGKILLed (returns None).
    `lines_out` (a list) receives every stdout line. Raises AssertionError
    with the chief's stderr tail when it times out, fails or prints no RESULT.
    """
    log_path = log_path or os.path.join(lc.directory, "chief.log")
    path = {"PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    env = dict(os.environ, **path, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    with open(log_path, "wb") as err:
        argv = list(script) if isinstance(script, (list, tuple)) else [os.path.join(HERE, script)]
        cmd = [sys.executable] + argv + [str(a) for a in args]
        if hasattr(lc, "start_chief"):   # tests/host_cluster.py: the chief on a host of its own
            proc = lc.start_chief(cmd, env=path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        else:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, start_new_session=True)
    lines = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    result = None
    timer = threading.Timer(timeout, lambda: _killpg(proc))
    timer.start()
    try:
        while True:
            line = lines.get()
            if line is None:
                break
            if lines_out is not None:
                lines_out.append(line)
            if stop_on is not None and line == stop_on:
                _killpg(proc)
                proc.wait()
                return None
            if line.startswith("ACTION "):
                _, verb, job, task = line.split()
                getattr(lc, verb)(job, int(task))
                if actions is not None:
                    actions.append((verb, job, int(task)))
                proc.stdin.write("ok\n")
                proc.stdin.flush()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            elif isinstance(script, (list, tuple)) and line.startswith("{"):
                result = json.loads(line)
        proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode != 0
        timer.cancel()
        _killpg(proc)
        proc.wait()
    if timed_out or proc.returncode != 0 or result is None:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
        raise AssertionError(f"chief {script} {why}, result {result}; stderr tail:\n{_tail(log_path)}\n"
                             f"{cluster_logs(lc)}")
    return result


def _killpg(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
