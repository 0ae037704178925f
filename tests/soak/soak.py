"""The soak: a trainer and three serving replicas on an S3-protocol root for
a given time, with SIGKILLs at random moments, checked all along.

    .venv/bin/python tests/soak/soak.py --minutes 120 --out /tmp/soak.json   # or: make soak

What runs (all real processes on this machine):
  * moto's S3 server on 127.0.0.1 (the root is s3://<bucket>/soak, reached
    through s3fs with the usual AWS_* variables, as tests/checkpoint/
    test_s3_root.py does);
  * tests/soak/soak_trainer.py: commits a delta every --delta-every seconds, a
    full every --full-every commits (keep_chains --keep-chains), and
    journals each commit with its prediction on the probe inputs;
  * --replicas `evstore serve` processes polling the root every 0.5 s;
  * a client thread per replica calling gRPC Predict on the probe inputs
    back to back (tests/soak/soak_client.py).
With --hosts (root only) every process runs on a host of its own
(tests/hosts.py: network, mount and UTS namespaces): moto on host `s3`, the
trainer on `trainer` (it also uploads the serving export to the store), each
replica on `replica<i>` (it downloads the export from the store, then serves
on port 8500 of its address), the clients as one process on `client`. The
object store is all they share.
Every --kill-min..--kill-max seconds (uniform), once the last kill has
converged, the trainer or one replica (even odds; the replica at random)
is SIGKILLed and started again at once.
With --hosts --trainer ps the trainer is a parameter-server job instead
(soak_ps_chief.py: the chief, 2 PS and 2 workers, each on a host of its
own; every PS uploads its own part of each commit): the trainer's kill is of
the chief, a PS or a worker (at random). A killed worker is started again
and the job goes on (TF reconnects to it); a killed PS or chief takes the
job with it, which is started again whole (every task, then the chief),
resuming from its last commit in the store.

Checked all along (each failure is a violation in the report; exit 1):
  * every answer comes from one committed version: its outputs equal the
    journaled prediction of the version it names (rtol 1e-5);
  * no commit is lost or reused: journaled commit sequence numbers only
    grow, and a restarted trainer restores at least the last one journaled;
  * every replica converges after each kill: all replicas serve the newest
    journaled commit (as of the restarted process being ready) within
    --converge-s;
  * a replica that is up answers (errors only while it is being killed);
  * disk is bounded by retention: never more than keep_chains + 1 fulls
    (one more while a full is being written) under the root;
  * --hosts: at the end no host holds a checkpoint file outside the object
    store (tests/hosts.py's scan of each host's private /tmp, home and
    /dev/shm), and no host wrote a checkpoint byte at any time, a save's,
    a restore's or a replica's (tests/hosts.py's write trace).
Reported: RSS, open descriptors and threads of every process, their growth
per hour (least-squares slope over each process's life after its first
--warmup-s seconds; the longest-lived instance of each role), the disk
high-water mark, kills, convergence times and answer counts.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import hosts  # noqa: E402  (tests/hosts.py: every process on a host of its own, for --hosts)
from host_cluster import HostCluster  # noqa: E402  (tests/host_cluster.py: --trainer ps)
import s3_server  # noqa: E402  (tests/checkpoint: moto's server, shared with the S3 tests)
from bench.harness.args import add_numbers  # noqa: E402
from evstore_app.cluster import stop as stop_process  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STARTUP_S = 300   # TensorFlow import + model load on a busy 2-core machine


def _proc_stats(pid):
    """(RSS MB, threads, open descriptors) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:   # a zombie (killed, not yet reaped) has no memory lines
        return None
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"]), fds


def _slope_per_hour(samples):
    """Least-squares slope of [(t seconds, value)] in value per hour (0 for < 3 samples)."""
    if len(samples) < 3:
        return 0.0
    t = np.array([s[0] for s in samples])
    v = np.array([s[1] for s in samples], dtype=float)
    if np.ptp(t) == 0:
        return 0.0
    return float(np.polyfit(t, v, 1)[0] * 3600)


