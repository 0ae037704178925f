"""A parameter-server job whose tasks each run on a host of their own
(tests/hosts.py, tests/host_cluster.py) with an S3 root as the only storage
they share: every PS uploads its own part, the chief commits; after the
whole job is killed it resumes on the same hosts exactly, and a process on
another host restores the chain into unsharded tables exactly. No host keeps a
checkpoint byte outside the object store."""
import os
import sys

import hosts
from host_cluster import HostCluster

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "cluster"))
from cluster_harness import run_chief  # noqa: E402
from test_cluster_training import BATCH, CHIEF, assert_same_state, load, reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ps_job_on_hosts_commits_to_s3_resumes_after_a_whole_job_kill_and_restores_into_one_process(tmp_path):
    with hosts.network_or_skip(tmp_path / "net") as net:
        store = net.object_store()
        root = store.root("ps-job")
        with HostCluster(net, num_ps=2, num_workers=2) as hc:
            lines = []
            run_chief(hc, CHIEF, ["--cluster", hc.cluster_file, "--steps", 40, "--sync", "--batch-size", BATCH,
                                  "--checkpoints", root, "--delta-every", 10, "--dump-dir", "/tmp",
                                  "--pause-after-commits", 2, "--state-out", "/tmp/never.npz"],
                      stop_on="PAUSED", lines_out=lines)
            commits = [tuple(int(x) for x in ln.split()[1:]) for ln in lines if ln.startswith("COMMITTED ")]
            sent = [int(ln.split()[2]) for ln in lines if ln.startswith("SENT ")]
            assert [p for _, p in commits] == [10, 20]
            keys = store.keys("ps-job/")
            for seq, _ in commits:
                assert any(k.endswith(f"-{seq:010d}/MANIFEST.json") for k in keys), keys
            # The chief sent its own part and the indexes: far less than one PS's rows (256 rows x 8 x 4 B).
            assert all(0 < s < 20000 for s in sent), sent
            for job, n in (("ps", 2), ("worker", 2)):   # the whole job is gone (the chief was SIGKILLed)
                for t in range(n):
                    hc.kill(job, t)
            net.assert_no_checkpoint_files()
            for job, n in (("ps", 2), ("worker", 2)):
                for t in range(n):
                    hc.restart(job, t)
            r = run_chief(hc, CHIEF, ["--cluster", hc.cluster_file, "--steps", 40, "--sync", "--batch-size", BATCH,
                                      "--checkpoints", root, "--delta-every", 10, "--dump-dir", "/tmp",
                                      "--state-out", "/tmp/state.npz"])
            chief_tmp = hc.chief.tmp
        assert r["resumed_at"] == 20
        assert_same_state(load(os.path.join(chief_tmp, "restored.npz")),
                          load(os.path.join(chief_tmp, f"commit-{commits[-1][0]}.npz")), atol=0)
        assert r["global_step"] == 40
        final = load(os.path.join(chief_tmp, "state.npz"))
        assert_same_state(final, reference(40))
        solo = net.host("solo")
        p = solo.start([sys.executable, os.path.join(HERE, "restore_one.py"), root, "/tmp/one.npz"], name="restore")
        assert p.wait(timeout=hosts.STARTUP_S) == 0, open(p.log_path).read()[-3000:]
        assert_same_state(load(os.path.join(solo.tmp, "one.npz")), final, atol=0)
        net.assert_no_checkpoint_files()
