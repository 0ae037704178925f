"""The peer systems' processes: TFRA lives in its own venv (.peer-tfra, made by
bench/peers/tfra-setup.sh) and is never imported into the project venv. A peer
is a module of bench.peers run by that venv's python from the repository root,
so it shares bench.harness with the side it is compared against."""
import json
import os
import subprocess
import sys
import time

from bench.harness.paths import ROOT

DEFAULT_VENV = os.path.join(ROOT, ".peer-tfra")


def module_cmd(module, *args, python=None):
    """The command running `python -m module args...` (python: this interpreter by default);
    run it with cwd=ROOT (bench.harness.paths)."""
    return [python or sys.executable, "-m", module, *map(str, args)]


def venv_python(venv, needed=True):
    """The peer venv's python, or None (with one line saying so) when `needed` and it is missing."""
    py = os.path.join(venv, "bin", "python")
    if needed and not os.path.exists(py):
        print(f"TFRA peer venv {venv} missing (bench/peers/tfra-setup.sh builds it)", flush=True)
        return None
    return py


def ensure_peer(venv, log):
    """Returns (python path, None) if TFRA is importable in `venv`, else (None, reason);
    builds the venv with tfra-setup.sh on first use (its output goes to `log`)."""
    py = os.path.join(venv, "bin", "python")
    setup = os.path.join(ROOT, "bench", "peers", "tfra-setup.sh")
    if not os.path.exists(setup):
        return (py, None) if os.path.exists(py) else (None, f"{setup} not found and {venv} missing")
    print(f"checking TFRA peer venv {venv} (tfra-setup.sh; builds it on first use)...", flush=True)
    r = subprocess.run(["bash", setup, venv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0 or not os.path.exists(py):
        return None, f"tfra-setup.sh failed (exit {r.returncode}); see {log.name}"
    return py, None


def run_json(cmd, log_path, timeout=None, what=None, env=None, partial_ok=False):
    """Runs one benchmark or peer process from the repository root, its stderr to `log_path`
    (None: discarded); returns the JSON of the last stdout line starting with "{" plus its
    wall_s, or {"error": ...} naming the log when it timed out, failed or printed no result.
    partial_ok: a process that printed its result and exited 1 (one of several systems failed,
    recorded in the result) still gives its result, with "exit_status": 1."""
    if what is None:
        what = cmd[cmd.index("-m") + 1].rsplit(".", 1)[-1] if "-m" in cmd else os.path.basename(cmd[0])
    see = f"; see {os.path.relpath(log_path, ROOT)}" if log_path else ""
    t0 = time.time()
    with open(log_path, "w") if log_path else open(os.devnull, "w") as log:
        try:
            r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout,
                               env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"{what} timed out after {timeout}s{see}"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines or r.returncode not in ((0, 1) if partial_ok else (0,)):
        return {"error": f"{what} exit {r.returncode}{last_line(log_path)}{see}"}
    res = json.loads(lines[-1])
    res["wall_s"] = time.time() - t0
    if r.returncode:
        res["exit_status"] = r.returncode
    return res


def last_line(log_path):
    """': <the log's last non-empty line>' (a process's reason for stopping), or '' without one."""
    if not log_path:
        return ""
    try:
        with open(log_path, errors="replace") as f:
            tail = [ln.strip() for ln in f.readlines()[-20:] if ln.strip()]
    except OSError:
        return ""
    return f": {tail[-1][:300]}" if tail else ""


class TfraProcess:
    """A peer module's --serve mode (bench.peers.peer_tfra's protocol: `<workload> <i>`
    answered by "@@ <seconds...> | <CPU seconds>", `stats`, `quit`) in the peer venv, spoken to over pipes;
    `args` carries the size flags (bench.harness.args), peer_python and log_dir."""

    def __init__(self, args, module="bench.peers.peer_tfra"):
        script = module.rsplit(".", 1)[1]
        cmd = module_cmd(module, python=args.peer_python) + ["--serve", "--keys", str(args.keys),
               "--dim", str(args.dim), "--batch", str(args.batch), "--batches", str(args.batches),
               "--warmup", str(args.warmup), "--seed", str(args.seed), "--fill-chunk", str(args.fill_chunk)]
        self.stderr = open(os.path.join(args.log_dir, f"{script}_{args.keys}x{args.dim}.log"), "w") \
            if args.log_dir else subprocess.DEVNULL
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.stderr, text=True, bufsize=1)
        self.info = None
        self.last_cpu_s = None

    def _reply(self):
        for line in self.p.stdout:
            if line.startswith("@@"):
                return line[2:].strip()
        raise RuntimeError(f"TFRA peer exited (code {self.p.wait()}); see its log")

    def wait_ready(self):
        r = self._reply()
        if not r.startswith("READY"):
            raise RuntimeError(f"unexpected TFRA peer reply {r!r}")
        self.info = json.loads(r[len("READY"):])

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        r = self._reply()
        if r.startswith("ERR"):
            raise RuntimeError("TFRA peer: " + r[4:])
        return r

    def run(self, w, i):
        """Batch i of workload w: its seconds (a training step's, then its apply's); the peer's CPU
        seconds over the batch (all its threads) are left in last_cpu_s."""
        wall, _, cpu = self.ask(f"{w} {i}").partition("|")
        self.last_cpu_s = float(cpu) if cpu.strip() else None
        return [float(x) for x in wall.split()]

    def stats(self):
        return json.loads(self.ask("stats"))

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=60)
        except Exception:
            self.p.kill()
            self.p.wait()
