"""An EV built in a tf.distribute strategy's scope trains as with no strategy
or is refused at construction with an error that says what to use, never
silently wrong (evstore/distribute.py). Single-process strategies with two
replicas (two logical CPU devices) run in their own process
(strategy_scopes.py); MultiWorkerMirroredStrategy is tests/collective's."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def scopes():
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "strategy_scopes.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_mirrored_strategy_of_several_devices_refuses_ev_and_layer_saying_what_to_use(scopes):
    entry = scopes["MirroredStrategy(2 devices)"]
    assert entry["built"] is None and entry["max_diff"] is None
    for message in (entry["error"], entry["layer_error"], entry["direct_error"]):
        assert "MirroredStrategy of 2 devices" in message
        assert "CentralStorageStrategy" in message and "MultiWorkerMirroredStrategy" in message


@pytest.mark.parametrize("name", ["MirroredStrategy(1 device)", "CentralStorageStrategy(2 devices)",
                                  "OneDeviceStrategy"])
def test_strategies_that_keep_one_table_train_as_with_no_strategy(scopes, name):
    entry = scopes[name]
    assert entry["built"] == "UnshardedEmbeddingVariable" and entry["error"] is None
    assert entry["direct_error"] is None
    assert entry["layer_error"] is None and entry["max_diff"] <= 1e-6


def test_a_multi_worker_scope_builds_collective_tables_and_refuses_what_would_train_apart(scopes):
    entry = scopes["MultiWorkerMirroredStrategy(1 worker)"]
    assert entry["built"] == entry["layer_built"] == "CollectiveEmbeddingVariable"
    assert entry["direct_built"] == "UnshardedEmbeddingVariable"   # one worker: a table of its own is whole
    assert "shards= / devices= do not apply" in entry["shards_error"]
    assert "collective=False" in entry["layer_not_collective_error"]
    assert "leave collective unset" in entry["layer_not_collective_error"]
