"""Many hosts on one machine: each task of a multi-host test on a host of its own.

A `Network` is a set of hosts joined by one Ethernet bridge. Each host is a
network namespace with its own address on that bridge (10.213.0.2, .3, ...)
and its own loopback; each process started on a host also gets a mount
namespace in which `/tmp`, the home directory and `/dev/shm` are that host's
private directories and every other file (the checkout and its venv
included) is read-only, and a UTS namespace whose hostname is the host's
name (so a checkpoint lease names the host its writer runs on). Process ids
are the machine's: a test signals any process directly. What two hosts share
is what real hosts share: the network between them, and an object store if
the test starts one
(`Network.object_store()`: moto's S3 server on a host of its own). Nothing of
this is visible in, or routed to from, the machine's own (root) network
namespace: the bridge lives in a namespace of its own too, and no address is
ever given to an interface outside the namespaces made here.

    import hosts

    with hosts.network_or_skip(tmp_path) as net:   # pytest: skips, saying why, where namespaces do not work
        store = net.object_store()                 # moto on host "s3"; every process started later gets AWS_*
        ps0 = net.host("ps0")                      # a new host: ps0.address == "10.213.0.3"
        p = ps0.start([sys.executable, "-m", "evstore_app", "server", ...], name="ps0")
        p.wait_line(lambda ln: ln.startswith("evstore server: ready"))
        with ps0.inside():                         # this thread's sockets are now ps0's
            urllib.request.urlopen(f"http://{store.address}:{store.port}/")
        p.kill()                                   # SIGKILL (its process group); ps0.kill_all(): every process on ps0
        net.assert_no_checkpoint_files()           # no host wrote or kept a checkpoint byte outside the object store

API
  available() -> None | str
      None when this machine can run a Network, else why not (not root, no
      `ip`/`unshare`/`setpriv`, `ip netns add` refused, ...).
  mounts_available() -> None | str, mount_namespace_or_skip()
      The same for a private mount namespace alone (a test that needs a
      small file system of its own, no network).
  network_or_skip(workdir, **kw)
      A context manager yielding a Network; calls pytest.skip(<the reason>)
      where `available()` says no (a skipped test with its reason, never a
      silent pass).
  Network(workdir, env=None)
      workdir: where each host's private directories (`<workdir>/<host>/tmp`,
      `home`, `shm`) and logs (`<workdir>/<host>/logs/<name>.log`) go, seen
      from the test. `env`: variables for every process started on any host.
      Raises Unavailable(reason) where namespaces do not work. Before making
      its own namespaces it removes those of dead runs (a test process that
      was SIGKILLed) of the same owner ($EVH_OWNER, e.g. each engineer's name
      on a shared machine; unset: runs without one), SIGKILLing what still
      runs in them; another owner's namespaces are never touched. `close()` (also at
      interpreter exit, and by `with`) SIGKILLs every process on every host
      and deletes every namespace, also after a failed test.
    .host(name) -> Host           a new host with the next address
    .hosts                        {name: Host}
    .env                          variables every process started later gets
    .object_store(name="s3", port=5000) -> ObjectStore
                                  moto's S3 server on host `name`, a fresh
                                  bucket; sets .env's AWS_* (endpoint
                                  http://<its address>:<port>) for every host
    .checkpoint_files() -> {host: [paths]}
                                  files under any host's private directories
                                  that hold checkpoint bytes (a commit's
                                  MANIFEST.json / bundle files, a checkpoint
                                  directory full-N / delta-N, a staging, restore
                                  or cache directory of checkpoint.Storage);
                                  a SavedModel's directory (saved_model.pb: a
                                  serving export) is a model, not a commit, and
                                  is not scanned
    .checkpoint_writes() -> {host: [paths]}
                                  every file any host but the object store's
                                  created or wrote while the Network lived
                                  (an inotify trace: a file written and
                                  deleted between two scans included) that
                                  had a checkpoint name or held checkpoint
                                  bytes: a save's, and a restore's or a
                                  serving shard's too (they read through an
                                  object source: checkpoint/object_source.py)
    .assert_no_checkpoint_files()
                                  AssertionError naming each file of either
  Host
    .name, .address, .netns      its name, IPv4 address on the bridge, namespace
    .tmp, .home, .shm            its private directories, as the test sees them
                                 (inside the host: /tmp, $HOME, /dev/shm)
    .put(name, data) -> str      writes a file into the host's /tmp; returns its
                                 path as processes on the host see it
    .start(argv, name=None, env=None, stdin=DEVNULL, cwd=None) -> Proc
                                 a real process on the host, in its own process
                                 group; stdout is read line by line
                                 (Proc.lines), stderr goes to .log_path(name)
    .popen(argv, env=None, stdin=DEVNULL, stdout=PIPE, stderr=None, cwd=None)
                                 the same as a bare subprocess.Popen, for a
                                 caller that reads its pipes itself
    .inside()                    context manager: the calling thread's network
                                 namespace is the host's for the block; only
                                 clients that open their sockets in the calling
                                 thread (urllib, http.client, socket) belong
                                 there, never ones with I/O threads of their
                                 own (s3fs/aiohttp, gRPC channels): start those
                                 as processes on a host
    .connect(port, timeout) -> bool  whether the host's address accepts TCP on `port`
    .wait_port(port, timeout, proc=None)
    .kill_all()                  SIGKILL every process in the host's namespace
    .procs                       the Procs started on it
  Proc
    .popen, .pid, .name, .host, .log_path, .lines (stdout so far)
    .wait_line(pred, timeout) -> str   the first stdout line `pred` accepts
                                 (RuntimeError with the log tail if the process
                                 exits or the time runs out)
    .wait(timeout=None) -> int   its exit code, once stdout is read to the end
    .kill(sig=SIGKILL)           the process group; waits for SIGKILL's end
    .stop(timeout=60)            SIGTERM, then SIGKILL
    .alive()
  ObjectStore
    .host, .address, .port, .endpoint, .bucket, .env
    .root(prefix) -> "s3://<bucket>/<prefix>"
    .keys(prefix="") -> [keys]   the bucket's keys (ListObjectsV2, from inside
                                 the store's host)
    .objects(prefix="") -> [(key, size)]
    .get(key) -> bytes, .put(key, data), .delete(key)
                                 one object's bytes read, written, removed
                                 (what a test does to damage a commit)

Where processes see what (inside a host): the checkout at its own path,
read-only (so tests/ scripts and `python -m evstore_app` work as usual; a
checkout or interpreter under /tmp or $HOME is shown there read-only; one
under /dev/shm is a ValueError);
`/tmp`, `$HOME`, `/dev/shm` private and writable; everything else read-only
(a write fails with EROFS), except the kernel's /proc, /sys and /dev. So a
checkpoint byte written outside the object store can only be in a host's
private directories: `checkpoint_writes()` has traced every file written
there since the Network started (inotify), and `checkpoint_files()` scans
what is there now (the directories outlive the processes).

Every process started on a host dies with the test process (PR_SET_PDEATHSIG
through `setpriv --pdeathsig KILL`; the parent is the thread that started it,
so start host processes from a thread that outlives them, e.g. the main one).
Addresses come from 10.213.0.0/16 and exist only inside namespaces made here;
each Network has its own bridge, so concurrent runs do not meet.
"""
import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
import xml.etree.ElementTree as ET