class Moto:
    """moto's S3 server on 127.0.0.1 and a fresh bucket; AWS_* set for children."""

    def __init__(self, workdir):
        self.log = open(os.path.join(workdir, "moto.log"), "w")
        self.proc, endpoint = s3_server.start_server(self.log)
        os.environ.update(dict(s3_server.ENV, AWS_ENDPOINT_URL=endpoint))
        import fsspec

        self.fs = fsspec.filesystem("s3")
        self.bucket = f"soak-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(self.bucket)

    def stop(self):
        stop_process(self.proc, grace=30)
        self.log.close()


class Proc:
    """One instance of a role (trainer, replica-i): its process, start time and resource samples."""

    def __init__(self, role, cmd, workdir, n, host=None):
        self.role = role
        self.log = open(os.path.join(workdir, f"{role}-{n}.log"), "w")
        if host is None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        else:   # --hosts: a process on its host (tests/hosts.py)
            self.proc = host.popen(cmd, stdout=subprocess.PIPE, stderr=self.log)
        self.started = time.monotonic()
        self.ready_at = None
        self.samples = []   # (t, rss MB, threads, fds)
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self.log.closed:
            self.log.close()


class Soak:
    def __init__(self, a):
        self.a = a
        self.workdir = a.workdir
        self.net = self.moto = self.cluster = None
        if a.hosts:   # every process on a host of its own, moto too: the object store is all they share
            self.net = hosts.Network(os.path.join(self.workdir, "hosts"))
            self.store = self.net.object_store()
            self.root, self.export_url = self.store.root("soak"), self.store.root("export")
            if a.trainer == "ps":   # hosts chief, ps0, ps1, worker0, worker1
                self.cluster = HostCluster(self.net, num_ps=2, num_workers=2)
                self.trainer_host = self.cluster.chief
            else:
                self.trainer_host = self.net.host("trainer")
            self.replica_hosts = [self.net.host(f"replica{i}") for i in range(a.replicas)]
            self.client_host = self.net.host("client")
            self.export = "/tmp/export"   # the trainer's; each replica downloads it from export_url
            self.journal_path = os.path.join(self.trainer_host.tmp, "journal.jsonl")
            self.inputs_path = os.path.join(self.trainer_host.tmp, "inputs.json")
        else:
            if a.trainer != "single":
                raise ValueError(f"--trainer {a.trainer} runs only with --hosts")
            self.moto = Moto(self.workdir)
            self.root = f"s3://{self.moto.bucket}/soak"
            self.export = os.path.join(self.workdir, "export")
            self.journal_path = os.path.join(self.workdir, "journal.jsonl")
            self.inputs_path = os.path.join(self.workdir, "inputs.json")
        self.rng = random.Random(a.seed)
        self.lock = threading.Lock()
        self.violations = []
        self.probe = {}            # seq -> journaled probe prediction
        self.max_commit = 0
        self.journal_pos = 0
        self.trainer = None
        self.replicas = [None] * a.replicas
        self.ports = [None] * a.replicas
        self.served = [None] * a.replicas     # (monotonic time, version) of each replica's last good answer
        self.answers = [0] * a.replicas
        self.errors_up = [0] * a.replicas
        self.pending = []          # (replica, version, outputs) not yet in the journal
        self.retired = []          # Proc instances ended (for their samples)
        self.kills = []
        self.disk = []             # (t, bytes, fulls)
        self.instances = 0
        self.stopping = threading.Event()

    # ---- processes -----------------------------------------------------------------------
    def start_trainer(self):
        self.instances += 1
        journal, inputs = ("/tmp/journal.jsonl", "/tmp/inputs.json") if self.net else (self.journal_path,
                                                                                       self.inputs_path)
        if self.a.trainer == "ps":
            cmd = [sys.executable, os.path.join(HERE, "soak_ps_chief.py"), "--cluster", self.cluster.cluster_file,
                   "--root", self.root, "--export-url", self.export_url, "--journal", journal, "--inputs-out", inputs,
                   "--pause", str(self.a.delta_every), "--full-every", str(self.a.full_every),
                   "--keep-chains", str(self.a.keep_chains)]
        else:
            cmd = [sys.executable, os.path.join(HERE, "soak_trainer.py"), "--root", self.root,
                   "--export", self.export, "--journal", journal, "--inputs-out", inputs,
                   "--delta-every", str(self.a.delta_every), "--full-every", str(self.a.full_every),
                   "--keep-chains", str(self.a.keep_chains)]
            if self.net:
                cmd += ["--export-url", self.export_url]
        self.trainer = Proc("trainer", cmd, self.workdir, self.instances, host=self.net and self.trainer_host)

    def start_replica(self, i):
        self.instances += 1
        serve = ["--checkpoints", self.root, "--model_name", "soak", "--poll-every", "0.5"]
        if self.net:
            h = self.replica_hosts[i]
            cmd = [sys.executable, os.path.join(ROOT, "tests", "multihost", "replica.py"), self.export_url, *serve,
                   "--host", h.address, "--port", "8500", "--rest_api_port", "8501"]
        else:
            h = None
            cmd = [sys.executable, "-m", "evstore_app.cli", "serve", "--export", self.export, *serve,
                   "--port", "0", "--rest_api_port", "0"]
        self.replicas[i] = Proc(f"replica{i}", cmd, self.workdir, self.instances, host=h)
        self.ports[i] = None

    def wait_ready(self, p, what):
        deadline = time.monotonic() + STARTUP_S
        while True:
            if what == "trainer" and "ready" in p.lines:
                break
            if what == "replica" and any(ln.startswith("grpc ") for ln in p.lines):
                break
            if p.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{p.role} did not start (exit {p.proc.poll()}); see {p.log.name}")
            time.sleep(0.2)
        p.ready_at = time.monotonic()
        if what == "replica":   # "grpc <name> on <host>:<port>"
            return [ln for ln in p.lines if ln.startswith("grpc ")][0].rsplit(" ", 1)[1]
        return None

    # ---- the journal -----------------------------------------------------------------------
    def read_journal(self):
        with open(self.journal_path) as f:
            f.seek(self.journal_pos)
            data = f.read()
        lines = data.split("\n")
        complete, rest = lines[:-1], lines[-1]   # a line cut by a kill mid-write is not yet whole
        self.journal_pos += len(data) - len(rest)
        for line in complete:
            if not line:
                continue
            r = json.loads(line)
            seq = r["seq"]
            with self.lock:
                if r["event"] == "commit":
                    if seq <= self.max_commit:
                        self.violations.append(f"commit {seq} reused (journaled after {self.max_commit})")
                elif seq < self.max_commit:
                    self.violations.append(f"a restarted trainer restored {seq}, but {self.max_commit} was "
                                           "committed: a commit was lost")
                if seq in self.probe and not np.allclose(self.probe[seq], r["probe"], rtol=1e-5, atol=1e-6):
                    self.violations.append(f"version {seq} journaled twice with different states")
                self.probe[seq] = r["probe"]
                self.max_commit = max(self.max_commit, seq)

    def await_journal(self, timeout_s=120.0):
        """Reads the journal until it names every version a replica answered
        with, while the trainer lives. The trainer journals a commit after
        the commit returns and it has computed the probe's prediction, so a
        replica can answer with a commit the journal does not hold yet; a
        trainer that dies first has its commit covered by the restart's
        "restored" line instead."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.read_journal()
            with self.lock:
                unjournaled = any(v not in self.probe for _, v, _ in self.pending)
            if not unjournaled or self.trainer.proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.5)

    def check_answer(self, i, version, outputs):
        want = self.probe.get(version)
        if want is None:
            self.pending.append((i, version, outputs))
            return
        if not np.allclose(outputs, want, rtol=1e-5, atol=1e-6):
            self.violations.append(f"replica {i} answered version {version} with outputs of no committed state")

    # ---- threads ---------------------------------------------------------------------------
    def answered(self, i, t, version, outputs):
        with self.lock:
            self.answers[i] += 1
            self.served[i] = (t, version)
            self.check_answer(i, version, outputs)

    def failed(self, i, t, code, p=None):
        """A failed predict at time `t`: a violation when replica i's instance `p` (None: the current one)
        was up and ready then."""
        with self.lock:
            p = p or self.replicas[i]
            if p is not None and p.ready_at is not None and t > p.ready_at and p.proc.poll() is None \
                    and self.replicas[i] is p:
                self.errors_up[i] += 1
                if self.errors_up[i] <= 10:
                    self.violations.append(f"replica {i} (up) failed a predict: {code}")

    def client(self, i):
        """One replica's client thread (every process on this machine)."""
        import soak_client

        state = {}

        def target():
            p, cur = self.replicas[i], self.ports[i]
            if cur is None or p is None or p.proc.poll() is not None:
                return None
            state["p"] = p
            return cur

        soak_client.predict_loop(target, self.stopping, lambda t, v, o: self.answered(i, t, v, o),
                                 lambda t, code: self.failed(i, t, code, state.get("p")), self.a.query_every,
                                 soak_client.decode_inputs(self.inputs))

    def host_clients(self):
        """--hosts: the clients as one process on the client's host; its lines are checked here."""
        addresses = [f"{h.address}:8500" for h in self.replica_hosts]
        self.instances += 1
        self.client_proc = Proc("client", [sys.executable, os.path.join(HERE, "soak_client.py"),
                                           "--query-every", str(self.a.query_every), "--inputs", self.inputs,
                                           *addresses],
                                self.workdir, self.instances, host=self.client_host)
        seen = 0
        while not self.stopping.is_set():
            lines = self.client_proc.lines
            if seen == len(lines):
                if self.client_proc.proc.poll() is not None:
                    with self.lock:
                        self.violations.append(f"the client process exited ({self.client_proc.proc.returncode}); "
                                               f"see {self.client_proc.log.name}")
                    return
                time.sleep(0.05)
                continue
            for line in lines[seen:len(lines)]:
                r = json.loads(line)
                if "e" in r:
                    self.failed(r["i"], r["t"], r["e"])
                else:
                    self.answered(r["i"], r["t"], r["v"], np.array(r["o"]))
            seen = len(lines)
        self.client_proc.kill()

    def sampler(self):
        import checkpoint.manifest as manifest

        last_disk = 0.0
        while not self.stopping.wait(self.a.sample_every):
            now = time.monotonic()
            for p in [self.trainer, *self.replicas]:
                if p is not None and p.proc.poll() is None:
                    s = _proc_stats(p.proc.pid)
                    if s is not None:
                        p.samples.append((now, *s))
            if now - last_disk >= 3 * self.a.sample_every:
                last_disk = now
                try:
                    if self.net:
                        objects = self.store.objects("soak/")
                        size = sum(n for _, n in objects)
                        names = {k.split("/")[1] for k, _ in objects if k.count("/") >= 2}
                    else:
                        path = f"{self.moto.bucket}/soak"
                        self.moto.fs.invalidate_cache()
                        size = self.moto.fs.du(path)
                        names = [n.rsplit("/", 1)[-1] for n in self.moto.fs.ls(path, detail=False)]
                    fulls = sum(1 for n in names if (manifest.parse_dir_name(n) or ("",))[0] == "full")
                except FileNotFoundError:
                    continue
                self.disk.append((now, size, fulls))
                if fulls > self.a.keep_chains + 1:
                    with self.lock:
                        self.violations.append(f"{fulls} fulls under the root, over keep_chains + 1 = "
                                               f"{self.a.keep_chains + 1}")

    # ---- the run ---------------------------------------------------------------------------
    def converge(self, since):
        """Seconds until every replica serves the newest commit journaled
        as of now (answers after `since`), or None past --converge-s."""
        self.read_journal()
        target = self.max_commit
        deadline = time.monotonic() + self.a.converge_s
        while time.monotonic() < deadline:
            self.read_journal()
            with self.lock:
                ok = all(s is not None and s[0] > since and s[1] >= target for s in self.served)
            if ok:
                return time.monotonic() - since
            time.sleep(0.2)
        return None

    def run(self):
        a = self.a
        self.start_trainer()
        self.wait_ready(self.trainer, "trainer")
        with open(self.inputs_path) as f:
            self.inputs = f.read()   # the probe inputs, as soak_client.py's --inputs
        for i in range(a.replicas):
            self.start_replica(i)
        for i in range(a.replicas):
            self.ports[i] = self.wait_ready(self.replicas[i], "replica")
        if self.net:
            threads = [threading.Thread(target=self.host_clients, daemon=True)]
        else:
            threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(a.replicas)]
        threads.append(threading.Thread(target=self.sampler, daemon=True))
        for t in threads:
            t.start()
        started = time.monotonic()
        end = started + a.minutes * 60
        first = self.converge(started)
        if first is None:
            self.violations.append("the replicas never converged at the start")
        next_kill = time.monotonic() + self.rng.uniform(a.kill_min, a.kill_max)
        while time.monotonic() < end:
            time.sleep(0.5)
            self.read_journal()
            if self.trainer.proc.poll() is not None:
                self.violations.append(f"the trainer exited by itself ({self.trainer.proc.returncode}); see "
                                       f"{self.trainer.log.name}")
                break
            if time.monotonic() < next_kill or end - time.monotonic() < a.kill_max:
                continue
            trainer_side = ["chief", "ps0", "ps1", "worker0", "worker1"] if a.trainer == "ps" else ["trainer"]
            victim = self.rng.choice(trainer_side) if self.rng.random() < 0.5 else \
                f"replica{self.rng.randrange(a.replicas)}"
            t0 = time.monotonic()
            if victim.startswith("worker"):   # the job goes on: TF reconnects to the restarted worker
                self.cluster.restart("worker", int(victim[len("worker"):]))
            elif victim in ("trainer", "chief") or victim.startswith("ps"):
                if victim.startswith("ps"):
                    self.cluster.kill("ps", int(victim[len("ps"):]))
                self.trainer.kill()
                self.retired.append(self.trainer)
                if a.trainer == "ps":   # a PS's tables or the chief are gone: the orchestrator restarts the job
                    self.cluster.restart_all()
                self.start_trainer()
                self.wait_ready(self.trainer, "trainer")
                self.read_journal()
            else:
                i = int(victim[len("replica"):])
                with self.lock:
                    self.replicas[i].kill()
                    self.retired.append(self.replicas[i])
                    self.served[i] = None
                self.start_replica(i)
                self.ports[i] = self.wait_ready(self.replicas[i], "replica")
            ready = time.monotonic()
            took = self.converge(ready)
            self.kills.append({"victim": victim, "at_s": round(t0 - started, 1), "restart_s": round(ready - t0, 1),
                               "converge_s": None if took is None else round(took, 2)})
            if took is None:
                self.violations.append(f"the replicas did not converge within {a.converge_s} s after killing "
                                       f"{victim}")
            next_kill = time.monotonic() + self.rng.uniform(a.kill_min, a.kill_max)
        self.stopping.set()
        for t in threads:
            t.join(timeout=60)
        self.await_journal()
        with self.lock:
            for i, version, outputs in self.pending:
                if version not in self.probe:
                    self.violations.append(f"replica {i} answered version {version}, never committed")
                else:
                    self.check_answer(i, version, outputs)
        return time.monotonic() - started

    def shutdown(self):
        self.stopping.set()
        for p in [*self.replicas, self.trainer]:
            if p is not None:
                p.stop() if p.role != "trainer" else p.kill()
        if self.net:
            self.leftovers = self.net.checkpoint_files()
            self.written = self.net.checkpoint_writes()   # any checkpoint byte written on any disk
            self.net.close()
        else:
            self.moto.stop()

    # ---- the report --------------------------------------------------------------------------
    def report(self, elapsed):
        a = self.a
        procs = [p for p in [*self.retired, self.trainer, *self.replicas] if p is not None]
        growth = {}
        for role in sorted({p.role for p in procs}):
            longest = max((p for p in procs if p.role == role), key=lambda p: len(p.samples))
            steady = [s for s in longest.samples if s[0] - (longest.ready_at or longest.started) >= a.warmup_s]
            growth[role] = {
                "lifetime_s": round(longest.samples[-1][0] - longest.samples[0][0], 1) if longest.samples else 0,
                "rss_mb": [round(steady[0][1], 1), round(steady[-1][1], 1)] if steady else None,
                "rss_mb_per_hour": round(_slope_per_hour([(s[0], s[1]) for s in steady]), 2),
                "threads": [steady[0][2], steady[-1][2]] if steady else None,
                "threads_per_hour": round(_slope_per_hour([(s[0], s[2]) for s in steady]), 2),
                "fds": [steady[0][3], steady[-1][3]] if steady else None,
                "fds_per_hour": round(_slope_per_hour([(s[0], s[3]) for s in steady]), 2),
            }
        commits = sorted(self.probe)
        converge = [k["converge_s"] for k in self.kills if k["converge_s"] is not None]
        leftovers = {h: [os.path.relpath(p, self.net.workdir) for p in ps]
                     for h, ps in getattr(self, "leftovers", {}).items()}
        for h, ps in leftovers.items():
            if ps:
                self.violations.append(f"host {h} holds checkpoint files outside the object store: {ps[:5]}")
        for h, ps in getattr(self, "written", {}).items():
            self.violations.append(f"host {h} wrote checkpoint bytes outside the object store: {ps[:5]}")
        return {
            "minutes": round(elapsed / 60, 2),
            "root": ("moto S3 on a host of its own via s3fs; the trainer, each replica and the client each on a "
                     "host of their own (tests/hosts.py)") if self.net else "moto S3 on 127.0.0.1 via s3fs",
            "replicas": a.replicas,
            "delta_every_s": a.delta_every, "full_every": a.full_every, "keep_chains": a.keep_chains,
            "commits_journaled": len(commits), "last_commit": commits[-1] if commits else None,
            "answers": self.answers, "answers_total": sum(self.answers), "errors_while_up": self.errors_up,
            "kills": self.kills,
            "trainer": a.trainer,
            "kills_trainer": sum(not k["victim"].startswith("replica") for k in self.kills),
            "kills_replica": sum(k["victim"].startswith("replica") for k in self.kills),
            "converge_s_max": max(converge) if converge else None,
            "converge_s_median": float(np.median(converge)) if converge else None,
            "disk_bytes_max": max((d[1] for d in self.disk), default=0),
            "disk_bytes_last": self.disk[-1][1] if self.disk else 0,
            "fulls_max": max((d[2] for d in self.disk), default=0),
            "growth": growth,
            "violations": self.violations,
        }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_numbers(p, (("--minutes", 3.0, "how long to run"),
                    ("--replicas", 3, "serving replicas"),
                    ("--delta-every", 3.0, "seconds between the trainer's commits"),
                    ("--full-every", 10, "every Nth commit is a full"),
                    ("--keep-chains", 2, "the trainer's retention, in chains"),
                    ("--kill-min", 20.0, "least seconds between kills"),
                    ("--kill-max", 60.0, "most seconds between kills"),
                    ("--converge-s", 120.0, "most seconds to converge after a kill"),
                    ("--query-every", 0.05, "pause between one client's predicts, in seconds"),
                    ("--sample-every", 5.0, "seconds between resource samples"),
                    ("--warmup-s", 30.0, "seconds after a process is ready before its samples count for growth"),
                    ("--seed", 0, "seed of the kill schedule")))
    p.add_argument("--trainer", choices=["single", "ps"], default="single",
                   help="single: one trainer process (soak_trainer.py); ps (with --hosts): a parameter-server job, "
                        "its chief (soak_ps_chief.py), 2 PS and 2 workers each on a host of its own, whose kills "
                        "are of the chief, a PS or a worker (default single)")
    p.add_argument("--hosts", action="store_true",
                   help="every process on a host of its own (network and mount namespaces, tests/hosts.py; root "
                        "only): moto, the trainer, each replica and the client; at the end no host may hold a "
                        "checkpoint file outside the object store")
    p.add_argument("--workdir", default=None, help="logs, export and journal (default: a new temp directory)")
    p.add_argument("--out", default=None, help="write the JSON report here too")
    a = p.parse_args(argv)
    if a.workdir is None:
        import tempfile

        a.workdir = tempfile.mkdtemp(prefix="evstore-soak-")
    os.makedirs(a.workdir, exist_ok=True)
    soak = Soak(a)
    try:
        elapsed = soak.run()
    finally:
        soak.shutdown()
    report = soak.report(elapsed)
    report["workdir"] = a.workdir
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
