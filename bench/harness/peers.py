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


def run_json(cmd, log_path, timeout=None, what=None, env=None):
    """Runs one benchmark or peer process from the repository root, its stderr to `log_path`
    (None: discarded); returns the JSON of the last stdout line starting with "{" plus its
    wall_s, or {"error": ...} naming the log when it timed out, failed or printed no result."""
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
    if r.returncode != 0 or not lines:
        return {"error": f"{what} exit {r.returncode}{see}"}
    res = json.loads(lines[-1])
    res["wall_s"] = time.time() - t0
    return res
