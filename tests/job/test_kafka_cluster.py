"""`evstore train-cluster --kafka`: a parameter-server job whose workers each
consume their own partitions (their `evstore server` processes run the
consumers), the chief recording every partition's offset in each commit.
Exactly once is checked with the tables' frequencies (sum of frequencies per
key = events per key) after a worker is killed mid-batch and restarted, and
after the chief is killed mid-save."""
import json
import os
import random
import signal
import subprocess
import sys

import pytest

pytest.importorskip("confluent_kafka")

from kafka_events import counts, create_topic, group_offsets, set_group_offsets, wait_for, wait_until  # noqa: E402

from evstore_app.cluster import LocalCluster  # noqa: E402
from evstore_app.job.kafka_broker import Broker  # noqa: E402
from evstore_app.job.kafka_produce import produce_rows  # noqa: E402

PARTS = 4


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = Broker(log=str(tmp_path_factory.mktemp("kafka") / "broker.log")).start()
    yield b
    b.stop()


def clicks(n, seed):
    """Events with the click stream's columns, over few keys (each key's count matters)."""
    r = random.Random(seed)
    return [{"user": r.randrange(60), "item": r.randrange(200), "category": r.randrange(12),
             "hour": r.random(), "click": int(r.random() < 0.3)} for _ in range(n)]


def chief(lc, root, bootstrap, topic, n, env=None, log=None):
    """`evstore train-cluster --kafka` as a process (the chief of `lc`), its stderr to `log`."""
    cmd = [sys.executable, "-m", "evstore_app", "train-cluster", "--cluster", lc.cluster_file, "--checkpoints",
           str(root), "--kafka", bootstrap, "--topic", topic, "--group", topic, "--max-events", str(n),
           "--batch-size", "64", "--delta-every-steps", "4"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}, start_new_session=True)


def finish(p, log):
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, open(log).read()[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def frequencies(root):
    """{field: {key: frequency}} of the newest commit of a PS job's root, restored into one process."""
    import checkpoint
    from evstore_app.job.cluster_train import FIELDS, CtrModel
    model = CtrModel()
    meta = checkpoint.CheckpointManager(str(root), model, lease=False).restore()
    s = model.state()
    return {f: dict(zip(s[f"{f}/keys"].tolist(), s[f"{f}/freqs"].tolist())) for f, _ in FIELDS}, meta


def assert_trained_once(root, rows, topic):
    freqs, meta = frequencies(root)
    for field in ("user", "item", "category"):
        assert freqs[field] == counts(rows, field), field
    ends = {str(p): len(rows[p::PARTS]) for p in range(PARTS)}
    assert meta["examples"] == len(rows) and meta["position"]["kafka"] == {topic: ends}


def test_a_worker_killed_mid_batch_is_rolled_back_and_restarted_at_the_commits_offsets(broker, tmp_path):
    """Worker 1 stops holding a batch it took from the broker (consumed, not trained) and is
    SIGKILLed: TensorFlow re-runs its step on worker 0, the chief sees one attempt too many,
    restores the last commit and every worker seeks to its offsets; worker 1, restarted, reads
    its partitions from there."""
    rows = clicks(1200, seed=1)
    create_topic(broker.bootstrap, "wkill", PARTS)
    produce_rows(broker.bootstrap, "wkill", rows, partitions=PARTS)
    marker, log = tmp_path / "worker.hit", str(tmp_path / "chief.log")
    env = {("worker", 1): {"EVSTORE_FAILPOINT": "kafka-batch-consumed@4", "EVSTORE_FAILPOINT_FILE": str(marker)}}
    with LocalCluster(num_ps=1, num_workers=2, directory=str(tmp_path / "c"), task_env=env) as lc:
        p = chief(lc, tmp_path / "root", broker.bootstrap, "wkill", len(rows), log=log)
        wait_for(marker, p)
        lc.kill("worker", 1)
        wait_until(lambda: "restoring the last commit" in open(log).read(), p)
        lc.restart("worker", 1, env={})
        summary = finish(p, log)
    assert any("re-ran a step" in why for why in summary["rollbacks"]), summary
    assert_trained_once(tmp_path / "root", rows, "wkill")


def test_a_chief_killed_mid_save_resumes_at_the_commits_offsets_whatever_the_group_says(broker, tmp_path):
    """The chief is SIGKILLed while writing a checkpoint (its PS tables sealed for an export that
    never ends), and the group's offsets are set back to 0; the workers keep running,
    and the new chief restores the last commit and has them seek to its offsets."""
    rows = clicks(1200, seed=2)
    create_topic(broker.bootstrap, "ckill", PARTS)
    produce_rows(broker.bootstrap, "ckill", rows, partitions=PARTS)
    root, log, marker = tmp_path / "root", str(tmp_path / "chief.log"), tmp_path / "chief.hit"
    with LocalCluster(num_ps=1, num_workers=2, directory=str(tmp_path / "c")) as lc:
        p = chief(lc, root, broker.bootstrap, "ckill", len(rows), log=log,
                  env={"EVSTORE_FAILPOINT": "before-manifest@3", "EVSTORE_FAILPOINT_FILE": str(marker)})
        wait_for(marker, p)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        set_group_offsets(broker.bootstrap, "ckill", "ckill", {q: 0 for q in range(PARTS)})
        summary = finish(chief(lc, root, broker.bootstrap, "ckill", len(rows), log=log), log)
    assert summary["resumed_at"]["messages"] > 0
    assert_trained_once(root, rows, "ckill")
    assert group_offsets(broker.bootstrap, "ckill", "ckill", PARTS) == {q: 300 for q in range(PARTS)}
