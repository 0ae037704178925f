"""tests/soak/soak.py --hosts --trainer ps for 3 minutes: a parameter-server
job (its chief, 2 PS and 2 workers) committing to moto's S3 server, three
`evstore serve` replicas and their client, each process on a host of its own
(tests/hosts.py: the object store is all they share), SIGKILLs at random
moments (seed 30: the chief, a replica, a PS, a worker, as far as the run
gets), every answer checked against the commit it names, and at the end no
checkpoint file on any host but the store's, nor any save's byte written on
one at any time, a save's or a restore's (tests/hosts.py's write trace). One test, the whole run: it
passes when the soak reports no violation (soak.py's docstring lists them)
and at least one kill happened; the growth figures are reported, not
judged, over so short a run."""
import json
import os
import signal
import subprocess
import sys

import pytest

import hosts

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MINUTES = 3


@pytest.mark.long
def test_soak_of_a_ps_job_on_many_hosts_loses_nothing_and_every_replica_converges(tmp_path):
    why = hosts.available()
    if why is not None:
        pytest.skip(f"the soak's hosts need network and mount namespaces: {why}")
    out = tmp_path / "soak.json"
    cmd = [sys.executable, os.path.join(HERE, "soak.py"), "--hosts", "--trainer", "ps", "--seed", "30",
           "--minutes", str(MINUTES), "--kill-min", "15", "--kill-max", "35", "--workdir", str(tmp_path / "work"),
           "--out", str(out)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        log, _ = p.communicate(timeout=MINUTES * 60 + 1200)   # + start-up of the TF processes and kills
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert out.exists(), log[-5000:]
    report = json.loads(out.read_text())
    print(json.dumps(report, indent=1))
    assert report["violations"] == [], report["violations"]
    assert p.returncode == 0, log[-5000:]
    assert report["kills"], "no kill happened"
    assert all(k["converge_s"] is not None for k in report["kills"])
    assert report["answers_total"] > 0 and report["commits_journaled"] > 0
