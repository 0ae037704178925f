"""Exact resume with admission filters and eviction: a real
training process killed with SIGKILL mid-run and resumed from its checkpoints
ends in exactly the state of the same job never stopped, bit for bit.
Everything that decides a future admission or eviction is in the checkpoint:
filtered keys' last-seen steps, the table's clock, Bloom counters."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "resume_job.py")
STOP = 16


def _job(root, out, kind, env=None):
    return subprocess.Popen([sys.executable, JOB, str(root), str(out), kind, str(STOP)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _finish(p):
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return out


@pytest.mark.parametrize("kind", ["counter", "bloom", "string"])
def test_killed_and_resumed_job_equals_the_uninterrupted_one_bit_for_bit(tmp_path, kind):
    _finish(_job(tmp_path / "straight", tmp_path / "straight.npz", kind))
    # The same job, killed (SIGKILL) while it trains after its third save...
    p = _job(tmp_path / "killed", tmp_path / "never.npz", kind, env={"RESUME_JOB_SLOW": "0.5"})
    saves = 0
    for line in p.stdout:
        saves += line.startswith("saved")
        if saves == 3:
            p.send_signal(signal.SIGKILL)
            break
    p.wait()
    assert p.returncode == -signal.SIGKILL and not (tmp_path / "never.npz").exists()
    # ...and restarted: it restores, goes on from the saved input position.
    _finish(_job(tmp_path / "killed", tmp_path / "resumed.npz", kind))
    with np.load(tmp_path / "straight.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        assert len(a["filtered_keys"]) > 0 or kind == "bloom"
        for k in a.files:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
