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

from kafka_events import (counts, create_topic, dead_letters, group_offsets, produce, set_group_offsets,  # noqa: E402
                          wait_for, wait_until)

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


def chief(lc, root, bootstrap, topic, n, *flags, env=None, log=None):
    """`evstore train-cluster --kafka` as a process (the chief of `lc`), its stderr to `log`."""
    cmd = [sys.executable, "-m", "evstore_app", "train-cluster", "--cluster", lc.cluster_file, "--checkpoints",
           str(root), "--kafka", bootstrap, "--topic", topic, "--group", topic, "--max-events", str(n),
           "--batch-size", "64", "--delta-every-steps", "4", *flags]
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



def stale_run(tmp_path, broker, topic, seed, failpoint, release_after):
    """A chief SIGKILLed while worker 1 is held at `failpoint` in one of its steps, a new chief, and
    worker 1 let go once the new chief's log shows `release_after` for the second time; returns the
    new chief's summary and worker 1's log."""
    rows = clicks(1200, seed=seed)
    create_topic(broker.bootstrap, topic, PARTS)
    produce_rows(broker.bootstrap, topic, rows, partitions=PARTS)
    root, log = tmp_path / "root", str(tmp_path / "chief.log")
    marker, release = tmp_path / "worker.hit", tmp_path / "worker.release"
    env = {("worker", 1): {"EVSTORE_FAILPOINT": failpoint, "EVSTORE_FAILPOINT_FILE": str(marker),
                           "EVSTORE_FAILPOINT_RELEASE": str(release)}}
    with LocalCluster(num_ps=1, num_workers=2, directory=str(tmp_path / "c"), task_env=env) as lc:
        first = chief(lc, root, broker.bootstrap, topic, len(rows), log=log)
        wait_for(marker, first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        p = chief(lc, root, broker.bootstrap, topic, len(rows), log=log)
        wait_until(lambda: open(log).read().count(release_after) == 2, p)
        release.touch()
        summary = finish(p, log)
    assert_trained_once(root, rows, topic)
    return summary, open(tmp_path / "c" / "worker-1.log").read()


def test_a_step_of_a_killed_chief_run_after_the_new_chiefs_restore_consumes_nothing(broker, tmp_path):
    """Worker 1 is held at the start of a step the first chief dispatched; the chief is SIGKILLed,
    a new one fences the workers and restores the last commit, and only then does the step go on:
    it takes no batch (the worker's consumer stays where it was, no round is rolled back) and
    every event is trained once."""
    summary, worker_log = stale_run(tmp_path, broker, "stale", 3, "kafka-step-start@3", "resuming at")
    assert "fenced a step of chief" in worker_log and "consumed nothing" in worker_log
    assert summary["rollbacks"] == [], summary


def test_a_step_of_a_killed_chief_holding_a_batch_changes_nothing_of_the_new_chiefs_state(broker, tmp_path):
    """Worker 1 holds a batch it took for the first chief's step when that chief is SIGKILLed; the
    new chief's fence waits for that step, which then trains its batch into the dead chief's own
    variables (TensorFlow isolates each chief's resources on the tasks): the new chief reads those
    events again and every event is trained once."""
    stale_run(tmp_path, broker, "held", 4, "kafka-batch-consumed@3", "fencing the steps")


def test_a_worker_hung_in_a_killed_chiefs_step_stops_a_new_chiefs_start_with_an_error_naming_it(broker, tmp_path):
    """Worker 1 is held, alive, inside a batch it took for the first chief's step when that chief is
    SIGKILLed: the new chief's fence waits for that step, and after --fence-timeout the start stops
    with an error naming worker 1 and its address, before restoring or training anything."""
    rows = clicks(600, seed=5)
    create_topic(broker.bootstrap, "hung", PARTS)
    produce_rows(broker.bootstrap, "hung", rows, partitions=PARTS)
    root, log = tmp_path / "root", str(tmp_path / "chief.log")
    marker, release = tmp_path / "worker.hit", tmp_path / "worker.release"
    env = {("worker", 1): {"EVSTORE_FAILPOINT": "kafka-batch-consumed@3", "EVSTORE_FAILPOINT_FILE": str(marker),
                           "EVSTORE_FAILPOINT_RELEASE": str(release)}}
    with LocalCluster(num_ps=1, num_workers=2, directory=str(tmp_path / "c"), task_env=env) as lc:
        first = chief(lc, root, broker.bootstrap, "hung", len(rows), log=log)
        wait_for(marker, first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        started = len(open(log).read())
        p = chief(lc, root, broker.bootstrap, "hung", len(rows), "--fence-timeout", "2", log=log)
        out, _ = p.communicate(timeout=300)
        release.touch()
        second = open(log).read()[started:]
    assert p.returncode == 1 and out == "", second[-4000:]
    assert (f"evstore train-cluster: worker 1 ({lc.spec['worker'][1]}) did not answer the fence within 2 s"
            in second), second[-4000:]
    assert "resuming at" not in second


def test_bad_messages_are_dead_lettered_by_the_worker_that_read_them(broker, tmp_path):
    """Messages that do not parse or lack a column are skipped by the worker that read them and
    produced to --dead-letter-topic, headers naming their partition and offset; the good ones
    are trained once."""
    rows = clicks(400, seed=5)
    bad = [(0, b"not json at all"), (1, b'{"user": 3, "item": 4, "category": 1, "hour": 1}'), (3, b"[1, 2]")]
    create_topic(broker.bootstrap, "bad", PARTS)
    produce(broker.bootstrap, "bad", rows, partitions=PARTS, raw=bad)
    log = str(tmp_path / "chief.log")
    with LocalCluster(num_ps=1, num_workers=2, directory=str(tmp_path / "c")) as lc:
        finish(chief(lc, tmp_path / "root", broker.bootstrap, "bad", len(rows) + len(bad),
                     "--dead-letter-topic", "bad-dead", log=log), log)
    freqs, meta = frequencies(tmp_path / "root")
    for field in ("user", "item", "category"):
        assert freqs[field] == counts(rows, field), field
    assert meta["examples"] == len(rows) and meta["position"]["bad"] == len(bad)
    got = dead_letters(broker.bootstrap, "bad-dead", len(bad))
    origin = {(int(dict(m.headers())["evstore.partition"]), int(dict(m.headers())["evstore.offset"])) for m in got}
    assert origin == {(p, len(rows[p::PARTS])) for p, _ in bad}
    assert {m.value() for m in got} == {v for _, v in bad}


def test_until_event_time_is_refused_at_start_in_a_parameter_server_job(tmp_path):
    p = subprocess.run([sys.executable, "-m", "evstore_app", "train-cluster", "--cluster", str(tmp_path / "c.json"),
                        "--checkpoints", str(tmp_path / "root"), "--kafka", "127.0.0.1:1", "--topic", "t",
                        "--until-event-time", "2026-11-28T00:00:00Z"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1].startswith("evstore train-cluster: --until-event-time is not supported")
    assert not (tmp_path / "root").exists()
