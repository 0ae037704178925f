"""`model.fit` trains `evstore.keras.Embedding(collective=True)` synchronously:
2 worker processes under MultiWorkerMirroredStrategy, each fed its slice of
every global batch by the strategy, end equal to one process running
`model.fit` on the global batches (fit_model.py)."""
import os
import signal
import sys

import numpy as np
import pytest

import sync_harness as h


@pytest.fixture(scope="module")
def s3_root(tmp_path_factory):
    """A root on moto's S3 server (a process on 127.0.0.1): the workers' only shared storage."""
    sys.path.insert(0, os.path.join(os.path.dirname(h.HERE), "checkpoint"))
    import checkpoint
    from s3_server import moto_bucket
    with moto_bucket(tmp_path_factory.mktemp("moto") / "moto.log",
                     before_stop=checkpoint.lease._release_all) as bucket:
        yield f"s3://{bucket}/fit"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_root):
    d = tmp_path_factory.mktemp("fit")
    ports = h.ports(2)
    logs = [str(d / f"{n}.log") for n in ("single", "w0", "w1")]
    script = os.path.join(h.HERE, "fit_model.py")
    procs = [h.start([script, d / "single.npz", "single"], logs[0])]
    procs += [h.start([script, d / f"w{r}.npz", "worker", "--rank", r, "--ports", ports, "--ckpt", s3_root],
                      logs[1 + r]) for r in range(2)]
    codes = h.wait_all(procs, logs)
    assert codes == [0, 0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    return np.load(d / "single.npz"), [np.load(d / f"w{r}.npz") for r in range(2)]


def test_the_workers_fit_committed_to_s3_restores_into_one_process_exactly(runs, s3_root, tmp_path):
    """After model.fit (and the eviction) both workers commit a full to the S3 root (each uploads
    its own part); one process restores it: the whole table (values, slots, versions, frequencies,
    filtered counts) and the Dense layer exactly as the workers held them at the commit."""
    _, workers = runs
    log = str(tmp_path / "restore.log")
    p = h.start([os.path.join(h.HERE, "fit_model.py"), tmp_path / "one.npz", "restore", "--ckpt", s3_root], log)
    assert h.wait_all([p], [log]) == [0], h.tail(log)
    one = np.load(tmp_path / "one.npz")
    order = np.argsort(one["keys"], kind="stable")
    ck = [{k[3:]: w[k] for k in w.files if k.startswith("ck_")} for w in workers]
    assert len(one["keys"]) == sum(len(c["keys"]) for c in ck) > 0
    for field in ("values", "versions", "freqs", "slot_m", "slot_v"):
        keys, want = _table(ck, field)
        np.testing.assert_array_equal(one["keys"][order], keys)
        np.testing.assert_array_equal(one[field][order], want, err_msg=field)
    fk = np.concatenate([c["filtered_keys"] for c in ck])
    ff = np.concatenate([c["filtered_freqs"] for c in ck])
    o1, o2 = np.argsort(one["filtered_keys"]), np.argsort(fk)
    np.testing.assert_array_equal(one["filtered_keys"][o1], fk[o2])
    np.testing.assert_array_equal(one["filtered_freqs"][o1], ff[o2])
    np.testing.assert_array_equal(one["kernel"], workers[0]["kernel"])
    np.testing.assert_array_equal(one["bias"], workers[0]["bias"])


def _table(npzs, field):
    keys = np.concatenate([z["keys"] for z in npzs])
    vals = np.concatenate([z[field] for z in npzs])
    order = np.argsort(keys, kind="stable")
    return keys[order], vals[order]


def test_each_worker_holds_the_keys_it_owns_and_together_the_single_process_keys(runs):
    single, workers = runs
    from evstore import shard_index
    for r, w in enumerate(workers):
        assert len(w["keys"]) > 0 and (shard_index(w["keys"], 2).numpy() == r).all()
    np.testing.assert_array_equal(_table(workers, "values")[0], np.sort(single["keys"]))


def test_fit_values_and_adam_slots_equal_single_process_fit(runs):
    single, workers = runs
    for field in ("values", "slot_m", "slot_v"):
        np.testing.assert_allclose(_table(workers, field)[1], _table([single], field)[1], atol=1e-5, rtol=0,
                                   err_msg=field)


def test_fit_versions_frequencies_and_filter_counts_equal_single_process_exactly(runs):
    single, workers = runs
    for field in ("versions", "freqs"):
        np.testing.assert_array_equal(_table(workers, field)[1], _table([single], field)[1], err_msg=field)
    keys = np.concatenate([w["filtered_keys"] for w in workers])
    freqs = np.concatenate([w["filtered_freqs"] for w in workers])
    o, o0 = np.argsort(keys), np.argsort(single["filtered_keys"])
    np.testing.assert_array_equal(keys[o], single["filtered_keys"][o0])
    np.testing.assert_array_equal(freqs[o], single["filtered_freqs"][o0])


def test_global_step_eviction_runs_per_shard_and_equals_single_process(runs):
    single, workers = runs
    assert sum(int(w["evicted"]) for w in workers) == int(single["evicted"]) > 0
    keys = np.concatenate([w["kept_keys"] for w in workers])
    values = np.concatenate([w["kept_values"] for w in workers])
    o, o0 = np.argsort(keys), np.argsort(single["kept_keys"])
    assert 0 < len(keys) < len(_table(workers, "values")[0])
    np.testing.assert_array_equal(keys[o], single["kept_keys"][o0])
    np.testing.assert_allclose(values[o], single["kept_values"][o0], atol=1e-5, rtol=0)
    for w in workers:   # each shard evicted among its own keys only
        assert set(w["kept_keys"].tolist()) <= set(w["keys"].tolist())


def test_fit_dense_layer_is_all_reduced_like_single_process(runs):
    single, workers = runs
    for w in workers:
        for name in ("kernel", "bias"):
            np.testing.assert_allclose(w[name], single[name], atol=1e-5, rtol=0, err_msg=name)
        assert int(w["iterations"]) == int(single["iterations"]) == 5


@pytest.fixture(scope="module")
def callback_runs(tmp_path_factory):
    """2 workers fit 2 epochs with checkpoint.CheckpointCallback(root, delta_every=2) on a root both see;
    then the root's newest commit restored into one process (no strategy)."""
    d = tmp_path_factory.mktemp("fitcb")
    root, ports = str(d / "root"), h.ports(2)
    script = os.path.join(h.HERE, "fit_model.py")
    logs = [str(d / f"w{r}.log") for r in range(2)]
    procs = [h.start([script, d / f"w{r}.npz", "worker", "--rank", r, "--ports", ports, "--fit-ckpt", root,
                      "--epochs", 2], logs[r]) for r in range(2)]
    codes = h.wait_all(procs, logs)
    assert codes == [0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    log = str(d / "one.log")
    assert h.wait_all([h.start([script, d / "one.npz", "restore", "--ckpt", root], log)], [log]) == [0], h.tail(log)
    return root, [np.load(d / f"w{r}.npz") for r in range(2)], np.load(d / "one.npz")


def test_the_fit_callback_commits_collectively_between_steps_under_multi_worker_mirrored(callback_runs):
    """Each commit is one manifest naming both workers' shards, at the steps the callback chose, and the
    last (the end of the epoch, after its eviction) restores into one process as the workers' state."""
    root, workers, one = callback_runs
    assert all(str(w["manager"]) == "SyncCheckpointManager" for w in workers)
    ms = _manifests(root)
    assert [(m["kind"], m["metadata"]) for m in ms] == [("full", {"epoch": 0, "step": 2}),
                                                        ("delta", {"epoch": 0, "step": 4}),
                                                        ("delta", {"epoch": 1, "step": 0}),
                                                        ("delta", {"epoch": 1, "step": 2}),
                                                        ("delta", {"epoch": 1, "step": 4}),
                                                        ("delta", {"epoch": 2, "step": 0})]
    keys = np.concatenate([w["kept_keys"] for w in workers])
    values = np.concatenate([w["kept_values"] for w in workers])
    order, mine = np.argsort(keys), np.argsort(one["keys"])
    np.testing.assert_array_equal(one["keys"][mine], keys[order])
    np.testing.assert_array_equal(one["values"][mine], values[order])
    np.testing.assert_array_equal(one["kernel"], workers[0]["kernel"])


def test_a_fit_killed_mid_epoch_under_multi_worker_mirrored_resumes_and_ends_as_the_uninterrupted_one(
        callback_runs, tmp_path):
    """Worker 1 SIGKILLs itself after step 3 of epoch 1 (the last commit: step 2); worker 0, stuck in the
    step's collectives, is killed too (the job restarts as a whole). Both workers started again with the
    callback restore their shards of that commit, skip the 2 trained batches of epoch 1 and end with every
    shard's rows, Adam slots, versions and frequencies, the Dense layer and the step count as the
    uninterrupted 2-epoch fit (callback_runs) has them."""
    _, uninterrupted, _ = callback_runs
    root, script = str(tmp_path / "root"), os.path.join(h.HERE, "fit_model.py")
    ports = h.ports(2)
    logs = [str(tmp_path / f"killed{r}.log") for r in range(2)]
    procs = [h.start([script, tmp_path / f"killed{r}.npz", "worker", "--rank", r, "--ports", ports,
                      "--fit-ckpt", root, "--epochs", 2] + (["--kill", "1,3"] if r == 1 else []), logs[r])
             for r in range(2)]
    try:
        assert procs[1].wait(timeout=240) == -9, h.tail(logs[1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert not any((tmp_path / f"killed{r}.npz").exists() for r in range(2))
    ports = h.ports(2)
    logs = [str(tmp_path / f"resumed{r}.log") for r in range(2)]
    procs = [h.start([script, tmp_path / f"resumed{r}.npz", "worker", "--rank", r, "--ports", ports,
                      "--fit-ckpt", root, "--epochs", 2], logs[r]) for r in range(2)]
    assert h.wait_all(procs, logs) == [0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    resumed = [np.load(tmp_path / f"resumed{r}.npz") for r in range(2)]
    import json
    assert [json.loads(str(w["resumed"]))["step"] for w in resumed] == [2, 2]
    assert [json.loads(str(w["resumed"]))["epoch"] for w in resumed] == [1, 1]
    for field in ("values", "versions", "freqs", "slot_m", "slot_v", "kept_values"):
        for got, want in zip(resumed, uninterrupted):
            k = "kept_keys" if field == "kept_values" else "keys"
            o, o0 = np.argsort(got[k]), np.argsort(want[k])
            np.testing.assert_array_equal(got[k][o], want[k][o0])
            np.testing.assert_array_equal(got[field][o], want[field][o0], err_msg=field)
    for got, want in zip(resumed, uninterrupted):
        for name in ("kernel", "bias", "iterations"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the commits after the resume carry the quality the uninterrupted fit's commits carry: the same
    # histograms (the summed loss is a difference of running sums there, so equal to rounding)
    after, want = _manifests(root)[-2:], _manifests(callback_runs[0])[-2:]
    assert [m["metadata"] for m in after] == [m["metadata"] for m in want] == [{"epoch": 1, "step": 4},
                                                                               {"epoch": 2, "step": 0}]
    for got, exp in ((m["quality"], w["quality"]) for m, w in zip(after, want)):
        assert {k: got[k] for k in ("auc", "examples", "label_rate")} == {k: exp[k] for k in ("auc", "examples",
                                                                                            "label_rate")}
        assert (got["hist"]["pos"], got["hist"]["neg"]) == (exp["hist"]["pos"], exp["hist"]["neg"])
        assert got["hist"]["loss"] == pytest.approx(exp["hist"]["loss"], rel=1e-12)


def _manifests(root):
    import json
    return sorted((json.load(open(os.path.join(root, d, "MANIFEST.json"))) for d in os.listdir(root)
                   if d.startswith(("full-", "delta-"))), key=lambda m: m["seq"])


def test_a_collective_fit_commit_carries_the_quality_of_every_workers_examples_of_its_steps(callback_runs):
    """Compiled with checkpoint.QualityMetric, each worker gives a commit the histograms of its own slice of
    the steps since the previous commit and the chief adds them: the record counts every example of those
    global batches (8 per step, 4 per worker), and exactly their positive labels (a label above 0.5)."""
    import fit_model
    root, _, _ = callback_runs
    _, y = fit_model.examples()
    positive = (y.reshape(-1) > 0.5).reshape(fit_model.STEPS, fit_model.GLOBAL_BATCH).sum(axis=1)
    covered = {(0, 2): (0, 2), (0, 4): (2, 4), (1, 0): (4, 5), (1, 2): (0, 2), (1, 4): (2, 4), (2, 0): (4, 5)}
    ms = _manifests(root)
    assert len(ms) == len(covered)
    for m in ms:
        lo, hi = covered[(m["metadata"]["epoch"], m["metadata"]["step"])]
        q = m["quality"]
        assert q["examples"] == (hi - lo) * fit_model.GLOBAL_BATCH, m["metadata"]
        assert sum(q["hist"]["pos"]) == int(positive[lo:hi].sum()), m["metadata"]
        assert q["label_rate"] == positive[lo:hi].sum() / q["examples"]
        assert q["logloss"] > 0 and 0 <= q["auc"] <= 1
