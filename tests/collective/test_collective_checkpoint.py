"""Checkpoints of synchronous training (checkpoint/sync.py): 2 workers save
their shards into one chain (a full, then a delta), which restores into 1 and
3 workers exactly, and whose one-process restore exports a served model of
the whole tables."""
import json
import os

import numpy as np
import pytest

import sync_harness as h

SCRIPT = os.path.join(h.HERE, "sync_model.py")
FIELDS = ("values", "versions", "freqs", "slot_m", "slot_v")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync_ckpt")
    root = str(d / "ckpt")
    ports = h.ports(2)
    logs = [str(d / f"w{r}.log") for r in range(2)]
    procs = [h.start([SCRIPT, d / f"w{r}.npz", "worker", "--rank", r, "--ports", ports, "--ckpt", root], logs[r])
             for r in range(2)]
    assert h.wait_all(procs, logs) == [0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    return d, root, [np.load(d / f"w{r}.npz") for r in range(2)]


@pytest.fixture(scope="module")
def restored(chain):
    d, root, _ = chain
    ports = h.ports(3)
    logs = [str(d / "r1.log")] + [str(d / f"r3_{r}.log") for r in range(3)]
    procs = [h.start([SCRIPT, d / "r1.npz", "restore", "--ckpt", root, "--serving", d / "served"], logs[0])]
    procs += [h.start([SCRIPT, d / f"r3_{r}.npz", "restore", "--ckpt", root, "--rank", r, "--ports", ports],
                      logs[1 + r]) for r in range(3)]
    assert h.wait_all(procs, logs) == [0] * 4, "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    return np.load(d / "r1.npz"), [np.load(d / f"r3_{r}.npz") for r in range(3)]


def _table(npzs, tag):
    keys = np.concatenate([z[f"{tag}_keys"] for z in npzs])
    order = np.argsort(keys, kind="stable")
    return keys[order], {f: np.concatenate([z[f"{tag}_{f}"] for z in npzs])[order] for f in FIELDS}


def test_one_manifest_per_commit_names_every_shard(chain):
    d, root, _ = chain
    dirs = sorted((x for x in os.listdir(root) if x.startswith(("full-", "delta-"))), key=lambda x: x.split("-")[1])
    assert [x.split("-")[0] for x in dirs] == ["full", "delta"]
    for x in dirs:
        with open(os.path.join(root, x, "MANIFEST.json")) as f:
            m = json.load(f)
        assert sorted(m["evs"]) == ["table_a/part_0", "table_a/part_1", "table_b/part_0", "table_b/part_1"]
        assert {e["shard"]["count"] for e in m["evs"].values()} == {2}
        assert set(m["dense"]) >= {"w", "v", "bias", "global_step", "optimizer/iteration"}
        assert not [f for f in os.listdir(os.path.join(root, x)) if "part" in f]   # parts joined into one bundle
    assert m["global_step"] == 6 and m["metadata"] == {"step": 6}


@pytest.mark.parametrize("tag", ["a", "b"])
def test_restore_into_one_process_holds_every_row_exactly(chain, restored, tag):
    _, _, trained = chain
    one, _ = restored
    k0, f0 = _table(trained, tag)
    k1, f1 = _table([one], tag)
    np.testing.assert_array_equal(k1, k0)
    for f in FIELDS:
        np.testing.assert_array_equal(f1[f], f0[f], err_msg=f)
    for name in ("w", "v", "bias"):
        np.testing.assert_array_equal(one[name], trained[0][name])
    assert int(one["iterations"]) == 6


@pytest.mark.parametrize("tag", ["a", "b"])
def test_restore_into_three_workers_spreads_the_rows_by_owner(chain, restored, tag):
    _, _, trained = chain
    _, three = restored
    from evstore import shard_index
    for r, z in enumerate(three):
        assert (shard_index(z[f"{tag}_keys"], 3).numpy() == r).all()
    k0, f0 = _table(trained, tag)
    k3, f3 = _table(three, tag)
    np.testing.assert_array_equal(k3, k0)
    for f in FIELDS:
        np.testing.assert_array_equal(f3[f], f0[f], err_msg=f)


def test_serving_export_of_the_restored_whole_tables(restored):
    one, _ = restored
    assert one["served_got"].size > 0
    np.testing.assert_allclose(one["served_got"], one["served_want"], rtol=1e-6, atol=1e-7)


def test_a_synchronous_commit_refuses_a_quality_record_that_cannot_be_added_to_the_other_workers(tmp_path):
    """A worker's quality= is its scored examples or its record with `hist` (histograms add up across the
    workers); a record without `hist` is refused before anything is written."""
    import evstore
    from checkpoint.sync import SyncCheckpointManager
    ev = evstore.EmbeddingVariable("sync_quality_refused", 2)
    mgr = SyncCheckpointManager(str(tmp_path / "root"), [ev])
    with pytest.raises(ValueError, match="record with `hist`.* got dict without `hist`"):
        mgr.save_full(quality={"auc": 0.7, "logloss": 0.5, "examples": 10, "label_rate": 0.5})
    assert mgr.last_committed is None and not os.path.exists(tmp_path / "root" / "full-1")
