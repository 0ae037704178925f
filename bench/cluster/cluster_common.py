"""Processes and counters of bench/cluster/bench_cluster.py (stdlib + numpy only: imported in both venvs).

* `LoopbackServers`: the PS and worker tasks of one loopback cluster, each a
  separate process (`python -m evstore_app server` for evstore, `cluster_server.py`
  for TFRA; its own process group, killed on exit and when the chief dies),
  logging gRPC client calls (`TF_CPP_VMODULE=grpc_state=2`: TensorFlow's
  RPCState logs "Starting call: <method>" for every unary RPC a process issues).
* `tcp_bytes`: per-connection payload byte counters of the kernel (`ss -tinpH`:
  bytes_sent / bytes_received of each TCP socket, owner pid), summed per pair of
  roles (worker->ps, chief->worker, ...). Loopback connections show both ends,
  so every byte is attributed from the side of its owner role.
* `rpc_counts`: the "Starting call" lines each log gained since an offset.
* `analytic_bytes`: the least bytes a step must move between workers and PS.
"""
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd

_CALL = re.compile(rb"Starting call: (\S+)")


def _die_with_parent():
    """preexec_fn of the servers: SIGKILL when the chief that started them dies (Linux
    PR_SET_PDEATHSIG), so a killed or timed-out chief leaves no server behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (bound then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cluster_spec(num_ps, num_workers):
    """{"chief": [addr], "ps": [...], "worker": [...]} on fresh loopback ports."""
    ports = free_ports(1 + num_ps + num_workers)
    addr = [f"localhost:{p}" for p in ports]
    return {"chief": addr[:1], "ps": addr[1:1 + num_ps], "worker": addr[1 + num_ps:]}


def server_command(python, system, job, task, spec_file, threads=0):
    """(argv, ready-line prefix) of one PS / worker task: evstore's own launcher
    (`python -m evstore_app server`, which loads the op library) for evstore, the
    bench's cluster_server.py (which imports TFRA's kernels) for TFRA."""
    if system == "evstore":
        return ([python, "-m", "evstore_app", "server", "--job", job, "--task", str(task), "--cluster", spec_file,
                 "--exit-with-parent"], b"evstore server: ready")
    return (module_cmd("bench.cluster.cluster_server", python=python) + ["--system", system, "--job", job, "--task", str(task),
             "--cluster", spec_file, "--threads", str(threads)], b"ready")


class LoopbackServers:
    """Starts every ps and worker task of `spec` as a process of `python` (the venv
    of `system`; see server_command); a context manager that kills them all on exit.

    `roles` maps pid -> "ps0" / "worker1" / ...; `logs` maps the same names to log paths."""

    def __init__(self, python, system, spec, logdir, tag, threads=0, timeout=120):
        self.procs, self.roles, self.logs = [], {}, {}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="grpc_state=2",
                   PYTHONUNBUFFERED="1")
        spec_file = os.path.join(logdir, f"cluster_{tag}.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        ready = {}
        try:
            for job in ("ps", "worker"):
                for task in range(len(spec.get(job, []))):
                    name = f"{job}{task}"
                    argv, ready_prefix = server_command(python, system, job, task, spec_file, threads)
                    self.logs[name] = os.path.join(logdir, f"cluster_{tag}_{name}.log")
                    with open(self.logs[name], "wb") as log:
                        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                             cwd=ROOT, start_new_session=True,
                                             preexec_fn=_die_with_parent)
                    self.procs.append(p)
                    self.roles[p.pid] = name
                    ready[p.pid] = ready_prefix
            deadline = time.time() + timeout
            for p in self.procs:
                line = b""
                while not line.startswith(ready[p.pid]):
                    if time.time() > deadline or p.poll() is not None:
                        raise RuntimeError(f"server {self.roles[p.pid]} did not start; see "
                                           f"{self.logs[self.roles[p.pid]]}")
                    line = p.stdout.readline()
        except BaseException:
            self.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def log_offsets(self):
        return {n: os.path.getsize(path) for n, path in self.logs.items()}


def _kind(role):
    return role.rstrip("0123456789")


def tcp_bytes(roles):
    """{"worker->ps": [sent, received], ...}: TCP payload bytes of every established
    loopback socket owned by a pid in `roles` (pid -> role name), keyed by
    owner kind -> peer kind; sent = bytes_sent, received = bytes_received."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    socks, cur = [], None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            f = line.split()
            pid = re.search(r"pid=(\d+)", line)
            cur = {"local": f[2], "peer": f[3], "pid": int(pid.group(1)) if pid else None}
            socks.append(cur)
        elif cur is not None:
            for k in ("bytes_sent", "bytes_received"):
                m = re.search(k + r":(\d+)", line)
                cur[k] = int(m.group(1)) if m else 0
    owner = {s["local"]: s["pid"] for s in socks}
    tot = collections.defaultdict(lambda: [0, 0])
    for s in socks:
        me, peer = roles.get(s["pid"]), roles.get(owner.get(s["peer"]))
        if me and peer:
            t = tot[f"{_kind(me)}->{_kind(peer)}"]
            t[0] += s.get("bytes_sent", 0)
            t[1] += s.get("bytes_received", 0)
    return dict(tot)


def cpu_seconds(roles):
    """{role kind: CPU seconds (user + system) so far} of the pids in `roles` (/proc/<pid>/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = collections.defaultdict(float)
    for pid, role in roles.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[_kind(role)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def bytes_delta(before, after):
    return {k: [a - b for a, b in zip(after[k], before.get(k, [0, 0]))] for k in after}


def rpc_counts(logs, offsets):
    """{role kind: {method: calls}} issued since `offsets` (from LoopbackServers.log_offsets)."""
    out = collections.defaultdict(collections.Counter)
    for name, path in logs.items():
        with open(path, "rb") as f:
            f.seek(offsets.get(name, 0))
            for m in _CALL.finditer(f.read()):
                out[_kind(name)][m.group(1).decode().rsplit("/", 1)[-1]] += 1
    return {k: dict(v) for k, v in out.items()}


def analytic_bytes(ids, dim, dense_params):
    """Least payload bytes of one step of batch `ids` ([B, fields] int64, fields
    distinct across columns): for each field table its unique ids go to the PS
    once (8 B each), their rows come back (dim x 4 B) and their row gradients go
    to the PS (dim x 4 B; the PS still holds the ids of the lookup, so keys need
    not travel again); the wide table (dim 1) likewise over all ids of the batch;
    the dense parameters are read (4 B each) and their gradients sent."""
    uniq = [len(np.unique(ids[:, f])) for f in range(ids.shape[1])]
    u_all = len(np.unique(ids))
    emb = min_embedding_bytes(sum(uniq), u_all, dim)
    return {"unique_ids_per_field_sum": int(sum(uniq)), "unique_ids_all": int(u_all), "unique_per_field": uniq,
            "embedding_bytes": int(emb), "dense_bytes": int(2 * 4 * dense_params),
            "total_bytes": int(emb + 2 * 4 * dense_params)}


def min_embedding_bytes(unique_field_ids, unique_wide_ids, dim):
    """analytic_bytes' embedding part: ids once, rows back, row gradients out."""
    return unique_field_ids * (8 + 2 * 4 * dim) + unique_wide_ids * (8 + 2 * 4)


def ss_available():
    try:
        return subprocess.run(["ss", "-V"], capture_output=True).returncode == 0
    except OSError:
        return False


def emit(res):
    """The JSON line the orchestrator reads (last stdout line starting with "{")."""
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
