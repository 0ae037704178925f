"""What the drivers of multi-process benchmarks share (bench.training.bench_e2e,
bench.cluster.bench_cluster, bench.cluster.bench_sync): the flags choosing the
systems, the peer, the smoke size and the output; the run's stamp and
description; and its result files, bench/results/<kind>-<stamp>.json and .md."""
import datetime
import os
import platform
import subprocess
import sys

from bench.harness.paths import RESULTS, ROOT
from bench.harness.peers import DEFAULT_VENV


def add_driver_args(ap, kind, systems=None, quick_help="smoke run", timeout_help="seconds per process"):
    """--quick, --systems (when `systems` is given), --peer-venv, --timeout, --out-dir and
    --render (print the tables of a saved <kind>-*.json only)."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    if systems is not None:
        ap.add_argument("--systems", default=",".join(systems), help=f"comma-separated from {tuple(systems)}")
        ap.add_argument("--peer-venv", default=DEFAULT_VENV, help="TFRA venv (default .peer-tfra)")
    ap.add_argument("--timeout", type=float, default=900, help=timeout_help)
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--render", metavar="JSON", help=f"only print the tables of a saved {kind}-*.json")


def apply_quick(args, argv, sizes):
    """With --quick, each (flag, value) of `sizes` not given on the command line `argv`."""
    if not args.quick:
        return
    for flag, val in sizes:
        if flag not in argv:
            setattr(args, flag[2:].replace("-", "_"), val)


def chosen(value, allowed, flag):
    """The comma-separated names of `value`; SystemExit naming `flag` for one not in `allowed`."""
    names = [s for s in value.split(",") if s]
    for s in names:
        if s not in allowed:
            raise SystemExit(f"{flag}: unknown {s!r}; one of {tuple(allowed)}")
    return names


def utc_stamp():
    """The run's stamp: UTC now as 20261127T101500Z."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def git_describe():
    """`git describe --always --dirty` of the checkout, or "unknown"."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_meta(stamp, argv):
    """What every result file says of its run: when, which commit, the exact command, where."""
    main = sys.modules["__main__"]
    module = main.__spec__.name if getattr(main, "__spec__", None) else os.path.relpath(sys.argv[0], ROOT)
    return {"date_utc": stamp, "evstore_commit": git_describe(),
            "command": " ".join([os.path.relpath(sys.executable, ROOT), "-m", module] + list(argv)),
            "host": platform.node(), "cpus": os.cpu_count()}


def log_dir(out_dir):
    """`out_dir`/logs, made if missing: the processes' stderr logs."""
    d = os.path.join(out_dir, "logs")
    os.makedirs(d, exist_ok=True)
    return d
