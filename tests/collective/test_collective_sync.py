"""Synchronous training with CollectiveEmbeddingVariables (evstore/collective.py):
2 worker processes under MultiWorkerMirroredStrategy train exactly like one
process on the concatenated batches. The batches (sync_model.py) hold a hot id
in every example, a step where worker 1's batch is empty, steps where a
worker (then every worker) has no id of table B, and an empty step."""
import os

import numpy as np
import pytest

import sync_harness as h



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync")
    ports = h.ports(2)
    logs = [str(d / f"{n}.log") for n in ("single", "w0", "w1")]
    procs = [h.start([os.path.join(h.HERE, "sync_model.py"), d / "single.npz", "single"],
                     logs[0])]
    procs += [h.start([os.path.join(h.HERE, "sync_model.py"), d / f"w{r}.npz", "worker", "--rank", r, "--ports", ports],
                      logs[1 + r])
              for r in range(2)]
    codes = h.wait_all(procs, logs)
    assert codes == [0, 0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    return np.load(d / "single.npz"), [np.load(d / f"w{r}.npz") for r in range(2)]


def _table(npzs, tag, field):
    """(keys, field) of table `tag` over the given exports, sorted by key."""
    keys = np.concatenate([z[f"{tag}_keys"] for z in npzs])
    vals = np.concatenate([z[f"{tag}_{field}"] for z in npzs])
    order = np.argsort(keys, kind="stable")
    return keys[order], vals[order]


@pytest.mark.parametrize("tag", ["a", "b"])
def test_the_workers_shards_hold_exactly_the_single_process_keys(runs, tag):
    single, workers = runs
    assert sorted(np.concatenate([w[f"{tag}_keys"] for w in workers]).tolist()) == sorted(single[f"{tag}_keys"].tolist())
    from evstore import shard_index
    for r, w in enumerate(workers):   # each key lives on its owner only
        assert (shard_index(w[f"{tag}_keys"], 2).numpy() == r).all()


@pytest.mark.parametrize("tag", ["a", "b"])
def test_values_and_slots_equal_single_process_training(runs, tag):
    single, workers = runs
    fields = ["values"] + [f[len(tag) + 1:] for f in single.files if f.startswith(f"{tag}_slot_")]
    assert len(fields) == 3   # Adam: m and v
    for field in fields:
        k1, v1 = _table(workers, tag, field)
        k0, v0 = _table([single], tag, field)
        np.testing.assert_array_equal(k1, k0)
        np.testing.assert_allclose(v1, v0, atol=1e-5, rtol=0, err_msg=field)


@pytest.mark.parametrize("tag", ["a", "b"])
def test_versions_and_frequencies_equal_single_process_exactly(runs, tag):
    single, workers = runs
    for field in ("versions", "freqs"):
        np.testing.assert_array_equal(_table(workers, tag, field)[1], _table([single], tag, field)[1], err_msg=field)


def test_filter_counts_add_up_over_workers(runs):
    single, workers = runs
    keys = np.concatenate([w["a_filtered_keys"] for w in workers])
    freqs = np.concatenate([w["a_filtered_freqs"] for w in workers])
    o, o0 = np.argsort(keys), np.argsort(single["a_filtered_keys"])
    np.testing.assert_array_equal(keys[o], single["a_filtered_keys"][o0])
    np.testing.assert_array_equal(freqs[o], single["a_filtered_freqs"][o0])
    assert len(keys) > 0   # the CounterFilter(2) left some keys waiting


def test_dense_variables_are_all_reduced_like_single_process(runs):
    single, workers = runs
    for w in workers:
        for name in ("w", "v", "bias"):
            np.testing.assert_allclose(w[name], single[name], atol=1e-5, rtol=0, err_msg=name)
        assert int(w["iterations"]) == int(single["iterations"]) == 6


@pytest.mark.parametrize("tag", ["a", "b"])
def test_whole_table_export_on_every_worker_equals_single_process_table(runs, tag):
    single, workers = runs
    order0 = np.argsort(single[f"{tag}_keys"])
    for w in workers:
        keys = w[f"whole_{tag}_keys"]
        order = np.argsort(keys)
        np.testing.assert_array_equal(keys[order], single[f"{tag}_keys"][order0])
        for field in ("values", "slot_m", "slot_v"):
            np.testing.assert_allclose(w[f"whole_{tag}_{field}"][order], single[f"{tag}_{field}"][order0],
                                       atol=1e-5, rtol=0, err_msg=field)
        for field in ("versions", "freqs"):
            np.testing.assert_array_equal(w[f"whole_{tag}_{field}"][order], single[f"{tag}_{field}"][order0])
        fk = w[f"whole_{tag}_filtered_keys"]
        np.testing.assert_array_equal(np.sort(fk), np.sort(single[f"{tag}_filtered_keys"]))