from evstore_app.cluster import kill_group, server_env, spawn   # how every evstore process is started

__all__ = ["Network", "Host", "Proc", "ObjectStore", "Unavailable", "available", "network_or_skip",
           "SUBNET"]

SUBNET = "10.213.0.0/16"
# Every namespace made here: evh-[<$EVH_OWNER>-]<owner pid>-<owner start>-<run>-<host>. With EVH_OWNER
# set (letters only: who runs the tests on a shared machine), a run makes, and as stale removes, only
# namespaces of that owner; without it, only those with no owner.
_OWNER = os.environ.get("EVH_OWNER", "")
if _OWNER and not re.fullmatch(r"[a-z]{1,12}", _OWNER):
    raise ValueError(f"EVH_OWNER must be 1-12 lowercase letters, got {_OWNER!r}")
_PREFIX = f"evh-{_OWNER}-" if _OWNER else "evh-"
_NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "ftp_proxy", "no_proxy")
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_S = 300                       # a TensorFlow process on a loaded 2-core machine

# Inside a host: a private mount namespace whose /tmp, home and /dev/shm are the host's directories
# (bound before /tmp, whose overlay hides the test's own /tmp), then "/" read-only: a bind remount
# changes this namespace's mount only, never the machine's. $EVH_HOME_RO: the home directory's
# entries the interpreter or the checkout lives in (e.g. .pyenv), shown read-only in the private home;
# $EVH_TMP_RO: the same for /tmp (a checkout or venv cloned under /tmp), shown read-only in the private /tmp.
_SETUP = r"""
set -e
hostname "$EVH_HOSTNAME"
for d in $EVH_HOME_RO; do mount --bind "$4/$d" "$2/$d"; done
for d in $EVH_TMP_RO; do mkdir -p "$1/$d"; mount --bind "/tmp/$d" "$1/$d"; done
mount --rbind "$2" "$4"
mount --bind "$3" /dev/shm
mount --rbind "$1" /tmp
mount -o remount,bind,ro /
for d in $EVH_HOME_RO; do mount -o remount,bind,ro "$4/$d"; done
for d in $EVH_TMP_RO; do mount -o remount,bind,ro "/tmp/$d"; done
unset EVH_HOME_RO EVH_TMP_RO EVH_HOSTNAME
shift 4
exec setpriv --pdeathsig KILL -- "$@"
"""

