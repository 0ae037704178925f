"""Parameter-server jobs whose only shared storage is an S3 root (moto's
server on 127.0.0.1): every PS uploads its own part, the chief merges the
part indexes and writes the manifest; restores stage each shard's files on
its own task. Every task has its own TMPDIR (no path shared between tasks).
tests/multihost/test_ps_object_store.py runs the job with every task on a
host of its own (a chief killed mid-commit, the whole job killed and resumed)."""
import functools
import glob
import json
import os

import numpy as np
import pytest

import checkpoint
from cluster_harness import run_chief
from evstore_app.cluster import LocalCluster
from evstore_app.job.cluster_train import ClusterJob
from test_cluster_training import BATCH, CHIEF, assert_same_state, load, reference

S3_HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint")


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    import sys
    sys.path.insert(0, S3_HELPERS)
    from s3_server import moto_bucket
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with moto_bucket(log, before_stop=checkpoint.lease._release_all) as bucket:
        yield bucket


def private_tmps(base, num_ps, num_workers):
    """{(job, task): {"TMPDIR": its own directory}} for a LocalCluster."""
    out = {}
    for job, n in (("ps", num_ps), ("worker", num_workers)):
        for t in range(n):
            d = os.path.join(base, f"tmp-{job}-{t}")
            os.makedirs(d, exist_ok=True)
            out[(job, t)] = {"TMPDIR": d}
    return out


def leftovers(base):
    """Files left in the tasks' private temp directories (a checkpoint byte outside the root)."""
    return [p for p in glob.glob(os.path.join(base, "tmp-*", "**"), recursive=True) if os.path.isfile(p)]


def s3_manifests(root):
    import fsspec
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    out = {}
    for path in sorted(fs.glob(root[len("s3://"):] + "/*/MANIFEST.json")):
        m = json.loads(fs.cat_file(path))
        out[m["seq"]] = m
    return out


@pytest.fixture(scope="module")
def s3_job(tmp_path_factory, s3_bucket):
    """A sync 2-PS job on the S3 root (worker 1 killed at batch 5), killed whole (chief, PS, worker 0)
    after its third commit (at batch 20).

    Returns (root, commits [(seq, position)], sent {seq: bytes the chief sent}, dumps dir, base dir)."""
    d = tmp_path_factory.mktemp("s3_job")
    root, dumps = f"s3://{s3_bucket}/ps-job", str(d / "dumps")
    os.makedirs(dumps)
    lines, actions = [], []
    with LocalCluster(num_ps=2, num_workers=2, directory=str(d), task_env=private_tmps(str(d), 2, 2)) as lc:
        # Worker 1 is SIGKILLed at batch 5: the job goes on with worker 0 and commits as before.
        run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 60, "--sync", "--batch-size", BATCH,
                              "--checkpoints", root, "--delta-every", 10, "--dump-dir", dumps,
                              "--kill-worker-at", 5, "--pause-after-commits", 3,
                              "--state-out", str(d / "never.npz")],
                  stop_on="PAUSED", lines_out=lines, actions=actions)
    assert actions == [("kill", "worker", 1)]
    commits = [tuple(int(x) for x in ln.split()[1:]) for ln in lines if ln.startswith("COMMITTED ")]
    sent = dict(tuple(int(x) for x in ln.split()[1:]) for ln in lines if ln.startswith("SENT "))
    return root, commits, sent, dumps, str(d)


def test_ps_job_commits_a_full_and_deltas_to_s3_each_ps_uploading_its_own_rows(s3_job):
    root, commits, sent, _, base = s3_job
    assert [p for _, p in commits] == [5, 10, 20]   # the chief commits when it stops at batch 5 too
    manifests = s3_manifests(root)
    assert sorted(manifests) == [s for s, _ in commits]
    for seq, m in manifests.items():
        assert m["deleted_complete"] is True
        parts = [n for n in m["evs"] if "/part_" in n]
        assert len(parts) == 6 and all(m["evs"][n]["shard"]["count"] == 2 for n in parts)
        # No row crossed the chief: it sent its own part (dense variables, global step) and the indexes.
        row_bytes = sum(m["evs"][n]["rows"] * m["evs"][n]["dim"] * 4 for n in parts)
        assert 0 < sent[seq] < m_bytes(m) - row_bytes, (seq, sent[seq], m_bytes(m), row_bytes)
    assert leftovers(base) == []   # every task's staging directory was removed after its upload


def m_bytes(m):
    return sum(f["size"] for f in m["files"].values())


def test_an_s3_commit_of_a_ps_job_is_one_bundle_that_stock_tensorflow_reads(s3_job, tmp_path):
    import fsspec
    import tensorflow as tf

    root, commits, *_ = s3_job
    seq = commits[-1][0]
    m = s3_manifests(root)[seq]
    src = f"{root[len('s3://'):]}/delta-{seq:010d}"
    for name in m["files"]:
        fsspec.filesystem("s3").get_file(f"{src}/{name}", str(tmp_path / name))
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt"))
    names = reader.get_variable_to_shape_map()
    for ev, info in m["evs"].items():
        assert reader.get_tensor(f"{ev}-keys").shape == (info["rows"],)
        assert reader.get_tensor(f"{ev}-values").shape == (info["rows"], info["dim"])
    assert reader.get_tensor("global_step") == m["global_step"]
    assert all(n in names for n in m["dense"])


