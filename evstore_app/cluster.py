"""Parameter-server clusters for evstore: cluster specs, servers, a local harness.

In a TF parameter-server job `ps` tasks hold the variables (evstore's tables),
`worker` tasks run the functions the `chief` schedules (ParameterServerStrategy
+ ClusterCoordinator). Every PS and worker process must load evstore's op
library before its `tf.distribute.Server` starts: `start_server` (and
`evstore server`) do. `LocalCluster` runs PS and worker processes on loopback
ports (tests, local runs; the calling process is the chief).
"""
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

SERVER_JOBS = ("ps", "worker")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout evstore runs from


def server_argv(job, task, cluster_file, python=sys.executable):
    """The command of one task's `evstore server`, which exits when its parent does."""
    return [python, "-m", "evstore_app", "server", "--job", job, "--task", str(task), "--cluster", str(cluster_file),
            "--exit-with-parent"]


def server_env(extra=None, base=None):
    """The environment of a task process: `base` (default: this process's) without TF_CONFIG (the
    cluster file and --job/--task name the task), TensorFlow's C++ log at warnings unless `base`
    sets it, `extra` over that, and this checkout first on PYTHONPATH."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", **(os.environ if base is None else base), **(extra or {})}
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys((_ROOT, *env.get("PYTHONPATH", "").split(os.pathsep)))
                                        if p)
    return env


def spawn(argv, env, **popen_kwargs):
    """`argv` as a subprocess.Popen in a process group of its own (`kill_group` ends it with what it started)."""
    return subprocess.Popen(argv, env=env, start_new_session=True, **popen_kwargs)


def kill_group(popen, sig=signal.SIGKILL, wait=True, timeout=None):
    """Sends `sig` to the process group of `popen` (a `spawn`ed process) unless it has exited; for SIGKILL
    with `wait`, returns once it is gone."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL and wait:
        popen.wait(timeout=timeout)


def stop(popen, grace=10.0):
    """Ends `popen` gently: SIGTERM, up to `grace` seconds to exit, then SIGKILL; returns once it is gone."""
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def _validate(spec, source):
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"{source}: a cluster spec must be a non-empty JSON object mapping job names to lists "
                         f"of 'host:port' addresses, got {spec!r}")
    for job, addresses in spec.items():
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(f"{source}: job {job!r} must list at least one 'host:port' address, got {addresses!r}")
        for i, a in enumerate(addresses):
            host, sep, port = a.rpartition(":") if isinstance(a, str) else ("", "", "")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{source}: job {job!r} task {i}: address {a!r} is not 'host:port'")
    return {job: list(addresses) for job, addresses in spec.items()}


def _tf_config(missing):
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise ValueError(f"{missing} and the TF_CONFIG environment variable is not set")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("TF_CONFIG is not a JSON object")
    return config


def load_cluster(cluster=None):
    """Returns a cluster spec dict `{job: ["host:port", ...]}`.

    Args:
      cluster: a path to a JSON file holding the spec (either the spec itself or
        a `TF_CONFIG`-style object with a `cluster` field), a dict (the spec), or
        None: the `cluster` field of the `TF_CONFIG` environment variable.

    Raises:
      ValueError: the file is missing or not JSON, `TF_CONFIG` is unset, not JSON
        or has no `cluster` field, or the spec is malformed (the message names
        the file or field).
      TypeError: `cluster` is none of the above.
    """
    if cluster is None:
        config = _tf_config("no cluster given")
        if "cluster" not in config:
            raise ValueError("TF_CONFIG has no 'cluster' field")
        return _validate(config["cluster"], "TF_CONFIG['cluster']")
    if isinstance(cluster, dict):
        return _validate(cluster, "cluster")
    if isinstance(cluster, (str, os.PathLike)):
        path = os.fspath(cluster)
        try:
            with open(path) as f:
                spec = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"cluster file {path!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cluster file {path!r} cannot be read: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"cluster file {path!r} is not valid JSON: {e}") from None
        if isinstance(spec, dict) and isinstance(spec.get("cluster"), dict):
            spec = spec["cluster"]
        return _validate(spec, f"cluster file {path!r}")
    raise TypeError(f"cluster must be a file path, a dict or None (TF_CONFIG), got {type(cluster).__name__}")


def task_from_tf_config():
    """Returns `(job, task)` from `TF_CONFIG`'s `task` field; ValueError if it has none."""
    task = _tf_config("no --job/--task given").get("task")
    if not isinstance(task, dict) or not isinstance(task.get("type"), str):
        raise ValueError("TF_CONFIG has no 'task' field with a 'type' (and 'index')")
    return task["type"], task.get("index", 0)


def check_task(spec, job, task):
    """Raises ValueError unless `job` names a job of `spec` and `task` is one of its indices."""
    if job not in spec:
        raise ValueError(f"job {job!r} is not in the cluster (jobs: {sorted(spec)})")
    if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(spec[job]):
        raise ValueError(f"task {task!r} is out of range for job {job!r}, which has {len(spec[job])} task(s): "
                         f"0..{len(spec[job]) - 1}")


def start_server(job, task, cluster=None):
    """Starts and returns this process's gRPC `tf.distribute.Server` for one task.

    evstore's op library is loaded first, so the server runs evstore's kernels.

    Args:
      job: the task's job name, e.g. "ps" or "worker".
      task: the task's index within its job.
      cluster: anything `load_cluster` accepts (None: `TF_CONFIG`).

    Raises:
      ValueError: a bad cluster (see `load_cluster`), an unknown `job` or a
        `task` out of range.
    """
    spec = load_cluster(cluster)
    check_task(spec, job, task)
    import tensorflow as tf

    import evstore  # noqa: F401  (loads the op library: the server must know evstore's kernels)
    from checkpoint import task_service
    task_service.install()   # uploads / downloads this task's checkpoint parts when the chief asks
    if job == "worker":
        from evstore_app.job import kafka_worker
        kafka_worker.install(task)   # the batches of its own Kafka partitions, when a step asks

    return tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task, protocol="grpc",
                                start=True)