# Checkpoint bytes by name: checkpoint/manifest.py's MANIFEST.json and directory names, a TF
# bundle's files (and the native writer's temporary names, bundle_stream.cc), a synchronous part's
# report, and the temporary directories of checkpoint/storage.py and task_service.py.
_CKPT_FILE = re.compile(r"(^MANIFEST\.json|\.index|\.index\.tmp|\.data-\d+-of-\d+|\.tmp-(main|\d+)(\.len|\.s)?"
                        r"|^part\d+\.json)$")
_CKPT_DIR = re.compile(r"^((full|delta)-\d+|\.?evstore-(stage|ckpt-cache|restore|task|sync-part)-.*)$")
# Checkpoint bytes by content: a TF bundle index ends in the leveldb table magic; a manifest is
# JSON naming its files, EVs and sequence number.
_TABLE_MAGIC = bytes.fromhex("57fb808b247547db")


class Unavailable(RuntimeError):
    """Network or mount namespaces cannot be made here; the message says why."""


def _run(*argv, check=True):
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def _start_time(pid):
    """The kernel's start time of `pid` (clock ticks since boot), or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def mounts_available():
    """None when a process can be given a private mount namespace and mount a tmpfs in it, else why not."""
    if os.geteuid() != 0:
        return "not root: mount namespaces need CAP_SYS_ADMIN"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    p = _run("unshare", "--mount", "--propagation", "private", "--",
             "mount", "-t", "tmpfs", "tmpfs", "/mnt", check=False)
    if p.returncode != 0:
        return f"a mount namespace cannot be made (`unshare -m` then `mount`): {p.stderr.strip()}"
    return None


def mount_namespace_or_skip():
    """pytest.skip with the reason where `mounts_available()` says no (never a silent pass)."""
    import pytest

    why = mounts_available()
    if why is not None:
        pytest.skip(f"needs a private mount namespace: {why}")


def available():
    """None when namespaces work here, else the reason they do not."""
    why = mounts_available()
    if why is not None:
        return why
    for tool in ("ip", "setpriv"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"{_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    p = _run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"`ip netns add` failed: {p.stderr.strip()}"
    try:
        p = _run("ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private", "--",
                 "mount", "-t", "tmpfs", "tmpfs", "/mnt", check=False)
        if p.returncode != 0:
            return f"a mount namespace cannot be made (`unshare -m` then `mount`): {p.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def network_or_skip(workdir, **kw):
    """A Network over `workdir` (closed after), or pytest.skip with the reason namespaces do not work."""
    import pytest

    why = available()
    if why is not None:
        pytest.skip(f"many-hosts test needs network and mount namespaces: {why}")
    net = Network(workdir, **kw)
    try:
        yield net
    finally:
        net.close()


def _netns_names():
    try:
        return sorted(os.listdir(_NETNS_DIR))
    except FileNotFoundError:
        return []


def _remove_netns(name):
    """SIGKILLs every process in namespace `name`, then deletes it."""
    for _ in range(50):
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    _run("ip", "netns", "del", name, check=False)


def remove_stale():
    """Deletes the namespaces (and kills the processes) of runs whose test process is gone."""
    removed = []
    for name in _netns_names():
        m = re.match(re.escape(_PREFIX) + r"(\d+)-(\d+)-", name)
        if m is None:
            if name.startswith(_PREFIX + "probe-"):
                pid = name.split("-")[2]
                if pid.isdigit() and _start_time(int(pid)) is None:
                    _remove_netns(name)
                    removed.append(name)
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        if _start_time(pid) != start:
            _remove_netns(name)
            removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd):
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _home_shares(home):
    """The top-level entries of `home` (the home directory, or /tmp) that hold this interpreter (the real
    files behind a venv's python, its base prefix) or the checkout: a host's private home or /tmp shows
    them read-only, or no Python would start."""
    shares = set()
    for p in (os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix),
              os.path.realpath(_CHECKOUT)):
        rel = os.path.relpath(p, home)
        if not rel.startswith(".."):
            first = rel.split(os.sep)[0]
            if first not in ("", "."):
                shares.add(first)
    if any(" " in s for s in shares):
        raise ValueError(f"a home directory entry the interpreter needs has a space in its name: {sorted(shares)}")
    return sorted(shares)


def _tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class Proc:
    """A process on a host (see the module docstring)."""

    def __init__(self, host, name, popen, log_path, log):
        self.host, self.name, self.popen, self.log_path = host, name, popen, log_path
        self.pid = popen.pid
        self.lines = []
        self._log = log
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True, name=f"hosts-{host.name}-{name}").start()

    def _read(self):
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, pred, timeout=STARTUP_S, start=0):
        """The first stdout line (from index `start`) that `pred(line)` accepts."""
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    if pred(self.lines[i]):
                        return self.lines[i]
                    i += 1
                if self._eof or time.monotonic() > deadline:
                    break
                self._cond.wait(min(1.0, max(0.01, deadline - time.monotonic())))
        code = self.popen.poll()
        why = f"exited with code {code}" if self._eof else f"printed no such line within {timeout:.0f} s"
        raise RuntimeError(f"{self.name} on {self.host.name} {why}; log tail:\n{_tail(self.log_path)}")

    def alive(self):
        return self.popen.poll() is None

    def wait(self, timeout=None):
        """Waits for the process to exit and its stdout to be read to the end; returns the exit code."""
        code = self.popen.wait(timeout=timeout)
        with self._cond:
            while not self._eof:
                self._cond.wait(1.0)
        self._close_log()
        return code

    def kill(self, sig=signal.SIGKILL):
        """Sends `sig` to the process group; for SIGKILL waits until the process is gone."""
        kill_group(self.popen, sig)
        if sig == signal.SIGKILL:
            self._close_log()

    def stop(self, timeout=60):
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
        if self.popen.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.popen.wait()
        self._close_log()
        return self.popen.returncode

    def _close_log(self):
        if not self._log.closed:
            self._log.close()


class Host:
    """One host of a Network (see the module docstring)."""

    def __init__(self, net, name, netns, address):
        self.net, self.name, self.netns, self.address = net, name, netns, address
        d = os.path.join(net.workdir, name)
        self.tmp, self.home, self.shm = (os.path.join(d, x) for x in ("tmp", "home", "shm"))
        self.logs = os.path.join(d, "logs")
        for x in (self.tmp, self.home, self.shm, self.logs):
            os.makedirs(x, exist_ok=True)
            os.chmod(x, 0o1777 if x != self.logs else 0o755)
        for share in net.home_shares:
            os.makedirs(os.path.join(self.home, share), exist_ok=True)
        self.procs = []
        self._popens = []

    def __repr__(self):
        return f"Host({self.name!r}, {self.address})"

    def put(self, name, data):
        mode = "wb" if isinstance(data, bytes) else "w"
        with open(os.path.join(self.tmp, name), mode) as f:
            f.write(data)
        return f"/tmp/{name}"

    def log_path(self, name):
        return os.path.join(self.logs, f"{name}.log")

    def popen(self, argv, env=None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None, cwd=None,
              text=True):
        """`argv` as a subprocess.Popen on this host, in its own process group (for callers that read its
        pipes themselves; `start` is the usual way). `env`: variables added to Network.process_env()."""
        if self.net.closed:
            raise RuntimeError("the network is closed")
        full_env = self.net.process_env(env)
        full_env["EVH_HOME_RO"] = " ".join(self.net.home_shares)
        full_env["EVH_TMP_RO"] = " ".join(self.net.tmp_shares)
        full_env["EVH_HOSTNAME"] = self.name
        cmd = ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private", "--",
               "/bin/sh", "-c", _SETUP, "hosts-setup", self.tmp, self.home, self.shm, self.net.home_path,
               *[str(a) for a in argv]]
        popen = spawn(cmd, full_env, stdin=stdin, stdout=stdout, stderr=stderr, text=text, cwd=cwd or _CHECKOUT)
        self._popens.append(popen)
        return popen

    def start(self, argv, name=None, env=None, stdin=subprocess.DEVNULL, cwd=None):
        """Starts `argv` on this host (see the module docstring); returns its Proc."""
        name = name or f"{os.path.basename(str(argv[0]))}-{len(self.procs)}"
        log_path = self.log_path(name)
        log = open(log_path, "ab")
        try:
            popen = self.popen(argv, env=env, stdin=stdin, stderr=log, cwd=cwd)
        except BaseException:
            log.close()
            raise
        proc = Proc(self, name, popen, log_path, log)
        self.procs.append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self):
        """The calling thread's network namespace is this host's for the block."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(os.path.join(_NETNS_DIR, self.netns), os.O_RDONLY)
        try:
            _setns(target)
            try:
                if os.stat("/proc/thread-self/ns/net").st_ino != os.fstat(target).st_ino:
                    raise RuntimeError(f"setns did not move this thread into {self.netns}")
                yield self
            finally:
                _setns(own)
        finally:
            os.close(own)
            os.close(target)

    def connect(self, port, timeout=1.0, address=None):
        """Whether `address` (default this host's) accepts a TCP connection on `port`, tried from this host."""
        import socket

        with self.inside():
            try:
                with socket.create_connection((address or self.address, port), timeout=timeout):
                    return True
            except OSError:
                return False

    def wait_port(self, port, timeout=STARTUP_S, proc=None):
        """Returns once this host accepts TCP on `port`; RuntimeError past `timeout` or if `proc` exits."""
        deadline = time.monotonic() + timeout
        while not self.connect(port, timeout=0.5):
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} on {self.name} exited with code {proc.popen.returncode}; "
                                   f"log tail:\n{_tail(proc.log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: nothing accepts on port {port} after {timeout:.0f} s")
            time.sleep(0.1)

    def pids(self):
        return [int(p) for p in _run("ip", "netns", "pids", self.netns, check=False).stdout.split()]

    def kill_all(self):
        """SIGKILLs every process in this host's namespace (a host losing power) and reaps its Procs."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._reap()

    def _reap(self):
        for p in self._popens:
            kill_group(p)
        for p in self.procs:
            p.kill()


class ObjectStore:
    """moto's S3 server on its own host (see the module docstring)."""

    def __init__(self, host, port, bucket, proc):
        self.host, self.port, self.bucket, self.proc = host, port, bucket, proc
        self.address = host.address
        self.endpoint = f"http://{host.address}:{port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}

    def root(self, prefix):
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def _request(self, method, path, data=None):
        """One request, signed as an S3 client with the store's credentials signs it (moto refuses an
        unsigned read of an object a signed client wrote)."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        signed = AWSRequest(method=method, url=self.endpoint + path, data=data or b"")
        S3SigV4Auth(Credentials(self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"]), "s3",
                    self.env["AWS_DEFAULT_REGION"]).add_auth(signed)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        # (urllib would label a body a form, which moto then parses as one)
        headers = dict(signed.headers, **({"Content-Type": "application/octet-stream"} if data else {}))
        req = urllib.request.Request(self.endpoint + path, method=method, data=data, headers=headers)
        with self.host.inside():
            with opener.open(req, timeout=60) as r:
                return r.read()

    def objects(self, prefix=""):
        """[(key, size in bytes)] of every object under `prefix` in the bucket (ListObjectsV2)."""
        out, token = [], None
        while True:
            q = f"/{self.bucket}?list-type=2&prefix={urllib.parse.quote(prefix)}"
            if token:
                q += f"&continuation-token={urllib.parse.quote(token)}"
            root = ET.fromstring(self._request("GET", q))
            ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            out += [(c.findtext(f"{ns}Key"), int(c.findtext(f"{ns}Size"))) for c in root.iter(f"{ns}Contents")]
            if root.findtext(f"{ns}IsTruncated") != "true":
                return out
            token = root.findtext(f"{ns}NextContinuationToken")

    def keys(self, prefix=""):
        """Every key under `prefix` in the bucket."""
        return [k for k, _ in self.objects(prefix)]

    def _path(self, key):
        return f"/{self.bucket}/{urllib.parse.quote(key)}"

    def get(self, key):
        """The bytes of object `key` (urllib.error.HTTPError 404 if there is none)."""
        return self._request("GET", self._path(key))

    def put(self, key, data):
        """Writes object `key` whole (replacing it)."""
        self._request("PUT", self._path(key), data=bytes(data))

    def delete(self, key):
        """Removes object `key` (none: nothing happens, as S3 does)."""
        self._request("DELETE", self._path(key))


def _is_checkpoint_path(rel):
    """`rel` (a directory's ends in os.sep) names a checkpoint file or lies in a checkpoint directory."""
    *dirs, name = rel.split(os.sep)
    return bool(name and _CKPT_FILE.search(name)) or any(_CKPT_DIR.match(p) for p in dirs)


def _holds_checkpoint_bytes(path):
    """Whether the file at `path` (if it is still there) is a bundle index or a manifest by content."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            f.seek(0, os.SEEK_END)
            if f.tell() >= 8:
                f.seek(-8, os.SEEK_END)
                if f.read(8) == _TABLE_MAGIC:
                    return True
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and all(k in head for k in (b'"seq"', b'"files"', b'"evs"'))


class WriteTrace:
    """Every file created or written under the hosts' private directories while the Network lives.

    inotify (through inotify_simple: a thin ctypes wrapper of the kernel's API, no thread or
    polling of its own) watches each host's /tmp, home and /dev/shm and every directory made
    under them (a new directory's entries made before its watch are read when it is added), in
    the test process: the kernel reports writes by any mount namespace's view of the same inodes.
    A file is recorded at creation, rename into place and close after writing, with whether it
    held checkpoint bytes then (a bundle index or a manifest, by content) - so a file written
    and deleted between two scans is still seen. A directory is recorded when it is made (its
    path with a trailing separator): files written and removed in a new directory before its
    watch is added (a few microseconds) are seen by the directory's name only.
    """

    def __init__(self):
        import inotify_simple

        self._fl = inotify_simple.flags
        self._mask = self._fl.CREATE | self._fl.MOVED_TO | self._fl.CLOSE_WRITE
        self._inotify = inotify_simple.INotify()
        self._dirs = {}           # watch descriptor -> (host, top, directory)
        self._lock = threading.Lock()
        self.written = {}         # host -> {path relative to its private dir's parent: holds checkpoint bytes}
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="hosts-write-trace")
        self._thread.start()

    def watch(self, host, top):
        self._add(host, top, top)

    def _add(self, host, top, d):
        try:
            wd = self._inotify.add_watch(d, self._mask)
        except OSError:   # gone already, or a read-only share's mount point
            return
        with self._lock:
            self._dirs[wd] = (host, top, d)
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:   # made before the watch: seen now
            if e.is_dir(follow_symlinks=False):
                self._add(host, top, e.path)
            else:
                self._record(host, top, e.path)

    def _record(self, host, top, path):
        rel = os.path.relpath(path, os.path.dirname(top))
        holds = _holds_checkpoint_bytes(path)
        with self._lock:
            seen = self.written.setdefault(host, {})
            seen[rel] = seen.get(rel, False) or holds

    def _run(self):
        while not self._closed:
            try:
                events = self._inotify.read(timeout=200)
            except OSError:
                return
            for ev in events:
                with self._lock:
                    where = self._dirs.get(ev.wd)
                if where is None or not ev.name:
                    continue
                host, top, d = where
                path = os.path.join(d, ev.name)
                if ev.mask & self._fl.ISDIR:
                    if ev.mask & (self._fl.CREATE | self._fl.MOVED_TO):
                        with self._lock:
                            self.written.setdefault(host, {})[os.path.relpath(path, os.path.dirname(top)) + os.sep] = False
                        self._add(host, top, path)
                else:
                    self._record(host, top, path)

    def sync(self):
        """Returns once the events queued so far are read (a short quiet period)."""
        time.sleep(0.5)
        while True:
            with self._lock:
                before = sum(len(v) for v in self.written.values())
            time.sleep(0.3)
            with self._lock:
                if sum(len(v) for v in self.written.values()) == before:
                    return

    def checkpoint_writes(self, hosts=None):
        """{host: [paths]} of recorded files with a checkpoint name or checkpoint bytes."""
        self.sync()
        out = {}
        with self._lock:
            items = [(h, dict(v)) for h, v in self.written.items() if hosts is None or h in hosts]
        for h, seen in items:
            for rel, holds in sorted(seen.items()):
                parts = rel.split(os.sep)
                if any(os.path.join(*parts[:i], "saved_model.pb") in seen for i in range(1, len(parts))):
                    continue   # in a SavedModel (a serving export): a model, not a commit
                if holds or _is_checkpoint_path(rel):
                    out.setdefault(h, []).append(rel)
        return out

    def close(self):
        self._closed = True
        self._thread.join(timeout=5)
        self._inotify.close()


class Network:
    """Hosts on one bridge (see the module docstring)."""

    _runs = 0

    def __init__(self, workdir, env=None):
        why = available()
        if why is not None:
            raise Unavailable(why)
        self.workdir = os.path.abspath(str(workdir))
        self.home_path = os.path.realpath(os.path.expanduser("~"))
        for inner, what in ((self.home_path, "the home directory"), ("/dev/shm", "/dev/shm")):
            if inner == "/" or (self.workdir + "/").startswith(inner.rstrip("/") + "/"):
                raise ValueError(f"workdir {self.workdir} must not lie under {what} ({inner}): a host's private "
                                 f"{what} hides it")
        if not os.path.isdir(self.home_path):
            raise ValueError(f"the home directory {self.home_path} is not a directory")
        checkout = os.path.realpath(_CHECKOUT)
        if (checkout + "/").startswith("/dev/shm/"):
            raise ValueError(f"the checkout {checkout} lies under /dev/shm, which each host replaces by its "
                             f"own: put the checkout elsewhere to run many-hosts tests")
        os.makedirs(self.workdir, exist_ok=True)
        self.home_shares = _home_shares(self.home_path)
        self.tmp_shares = _home_shares("/tmp")
        remove_stale()
        Network._runs += 1
        self.run_prefix = f"{_PREFIX}{os.getpid()}-{_start_time(os.getpid())}-{Network._runs}-"
        self.hosts = {}
        self.env = dict(env or {})
        self.closed = False
        self._switch = self.run_prefix + "sw"
        self.trace = WriteTrace()
        self._stores = set()   # hosts that are the object store: what they write is the store's
        atexit.register(self.close)
        try:
            _run("ip", "netns", "add", self._switch)
            _run("ip", "-n", self._switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self._switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def host(self, name):
        """A new host named `name` (letters, digits, '-', '_') with the next free address."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name or ""):
            raise ValueError(f"host name {name!r}: use 1-40 letters, digits, '-' or '_'")
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        if self.closed:
            raise RuntimeError("the network is closed")
        i = len(self.hosts)
        if i >= 250 * 250:
            raise ValueError("too many hosts")
        address = f"10.213.{i // 250}.{i % 250 + 2}"
        netns = self.run_prefix + name
        port = f"p{i}"
        _run("ip", "netns", "add", netns)
        try:
            _run("ip", "-n", self._switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", netns)
            _run("ip", "-n", self._switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", netns, "addr", "add", f"{address}/16", "dev", "eth0")
            _run("ip", "-n", netns, "link", "set", "eth0", "up")
            _run("ip", "-n", netns, "link", "set", "lo", "up")
        except BaseException:
            _remove_netns(netns)
            raise
        h = Host(self, name, netns, address)
        self.hosts[name] = h
        for top in (h.tmp, h.home, h.shm):
            self.trace.watch(name, top)
        return h

    def process_env(self, extra=None):
        """The environment of a process started on a host: this one's, minus proxies and TF_CONFIG, plus
        `Network.env` and `extra`."""
        return server_env({"HOME": self.home_path, "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
                           "NO_PROXY": "*", "no_proxy": "*", "TF_CPP_MIN_LOG_LEVEL": "2", **self.env, **(extra or {})},
                          base={k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS})

    def object_store(self, name="s3", port=5000, timeout=STARTUP_S):
        """moto's S3 server on a new host `name` with a fresh bucket; every process started later gets its
        AWS_* variables."""
        h = self.host(name)
        proc = h.start([sys.executable, "-m", "moto.server", "-H", h.address, "-p", str(port)], name="moto")
        h.wait_port(port, timeout=timeout, proc=proc)
        self._stores.add(name)
        store = ObjectStore(h, port, f"evstore-{uuid.uuid4().hex[:12]}", proc)
        store._request("PUT", f"/{store.bucket}")
        self.env.update(store.env)
        return store

    def checkpoint_files(self):
        """{host name: [paths]} of checkpoint files under each host's private directories."""
        found = {}
        for name, h in self.hosts.items():
            for top in (h.tmp, h.home, h.shm):
                for d, dirs, files in os.walk(top):
                    if "saved_model.pb" in files:   # a SavedModel (a serving export): a model, not a commit
                        dirs[:] = []
                        continue
                    in_ckpt_dir = any(_CKPT_DIR.match(part) for part in os.path.relpath(d, top).split(os.sep))
                    for f in files:
                        if in_ckpt_dir or _CKPT_FILE.search(f):
                            found.setdefault(name, []).append(os.path.join(d, f))
        return found

    def checkpoint_writes(self):
        """{host: [paths]} of every file a host (not the object store's) created or wrote, at any time
        since the Network started, that had a checkpoint name or held checkpoint bytes (WriteTrace)."""
        return self.trace.checkpoint_writes([h for h in self.hosts if h not in self._stores])

    def assert_no_checkpoint_files(self):
        """AssertionError naming each checkpoint file a host keeps now (`checkpoint_files`) and each one
        a host wrote at any time (`checkpoint_writes`)."""
        found = self.checkpoint_files()
        assert not found, "checkpoint files outside the object store: " + "; ".join(
            f"{h}: {', '.join(os.path.relpath(p, self.workdir) for p in ps[:10])}" for h, ps in found.items())
        written = self.checkpoint_writes()
        assert not written, "checkpoint bytes written outside the object store: " + "; ".join(
            f"{h}: {', '.join(ps[:10])}" for h, ps in written.items())

    def close(self):
        """SIGKILLs every process on every host, deletes every namespace. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for h in self.hosts.values():
            for p in h._popens:
                kill_group(p, wait=False)
        for name in [n for n in _netns_names() if n.startswith(self.run_prefix)]:
            _remove_netns(name)
        for h in self.hosts.values():
            h._reap()
        self.trace.close()
        atexit.unregister(self.close)