def test_s3_chain_of_two_shards_restores_into_three_ps_and_into_one_process_exactly(s3_job, tmp_path):
    root, commits, _, dumps, _ = s3_job
    want = load(os.path.join(dumps, f"commit-{commits[-1][0]}.npz"))
    with LocalCluster(num_ps=3, num_workers=1, directory=str(tmp_path),
                      task_env=private_tmps(str(tmp_path), 3, 1)) as lc:
        # --steps 20: restore only (it resumes at 20 and trains nothing; its commit holds the same state).
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 20, "--batch-size", BATCH,
                                  "--checkpoints", root, "--dump-dir", str(tmp_path),
                                  "--state-out", str(tmp_path / "state.npz")])
    assert r["resumed_at"] == 20
    assert r["devices"]["item"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(3)]
    assert_same_state(load(str(tmp_path / "restored.npz")), want, atol=0)
    one = ClusterJob(local=True, batch_size=BATCH, checkpoints=root)
    assert one.resume() == 20
    assert_same_state(one.model.state(), want, atol=0)
    one.manager.close()


def test_a_ps_killed_while_uploading_its_part_leaves_no_visible_commit(tmp_path, s3_bucket):
    """PS 1 stops in its upload (its part written on its host, the other PS's part already in the
    root); it is SIGKILLed there. The save fails and nothing under the root is committed."""
    import threading
    import time

    root = f"s3://{s3_bucket}/ps-killed-mid-upload"
    mark = str(tmp_path / "ps1-at-upload")
    env = private_tmps(str(tmp_path), 2, 1)
    env[("ps", 1)].update(EVSTORE_FAILPOINT="task-before-upload", EVSTORE_FAILPOINT_FILE=mark)
    with LocalCluster(num_ps=2, num_workers=1, directory=str(tmp_path), task_env=env) as lc:
        def kill_at_mark():
            deadline = time.time() + 150
            while not os.path.exists(mark) and time.time() < deadline:
                time.sleep(0.1)
            lc.kill("ps", 1)

        killer = threading.Thread(target=kill_at_mark)
        killer.start()
        with pytest.raises(AssertionError, match="UnavailableError|task .*ps.*1"):
            run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 10, "--sync", "--batch-size", BATCH,
                                  "--checkpoints", root, "--delta-every", 10,
                                  "--state-out", str(tmp_path / "never.npz")])
        killer.join()
    assert os.path.exists(mark)
    assert s3_manifests(root) == {}
    assert checkpoint.CheckpointManager(root, []).latest() is None


def test_a_ps_job_streams_each_parts_serving_view_to_s3_into_one_view_equal_to_a_local_roots(tmp_path, s3_bucket):
    """Each PS streams its part's serving view with its rows; the chief merges the part views into the
    commit's one `serving` bundle: a full's is tensor for tensor what a local root's commit of the same
    table holds (written from the merged rows), a delta's encodes exactly the delta's rows."""
    import fsspec
    import tensorflow as tf

    root = f"s3://{s3_bucket}/view-job"
    with LocalCluster(num_ps=2, num_workers=1, directory=str(tmp_path),
                      task_env=private_tmps(str(tmp_path), 2, 1)) as lc:
        r = run_chief(lc, "cluster_chief_view.py", ["--cluster", lc.cluster_file, "--root", root,
                                                    "--local", str(tmp_path / "local")])
    full, delta, local_full = r["full"], r["delta"], r["local_full"]
    fs = fsspec.filesystem("s3")

    def download(d, names):
        got = tmp_path / f"s3-{d}"
        got.mkdir()
        for name in names:
            fs.get_file(f"{root[len('s3://'):]}/{d}/{name}", str(got / name))
        return got

    views = {}
    for kind, seq in (("full", full), ("delta", delta)):
        d = f"{kind}-{seq:010d}"
        m = s3_manifests(root)[seq]
        assert m["serving_view"] == {"dtype": "int8"}
        view = sorted(n for n in m["files"] if n.startswith("serving."))
        assert view[-1] == "serving.index" and len(view) == 3, view   # one data file per PS part
        got = download(d, list(m["files"]))
        views[kind] = (tf.train.load_checkpoint(str(got / "serving")), tf.train.load_checkpoint(str(got / "ckpt")))
        names = sorted(views[kind][0].get_variable_to_shape_map())
        assert names == sorted(f"emb/part_{k}-values{s}" for k in range(2) for s in ("", "_scale"))
    s3_view, _ = views["full"]
    local_view = tf.train.load_checkpoint(str(tmp_path / "local" / f"full-{local_full:010d}" / "serving"))
    for n in sorted(local_view.get_variable_to_shape_map()):
        np.testing.assert_array_equal(s3_view.get_tensor(n), local_view.get_tensor(n), err_msg=n)
    view, main = views["delta"]
    for k in range(2):
        q, scale = view.get_tensor(f"emb/part_{k}-values"), view.get_tensor(f"emb/part_{k}-values_scale")
        values = main.get_tensor(f"emb/part_{k}-values")
        assert 0 < len(values) == len(q) < 1000
        assert (np.abs(q * scale[:, None] - values) <= scale[:, None] * 0.5 + 1e-6).all()   # int8's rounding
    assert not [k for k in fs.find(root[len("s3://"):]) if "/.sink-" in k]
    assert leftovers(str(tmp_path)) == []
