"""tests/host_cluster.py: a parameter-server job whose chief, PS and worker
tasks each run on a host of their own (tests/hosts.py) trains as it does on
127.0.0.1, through a worker's SIGKILL, driven by cluster_harness.run_chief
unchanged."""
import os
import sys

import hosts
from host_cluster import HostCluster

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster"))
from cluster_harness import run_chief  # noqa: E402


def test_a_ps_job_with_each_task_on_its_own_host_trains_through_a_worker_kill(tmp_path):
    with hosts.network_or_skip(tmp_path) as net:
        with HostCluster(net, num_ps=2, num_workers=2) as hc:
            addresses = [a.rsplit(":", 1)[0] for job in ("chief", "ps", "worker") for a in hc.spec[job]]
            assert len(set(addresses)) == 5 and all(a.startswith("10.213.") for a in addresses)
            actions = []
            r = run_chief(hc, "cluster_chief_ev.py", ["--cluster", hc.cluster_file, "--scenario", "kill-worker",
                                                      "--steps", 40], actions=actions)
            assert actions == [("kill", "worker", 1)]
            assert not hc.process("worker", 1).alive() and hc.process("worker", 0).alive()
    assert r["ev_device"] == "/job:ps/replica:0/task:1/device:CPU:0"
    assert r["fetched"] == 20   # every function scheduled after the kill returned a value
    # At least once, as on 127.0.0.1 (tests/cluster/test_cluster_launcher.py): the function the killed
    # worker ran is run again on the other one, and its updates that had landed land twice.
    assert r["counter"] in (40, 41) and dict(zip(r["keys"], r["freqs"]))[7] in (40, 41)
