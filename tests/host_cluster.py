"""A parameter-server cluster with every task on a host of its own (tests/hosts.py).

`HostCluster` is evstore_app.cluster.LocalCluster's counterpart on a
`hosts.Network`: hosts `ps0`, `ps1`, ..., `worker0`, ... each run `evstore
server` for their task on port 2222 of their own address, and host `chief` is
where the chief runs (a test's chief script, `evstore train-cluster`). The
cluster file is in each host's private /tmp (`/tmp/cluster.json` there). It
has LocalCluster's methods for tests and cluster_harness.run_chief: `spec`,
`cluster_file`, `directory`, `log_path`, `kill`, `restart`, `alive`,
`process`, `close`, plus `restart_all` (every task at once), `start_chief` (run_chief's way to start the chief
on the chief's host) and `host(job, task)`.

    with hosts.network_or_skip(tmp_path) as net:
        store = net.object_store()
        with HostCluster(net, num_ps=2, num_workers=2) as hc:
            result = run_chief(hc, CHIEF, ["--cluster", hc.cluster_file, "--root", store.root("job")])
            net.assert_no_checkpoint_files()
"""
import json
import signal
import subprocess

from evstore_app.cluster import server_argv
from hosts import STARTUP_S

__all__ = ["HostCluster", "PORT"]

PORT = 2222
SERVER_JOBS = ("ps", "worker")


class HostCluster:
    """PS and worker tasks each on a host of `net`, a chief host for the caller's chief (module docstring).

    Args:
      net: a hosts.Network.
      num_ps, num_workers: task counts (>= 1).
      env: extra variables for every task (and the chief).
      timeout: seconds for the servers to come up.
      prefix: before every host's name (a second cluster on the same Network: "b-" gives "b-chief",
        "b-ps0", ...).
    Raises:
      ValueError: a count below 1.
      RuntimeError: a task exited or did not serve within `timeout` (with its log tail).
    """

    def __init__(self, net, num_ps=2, num_workers=2, env=None, timeout=STARTUP_S, prefix=""):
        for name, n in (("num_ps", num_ps), ("num_workers", num_workers)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        self.net = net
        self.env = dict(env or {})
        self.directory = net.workdir
        self._hosts = {("chief", 0): net.host(f"{prefix}chief")}
        for job, n in (("ps", num_ps), ("worker", num_workers)):
            for task in range(n):
                self._hosts[(job, task)] = net.host(f"{prefix}{job}{task}")
        self.spec = {job: [f"{h.address}:{PORT}" for (j, _), h in sorted(self._hosts.items()) if j == job]
                     for job in ("chief", "ps", "worker")}
        text = json.dumps(self.spec, indent=1)
        for h in self._hosts.values():
            self.cluster_file = h.put("cluster.json", text)   # the same path on every host
        self._procs = {}
        self._closed = False
        try:
            for job in SERVER_JOBS:
                for task in range(len(self.spec[job])):
                    self._spawn(job, task)
            for job in SERVER_JOBS:
                for task in range(len(self.spec[job])):
                    self._wait_ready(job, task, timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def chief(self):
        return self._hosts[("chief", 0)]

    def host(self, job, task):
        """The Host of one task ("chief", 0 included)."""
        return self._hosts[(job, task)]

    def process(self, job, task):
        """The hosts.Proc of one task's server (None if never started)."""
        return self._procs.get((job, task))

    def log_path(self, job, task):
        p = self._procs.get((job, task))
        return p.log_path if p is not None else self.host(job, task).log_path(f"{job}{task}")

    def _spawn(self, job, task):
        self._procs[(job, task)] = self.host(job, task).start(server_argv(job, task, self.cluster_file),
                                                              name=f"{job}{task}", env=self.env)

    def _wait_ready(self, job, task, timeout):
        p = self._procs[(job, task)]
        p.wait_line(lambda ln: ln.startswith("evstore server: ready"), timeout=timeout)
        self.host(job, task).wait_port(PORT, timeout=timeout, proc=p)

    def _check(self, job, task):
        if job not in SERVER_JOBS or not 0 <= task < len(self.spec[job]):
            raise ValueError(f"no server task {job} {task} in this cluster ({ {j: len(self.spec[j]) for j in SERVER_JOBS} })")

    def kill(self, job, task, sig=signal.SIGKILL):
        """Sends `sig` (default SIGKILL) to one task's server; for SIGKILL waits for it to die."""
        self._check(job, task)
        p = self._procs.get((job, task))
        if p is not None:
            p.kill(sig)

    def restart(self, job, task, timeout=STARTUP_S):
        """Kills one task (if alive) and starts it again on its host and address; returns once it serves."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        self.kill(job, task)
        self._spawn(job, task)
        self._wait_ready(job, task, timeout)

    def restart_all(self, timeout=STARTUP_S):
        """Kills every task's server (those alive) and starts them all again at once; returns once all serve
        (what an orchestrator does when a job has to start again whole)."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        tasks = [(job, task) for job in SERVER_JOBS for task in range(len(self.spec[job]))]
        for job, task in tasks:
            self.kill(job, task)
        for job, task in tasks:
            self._spawn(job, task)
        for job, task in tasks:
            self._wait_ready(job, task, timeout)

    def alive(self):
        """The (job, task) pairs whose server runs."""
        return [k for k, p in self._procs.items() if p.alive()]

    def start_chief(self, argv, env=None, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None):
        """`argv` (a full command) as a Popen on the chief's host (cluster_harness.run_chief's hook)."""
        return self.chief.popen(argv, env=dict(self.env, **(env or {})), stdin=stdin, stdout=stdout, stderr=stderr)

    def close(self):
        """SIGKILLs every task's server (the hosts stay until the Network closes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs.values():
            p.kill()
