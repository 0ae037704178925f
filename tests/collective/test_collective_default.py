"""In a MultiWorkerMirroredStrategy's scope an EV is collective by default, as
TF's variables become mirrored there with no extra argument: 2 worker
processes build `evstore.keras.Embedding` and `evstore.EmbeddingVariable`
without `collective=`, `model.fit` them, and end equal to one process on the
global batches (fit_model.py). Before, each worker trained its own whole
table, silently apart from the single process."""
import os

import numpy as np
import pytest

import sync_harness as h


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("default")
    ports = h.ports(2)
    logs = [str(d / f"{n}.log") for n in ("single", "w0", "w1")]
    script = os.path.join(h.HERE, "fit_model.py")
    procs = [h.start([script, d / "single.npz", "single"], logs[0])]
    procs += [h.start([script, d / f"w{r}.npz", "worker", "--rank", r, "--ports", ports, "--default-collective"],
                      logs[1 + r]) for r in range(2)]
    codes = h.wait_all(procs, logs)
    assert codes == [0, 0, 0], "\n".join(f"--- {lg}\n{h.tail(lg)}" for lg in logs)
    return np.load(d / "single.npz"), [np.load(d / f"w{r}.npz") for r in range(2)]


def _by_key(npzs, field):
    keys = np.concatenate([z["keys"] for z in npzs])
    vals = np.concatenate([z[field] for z in npzs])
    order = np.argsort(keys, kind="stable")
    return keys[order], vals[order]


def test_an_ev_and_the_keras_layer_built_in_the_scope_are_collective(runs):
    _, workers = runs
    for w in workers:
        assert str(w["layer_kind"]) == str(w["raw_kind"]) == "CollectiveEmbeddingVariable"


def test_an_unsharded_table_built_directly_in_the_scope_is_refused(runs):
    _, workers = runs
    for w in workers:
        assert "2 workers would be a whole table per worker" in str(w["direct_error"])
        assert "evstore.EmbeddingVariable(...)" in str(w["direct_error"])


def test_each_worker_holds_only_its_keys_and_together_the_single_process_keys(runs):
    single, workers = runs
    from evstore import shard_index
    for r, w in enumerate(workers):
        assert len(w["keys"]) > 0 and (shard_index(w["keys"], 2).numpy() == r).all()
    np.testing.assert_array_equal(_by_key(workers, "values")[0], np.sort(single["keys"]))


def test_default_scope_fit_equals_single_process(runs):
    single, workers = runs
    for field in ("values", "slot_m", "slot_v"):
        np.testing.assert_allclose(_by_key(workers, field)[1], _by_key([single], field)[1], atol=1e-5, rtol=0,
                                   err_msg=field)
    for field in ("versions", "freqs"):
        np.testing.assert_array_equal(_by_key(workers, field)[1], _by_key([single], field)[1], err_msg=field)
    for w in workers:
        np.testing.assert_allclose(w["kernel"], single["kernel"], atol=1e-5, rtol=0)


def test_a_keras_file_of_a_table_split_over_workers_is_refused_pointing_at_checkpoint_manager(runs):
    _, workers = runs
    for w in workers:
        assert "split over 2 workers" in str(w["save_error"]) and "CheckpointManager" in str(w["save_error"])