def _free_ports(n):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))   # all bound at once: n distinct ports
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _accepts(address):
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path, lines=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalCluster:
    """PS and worker processes on loopback ports; the calling process is the chief.

    Each task runs `python -m evstore_app server --job J --task I --cluster FILE
    --exit-with-parent` in its own process group, logging to
    `<directory>/<job>-<task>.log`. The constructor returns once every server
    has printed its ready line and accepts TCP connections. Use it as a
    context manager (or call `close()`, also called at interpreter exit); a
    task whose owner died without closing it (SIGKILL, os._exit) exits by
    itself within a second.

    Args:
      num_ps: number of PS tasks (>= 1).
      num_workers: number of worker tasks (>= 1).
      directory: where `cluster.json` and the logs go (None: a new temp dir).
      env: extra environment variables for the task processes.
      python: the interpreter that runs the tasks.
      timeout: seconds to wait for the servers to come up.
      task_env: {(job, task): {variable: value}}: extra environment of one
        task (e.g. its own TMPDIR), over `env`.

    Raises:
      ValueError: `num_ps` or `num_workers` below 1.
      RuntimeError: a server exited or did not serve within `timeout` (the
        message holds the tail of its log).
    """

    def __init__(self, num_ps=2, num_workers=2, directory=None, env=None, python=sys.executable, timeout=120.0,
                 task_env=None):
        for name, n in (("num_ps", num_ps), ("num_workers", num_workers)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        self._closed = False
        self._procs = {}
        self._log_start = {}
        self.directory = directory or tempfile.mkdtemp(prefix="evstore-cluster-")
        os.makedirs(self.directory, exist_ok=True)
        ports = _free_ports(1 + num_ps + num_workers)
        addr = [f"127.0.0.1:{p}" for p in ports]
        self.spec = {"chief": addr[:1], "ps": addr[1:1 + num_ps], "worker": addr[1 + num_ps:]}
        self.cluster_file = os.path.join(self.directory, "cluster.json")
        with open(self.cluster_file, "w") as f:
            json.dump(self.spec, f, indent=1)
        self._python = python
        self._task_env = dict(task_env or {})
        self._env = dict(env or {})
        atexit.register(self.close)
        try:
            for job in SERVER_JOBS:
                for task in range(len(self.spec[job])):
                    self._spawn(job, task)
            self._wait_ready([(j, t) for j in SERVER_JOBS for t in range(len(self.spec[j]))], timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def resolver(self):
        """A `SimpleClusterResolver` for the chief (task_type "chief", rpc_layer "grpc")."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.spec), task_type="chief", task_id=0, rpc_layer="grpc")

    def process(self, job, task):
        """The `subprocess.Popen` of one task (None if never started)."""
        return self._procs.get((job, task))

    def log_path(self, job, task):
        return os.path.join(self.directory, f"{job}-{task}.log")

    def _spawn(self, job, task):   # (job, task) checked by the caller
        if job not in SERVER_JOBS:
            raise ValueError(f"job {job!r}: LocalCluster runs only {SERVER_JOBS} tasks (the caller is the chief)")
        with open(self.log_path(job, task), "ab") as log:
            self._log_start[(job, task)] = log.tell()   # this incarnation's "ready" line comes after it
            self._procs[(job, task)] = spawn(
                server_argv(job, task, self.cluster_file, self._python),
                server_env({**self._env, **self._task_env.get((job, task), {})}),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_ready(self, tasks, timeout):
        deadline = time.monotonic() + timeout
        pending = list(tasks)
        while pending:
            job, task = pending[0]
            proc = self._procs[(job, task)]
            if proc.poll() is not None:
                raise RuntimeError(f"{job} task {task} exited with code {proc.returncode} before serving; "
                                   f"log tail:\n{_tail(self.log_path(job, task))}")
            with open(self.log_path(job, task), "rb") as f:
                f.seek(self._log_start[(job, task)])
                printed_ready = b"evstore server: ready" in f.read()
            if printed_ready and _accepts(self.spec[job][task]):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job} task {task} did not accept connections on {self.spec[job][task]} "
                                   f"within {timeout:.0f} s; log tail:\n{_tail(self.log_path(job, task))}")
            time.sleep(0.1)

    def kill(self, job, task, sig=signal.SIGKILL):
        """Sends `sig` (default SIGKILL) to one task's process group and, for SIGKILL, waits for it to die."""
        check_task(self.spec, job, task)
        proc = self._procs.get((job, task))
        if proc is not None:
            kill_group(proc, sig, timeout=30)

    def restart(self, job, task, timeout=120.0, env=None):
        """Kills one task (if alive) and starts it again on the same address; returns once it serves.
        `env`: the task's extra environment from now on (replaces its `task_env`; None: keeps it)."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        if env is not None:
            self._task_env[(job, task)] = dict(env)
        self.kill(job, task)
        self._spawn(job, task)
        self._wait_ready([(job, task)], timeout)

    def alive(self):
        """The `(job, task)` pairs whose process is running."""
        return [k for k, p in self._procs.items() if p.poll() is None]

    def close(self):
        """Kills every task's process group (SIGKILL) and waits for them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs.values():
            kill_group(proc, wait=False)
        for proc in self._procs.values():
            proc.wait()
        atexit.unregister(self.close)
