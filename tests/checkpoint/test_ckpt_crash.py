"""kill -9 of a real saving process at several points of the commit protocol:
the chain stays readable, restore equals the last committed state, and the
next save (from a restarted job) carries every change."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckpt_model import assert_same_state, load_state

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_model.py")


def _run(root, dump, steps, env=None, timeout=240):
    p = subprocess.run([sys.executable, WORKER, str(root), str(dump), json.dumps(steps)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _run_until_paused(root, dump, steps, marker, timeout=240):
    env = {**os.environ, "EVSTORE_FAILPOINT_FILE": str(marker)}
    p = subprocess.Popen([sys.executable, WORKER, str(root), str(dump), json.dumps(steps)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    try:
        while not marker.exists():
            if p.poll() is not None:
                raise AssertionError(f"worker exited {p.returncode} before the failpoint: {p.stderr.read()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError("worker never reached the failpoint")
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return p


# point -> does the interrupted delta (seq 2) count as committed?
POINTS = {"bundle-mid-data": False, "before-manifest": False, "after-manifest": True}


@pytest.mark.parametrize("point", sorted(POINTS))
def test_killed_saver_leaves_a_readable_chain_and_loses_nothing_committed(tmp_path, point):
    root, dump = tmp_path / "root", tmp_path / "dump"
    dump.mkdir()
    marker = tmp_path / "paused"
    _run_until_paused(root, dump, [["train", 0, 4], ["full", 4], ["train", 4, 8], ["failpoint", point],
                                   ["delta", 8]], marker)
    committed = 2 if POINTS[point] else 1
    want_pos = 8 if POINTS[point] else 4
    # A restarted job restores exactly the last commit and the input position saved with it...
    out = _run(root, dump, [["restore"], ["dump", "restored"]])
    assert f'restored {{"pos": {want_pos}}}' in out
    assert_same_state(load_state(dump / "restored.npz"), load_state(dump / f"live-{committed}.npz"))
    # ...resumes from that position, and its next save carries every change.
    _run(root, dump, [["restore"], ["train", want_pos, 10], ["delta", 10], ["dump", "resumed"]])
    _run(root, dump, [["restore"], ["dump", "final"]])
    assert_same_state(load_state(dump / "final.npz"), load_state(dump / "resumed.npz"))
    # The dead save's directory is gone (the next save cleaned it up) or committed.
    dirs = sorted(d for d in os.listdir(root) if d != "WRITER.lease")   # the killed writer's lease stays
    assert all(os.path.exists(root / d / "MANIFEST.json") for d in dirs), dirs
