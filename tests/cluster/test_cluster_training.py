"""A CTR job with sharded EVs trained by a real parameter-server cluster
(evstore_app.job.cluster_train; chief, PS and worker processes) against the same
job in one process with unsharded EVs, under failures and restarts."""
import functools
import glob
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from cluster_harness import run_chief
from evstore.quality import measure
from evstore_app.cluster import LocalCluster
from evstore_app.job.cluster_train import FIELDS, ClusterJob

CHIEF = "cluster_chief_ctr.py"
BATCH = 128


@functools.lru_cache(maxsize=None)
def reference(steps):
    """The state after `steps` batches trained in this process with unsharded EVs."""
    job = ClusterJob(local=True, batch_size=BATCH)
    job.train(steps)
    return job.model.state()


def load(path):
    return dict(np.load(path))


def assert_same_state(got, want, atol=1e-6):
    assert sorted(got) == sorted(want)
    for k in want:
        if want[k].dtype.kind == "f":
            np.testing.assert_allclose(got[k], want[k], atol=atol, rtol=0, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def assert_same_keys_and_freqs(got, want):
    for field, _ in FIELDS:
        np.testing.assert_array_equal(got[f"{field}/keys"], want[f"{field}/keys"], err_msg=field)
        np.testing.assert_array_equal(got[f"{field}/freqs"], want[f"{field}/freqs"], err_msg=field)


def test_sync_cluster_training_equals_single_process_training(tmp_path):
    out = str(tmp_path / "state.npz")
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 20, "--sync", "--batch-size", BATCH,
                                  "--state-out", out])
    assert r["devices"]["user"] == ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    assert r["global_step"] == 20
    # Values to 1e-6, versions (the step of each key's last update) and frequencies exactly.
    assert_same_state(load(out), reference(20))


def test_sync_cluster_training_on_tiered_tables_equals_single_process_all_dram_training(tmp_path):
    out = str(tmp_path / "state.npz")
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        # 1 KiB of rows per shard (32 rows of 8 floats): most rows live in each PS's tier file.
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 20, "--sync", "--batch-size", BATCH,
                                  "--state-out", out, "--tiered-dram-bytes", 1024, "--tier-path", tmp_path])
    assert r["cache_misses"] > 0                        # rows were read back from the PS tasks' disk tiers
    assert_same_state(load(out), reference(20))


