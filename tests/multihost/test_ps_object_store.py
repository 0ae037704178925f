"""A parameter-server job whose tasks each run on a host of their own
(tests/hosts.py, tests/host_cluster.py) with an S3 root as the only storage
they share: every PS uploads its own part, the chief commits. The chief is
SIGKILLed in its third save, after every part is in the bucket and before the
manifest, then the rest of the job: that commit is never visible, the job
resumes on the same hosts from the last commit exactly, and a process on
another host restores the chain into unsharded tables exactly. No host keeps a
checkpoint byte outside the object store once the job runs again (the dead
chief's staged part is removed by the next chief on its host)."""
import os
import re
import sys
import threading
import time

import pytest

import hosts
from host_cluster import HostCluster

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "cluster"))
from cluster_harness import run_chief  # noqa: E402
from test_cluster_training import BATCH, CHIEF, assert_same_state, load, reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def committed_dirs(store, prefix):
    """({checkpoint directory: has a manifest}) of the bucket's objects under `prefix`."""
    out = {}
    for k in store.keys(prefix):
        m = re.search(r"/((full|delta)-\d{10})/(.+)$", k)
        if m:
            out[m.group(1)] = out.get(m.group(1), False) or m.group(3) == "MANIFEST.json"
    return out


def test_ps_job_on_hosts_survives_a_chief_killed_mid_commit_and_restores_into_one_process(tmp_path):
    with hosts.network_or_skip(tmp_path / "net") as net:
        store = net.object_store()
        root = store.root("ps-job")
        # The chief stops in its 3rd save before the manifest (only the chief runs the commit point).
        with HostCluster(net, num_ps=2, num_workers=2, env={"EVSTORE_FAILPOINT": "before-manifest@3",
                                                            "EVSTORE_FAILPOINT_FILE": "/tmp/at-manifest"}) as hc:
            mark = os.path.join(hc.chief.tmp, "at-manifest")

            def kill_chief_at_mark():
                deadline = time.time() + hosts.STARTUP_S
                while not os.path.exists(mark) and time.time() < deadline:
                    time.sleep(0.1)
                hc.chief.kill_all()

            killer = threading.Thread(target=kill_chief_at_mark)
            killer.start()
            lines = []
            with pytest.raises(AssertionError):
                run_chief(hc, CHIEF, ["--cluster", hc.cluster_file, "--steps", 40, "--sync", "--batch-size", BATCH,
                                      "--checkpoints", root, "--delta-every", 10, "--dump-dir", "/tmp",
                                      "--state-out", "/tmp/never.npz"], lines_out=lines)
            killer.join()
            assert os.path.exists(mark)
            commits = [tuple(int(x) for x in ln.split()[1:]) for ln in lines if ln.startswith("COMMITTED ")]
            sent = [int(ln.split()[2]) for ln in lines if ln.startswith("SENT ")]
            assert [p for _, p in commits] == [10, 20]
            # The chief sent its own part and the indexes: less than one PS's rows of a full.
            assert all(0 < s < 20000 for s in sent), sent
            dirs = committed_dirs(store, "ps-job/")
            assert sorted(dirs.items()) == [("delta-0000000002", True), ("delta-0000000003", False),
                                            ("full-0000000001", True)]   # the parts of 3, no manifest
            for job, n in (("ps", 2), ("worker", 2)):   # the rest of the job dies too
                for t in range(n):
                    hc.kill(job, t)
            hc.env.pop("EVSTORE_FAILPOINT")
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
        assert all(committed_dirs(store, "ps-job/").values())   # the dead save's parts were removed
        assert not [k for k in store.keys("ps-job/") if "/.sink-" in k]   # every streamed part was renamed
        solo = net.host("solo")
        p = solo.start([sys.executable, os.path.join(HERE, "restore_one.py"), root, "/tmp/one.npz"], name="restore")
        assert p.wait(timeout=hosts.STARTUP_S) == 0, open(p.log_path).read()[-3000:]
        assert_same_state(load(os.path.join(solo.tmp, "one.npz")), final, atol=0)
        # Saves streamed every byte into the bucket; restores read what they loaded from it.
        net.assert_no_checkpoint_files()


def test_a_new_chief_on_another_host_takes_the_lease_and_the_job_goes_on_from_two_shards_on_three_ps(tmp_path):
    """The chief's host dies after two commits; the job is started again on other hosts, with 3 PS
    where it had 2. Its chief is refused the root's writer lease (the dead chief's heartbeat is
    fresh, and another host cannot see that its process is gone) until it takes the lease over;
    then it restores the 2-shard chain into 3 PS and goes on committing to the same root: the job
    ends as if never interrupted."""
    with hosts.network_or_skip(tmp_path / "net") as net:
        store = net.object_store()
        root = store.root("takeover")
        args = ["--steps", 40, "--sync", "--batch-size", BATCH, "--checkpoints", root, "--delta-every", 10,
                "--dump-dir", "/tmp", "--serving-view", "int8"]
        lines = []
        with HostCluster(net, num_ps=2, num_workers=1) as first:
            # A lease that stays fresh for the whole test: only a takeover can move it.
            run_chief(first, CHIEF, ["--cluster", first.cluster_file, *args, "--pause-after-commits", 2,
                                     "--lease-timeout", 3600, "--state-out", "/tmp/never.npz"],
                      stop_on="PAUSED", lines_out=lines)
            first.chief.kill_all()   # the chief's host is gone (its lease stays, heartbeat fresh)
        assert [ln for ln in lines if ln.startswith("COMMITTED ")] == ["COMMITTED 1 10", "COMMITTED 2 20"]
        with HostCluster(net, num_ps=3, num_workers=1, prefix="b-") as second:
            argv = ["--cluster", second.cluster_file, *args, "--state-out", "/tmp/state.npz"]
            with pytest.raises(AssertionError, match=r"LeaseHeldError: .*host chief"):
                run_chief(second, CHIEF, argv)
            r = run_chief(second, CHIEF, argv + ["--take-over"])
            chief_tmp = second.chief.tmp
        assert r["resumed_at"] == 20 and r["global_step"] == 40
        assert r["devices"]["item"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(3)]
        assert [(seq, pos) for seq, _, pos in r["commits"]] == [(3, 30), (4, 40)]
        assert_same_state(load(os.path.join(chief_tmp, "state.npz")), reference(40))
        assert all(committed_dirs(store, "takeover/").values())
        # Every commit holds one serving view merged from its PS parts' (streamed by each PS host).
        for seq, n_ps in ((1, 2), (2, 2), (3, 3), (4, 3)):
            names = [k.rsplit("/", 1)[1] for k in store.keys("takeover/") if f"-{seq:010d}/serving." in k]
            assert sorted(names) == [f"serving.data-{i:05d}-of-{n_ps:05d}" for i in range(n_ps)] + ["serving.index"]
        net.assert_no_checkpoint_files()
