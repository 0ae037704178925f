"""`model.fit` with checkpoint.CheckpointCallback under a ParameterServerStrategy
with a ClusterCoordinator (a real cluster: chief, PS and worker processes).
Keras 3 has no ClusterCoordinator support in `model.fit`: its input fails on the
coordinator before any callback runs, so nothing trains and nothing is
committed. This pins what docs/guides/keras.md says; a Keras that trains there
fails it, and the guide must then say what the callback does."""
import os

from cluster_harness import run_chief
from evstore_app.cluster import LocalCluster


def test_keras_fit_under_parameter_server_strategy_fails_before_the_callback_runs_and_commits_nothing(tmp_path):
    root = tmp_path / "root"
    with LocalCluster(num_ps=1, num_workers=1, directory=str(tmp_path / "cluster")) as lc:
        r = run_chief(lc, "cluster_chief_fit.py", ["--cluster", lc.cluster_file, "--root", root])
    assert r["table"] == "UnshardedEmbeddingVariable"
    assert r["error"][0] == "ValueError" and "ClusterCoordinator.create_per_worker_dataset" in r["error"][1]
    assert r["began"] is False and r["iterations"] == 0
    assert not os.path.exists(root)