def _qualities(root):
    """{position: quality record} of every commit under `root`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "MANIFEST.json"))):
        with open(path) as f:
            m = json.load(f)
        out[m["metadata"]["position"]] = m.get("quality")
    return out


# A gate every run passes: the reference moves to each commit, so it is the commit before.
EVERY_RUN = "examples >= 0"


def test_each_commit_carries_the_quality_of_its_batches_as_the_single_process_job_measures_it(tmp_path):
    root = str(tmp_path / "ckpt")
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 20, "--sync", "--batch-size", BATCH,
                              "--checkpoints", root, "--delta-every", 10, "--state-out", str(tmp_path / "s.npz"),
                              "--reference-gate", EVERY_RUN])
    one = ClusterJob(local=True, batch_size=BATCH, checkpoints=str(tmp_path / "one"), delta_every=10,
                     reference_gate=EVERY_RUN)
    one.train(20)
    got, want = _qualities(root), _qualities(str(tmp_path / "one"))
    assert sorted(got) == sorted(want) == [10, 20]
    for pos in got:
        for q, w in ((got[pos], want[pos]), (got[pos]["reference"], want[pos]["reference"])):
            assert q["examples"] == w["examples"] == 10 * BATCH
            assert q["label_rate"] == w["label_rate"]
            assert abs(q["logloss"] - w["logloss"]) < 1e-5, pos
            assert abs(q["auc"] - w["auc"]) < 1e-3, pos   # scores equal to 1e-6: near-ties may swap


def test_each_commit_records_the_reference_models_scores_of_its_batches_as_the_commit_before_scores_them(
        tmp_path):
    job = ClusterJob(local=True, batch_size=BATCH, checkpoints=str(tmp_path / "ckpt"), delta_every=10,
                     reference_gate=EVERY_RUN)
    job.train(20)
    before = ClusterJob(local=True, batch_size=BATCH)   # the state of the commit at position 10
    before.train(10)
    labels, scores = [], []
    for b in range(10, 20):
        user, item, category, hour, label = before.batch(b)
        ids = {"user": user, "item": item, "category": category}
        scores.append(tf.sigmoid(before.model(ids, hour, training=False)).numpy())
        labels.append(label.numpy())
    got = _qualities(str(tmp_path / "ckpt"))[20]["reference"]
    want = measure(np.concatenate(labels), np.concatenate(scores))
    assert got["examples"] == want["examples"]
    assert got["hist"]["pos"] == want["hist"]["pos"] and got["hist"]["neg"] == want["hist"]["neg"]
    assert abs(got["logloss"] - want["logloss"]) < 1e-6   # float32 scores: sums in another order


def test_async_cluster_training_via_cli_has_the_single_process_keys_and_frequencies(tmp_path):
    root = str(tmp_path / "ckpt")
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, ["-m", "evstore_app", "train-cluster"],
                      ["--cluster", lc.cluster_file, "--checkpoints", root, "--steps", 30, "--batch-size", BATCH,
                       "--delta-every", 10])
    assert (r["resumed_at"], r["position"], r["global_step"], r["commits"]) == (0, 30, 30, 3)
    # The last commit holds every step: restore it into the in-process job (unsharded EVs).
    job = ClusterJob(local=True, batch_size=BATCH, checkpoints=root)
    assert job.resume() == 30
    got, want = job.model.state(), reference(30)
    # Workers ran steps concurrently: values depend on the order, keys and frequencies do not.
    assert_same_keys_and_freqs(got, want)


def test_killed_worker_the_cluster_job_still_trains_every_batch(tmp_path):
    out = str(tmp_path / "state.npz")
    actions = []
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 40, "--batch-size", BATCH,
                                  "--kill-worker-at", 10, "--state-out", out], actions=actions)
        assert ("worker", 1) not in lc.alive()
    assert actions == [("kill", "worker", 1)]
    assert r["position"] == 40
    # Every batch was trained; the step the dead worker was running may have been applied twice
    # (TF re-runs it elsewhere: at least once), so the counts may exceed the reference by one batch.
    assert r["global_step"] in (40, 41)
    got, want = load(out), reference(40)
    for field, _ in FIELDS:
        np.testing.assert_array_equal(got[f"{field}/keys"], want[f"{field}/keys"])
        extra = got[f"{field}/freqs"] - want[f"{field}/freqs"]
        assert extra.min() >= 0 and extra.sum() <= BATCH * (r["global_step"] - 40), field


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """A sync job on a 2-PS cluster, killed whole (chief, PS, workers) after its third commit.

    Returns (root, commits, dumps): its checkpoint root, [(seq, position)] and the directory of
    the state dumps written at each commit (commit-<seq>.npz)."""
    d = tmp_path_factory.mktemp("killed_job")
    root, dumps = str(d / "ckpt"), str(d / "dumps")
    os.makedirs(dumps)
    lines = []
    with LocalCluster(num_ps=2, num_workers=2, directory=str(d)) as lc:
        run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 60, "--sync", "--batch-size", BATCH,
                              "--checkpoints", root, "--delta-every", 10, "--dump-dir", dumps,
                              "--pause-after-commits", 3, "--state-out", str(d / "never.npz")],
                  stop_on="PAUSED", lines_out=lines)
    # The LocalCluster's close() killed the PS and worker processes: the whole job is gone.
    commits = [tuple(int(x) for x in ln.split()[1:]) for ln in lines if ln.startswith("COMMITTED ")]
    return root, commits, dumps


def test_killed_job_resumes_at_the_committed_position_with_the_committed_state(killed_job, tmp_path):
    root, commits, dumps = killed_job
    assert [p for _, p in commits] == [10, 20, 30]
    last_seq = commits[-1][0]
    mine = str(tmp_path / "ckpt")
    shutil.copytree(root, mine)
    out = str(tmp_path / "state.npz")
    with LocalCluster(num_ps=2, num_workers=2, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 60, "--sync", "--batch-size", BATCH,
                                  "--checkpoints", mine, "--delta-every", 10, "--dump-dir", str(tmp_path),
                                  "--state-out", out])
    assert r["resumed_at"] == 30
    # Restored state == the state when the last delta committed (exactly: values, versions, freqs).
    assert_same_state(load(str(tmp_path / "restored.npz")), load(os.path.join(dumps, f"commit-{last_seq}.npz")),
                      atol=0)
    # And the resumed job lost and repeated nothing: 60 batches, as if never interrupted.
    assert r["global_step"] == 60
    assert_same_state(load(out), reference(60))


def test_chain_saved_with_two_shards_restores_into_three_on_a_three_ps_cluster(killed_job, tmp_path):
    root, commits, dumps = killed_job
    mine = str(tmp_path / "ckpt")
    shutil.copytree(root, mine)
    with LocalCluster(num_ps=3, num_workers=1, directory=str(tmp_path)) as lc:
        r = run_chief(lc, CHIEF, ["--cluster", lc.cluster_file, "--steps", 30, "--batch-size", BATCH,
                                  "--checkpoints", mine, "--dump-dir", str(tmp_path),
                                  "--state-out", str(tmp_path / "state.npz")])
    assert r["resumed_at"] == 30
    assert r["devices"]["item"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(3)]
    assert_same_state(load(str(tmp_path / "restored.npz")), load(os.path.join(dumps, f"commit-{commits[-1][0]}.npz")),
                      atol=0)
