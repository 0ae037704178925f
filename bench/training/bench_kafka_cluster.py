"""A parameter-server job from Kafka, each worker consuming its own partitions
(`evstore train-cluster --kafka`), against the same job on the chief-shipped
synthetic stream (`evstore train-cluster`, batches built by the chief and
sent to the workers as step arguments), same cluster, same run:

    .venv/bin/python -m bench.training.bench_kafka_cluster            # 40k events, 1 PS, 2 workers
    .venv/bin/python -m bench.training.bench_kafka_cluster --events 100000 --ps 2 --workers 2

The Kafka run reads N events (the synthetic stream's first N/batch batches,
produced before it starts to a topic of 2 x workers partitions); the other
trains the same N/batch batches. Each is a fresh root, committing every
--delta-every-steps steps. examples/s: from each summary's seconds (chief
start-up, connection and the first round's tracing included), and steady:
the examples between the first and the last commit holding examples over the
time between them (commit lines timestamped as the chief prints them). Results:
bench/results/kafka-cluster-<UTC time>.json.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.harness.paths import write_result


def chief(cluster_file, root, batch_size, *args):
    """Runs one chief; returns its summary with "steady_examples_per_s": the examples between its first
    and last commit with examples over the time between them (each commit line timestamped as read)."""
    cmd = [sys.executable, "-m", "evstore_app", "train-cluster", "--cluster", cluster_file, "--checkpoints", root,
           "--batch-size", str(batch_size), *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    commits, tail = [], []
    for line in p.stderr:
        tail = (tail + [line])[-40:]
        m = re.match(r"committed seq=\d+ (position|messages)=(\d+)", line)
        if m:
            n = int(m.group(2)) * (batch_size if m.group(1) == "position" else 1)
            if n:
                commits.append((time.time(), n))
    out = p.stdout.read()
    if p.wait() != 0:
        raise RuntimeError("".join(tail))
    res = json.loads(out.strip().splitlines()[-1])
    (t0, n0), (t1, n1) = commits[0], commits[-1]
    res["steady_examples_per_s"] = round((n1 - n0) / (t1 - t0)) if t1 > t0 else None
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=40000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--ps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--delta-every-steps", type=int, default=20)
    a = ap.parse_args(argv)
    from evstore_app.cluster import LocalCluster
    from evstore_app.job.kafka_broker import Broker
    from evstore_app.job.kafka_produce import ensure_topic, produce_rows
    from evstore_app.job.synthetic import ClickStream

    steps = a.events // a.batch_size
    n = steps * a.batch_size
    stream = ClickStream(seed=0, batch_size=a.batch_size, users=20_000, items=10_000)
    rows = []
    for b in range(steps):
        cols, y = stream.batch(b)
        rows += [{**{c: cols[c][i].item() for c in cols}, "click": int(y[i])} for i in range(len(y))]
    tmp = tempfile.mkdtemp(prefix="bench-kafka-cluster-")
    parts = 2 * a.workers
    with Broker(log=os.path.join(tmp, "broker.log")) as broker:
        ensure_topic(broker.bootstrap, "clicks", parts)
        t = time.time()
        produce_rows(broker.bootstrap, "clicks", rows, partitions=parts)
        produce_s = time.time() - t
        with LocalCluster(num_ps=a.ps, num_workers=a.workers, directory=os.path.join(tmp, "cluster")) as lc:
            shipped = chief(lc.cluster_file, os.path.join(tmp, "shipped"), a.batch_size, "--steps", steps,
                            "--delta-every-steps", a.delta_every_steps)
            kafka = chief(lc.cluster_file, os.path.join(tmp, "kafka"), a.batch_size, "--kafka", broker.bootstrap,
                          "--topic", "clicks", "--max-events", n, "--delta-every-steps", a.delta_every_steps)
    res = {"events": n, "batch_size": a.batch_size, "ps": a.ps, "workers": a.workers, "partitions": parts,
           "load_avg": os.getloadavg(), "produce_s": round(produce_s, 1),
           "shipped": {"seconds": shipped["seconds"], "examples_per_s": round(n / shipped["seconds"]),
                       "steady_examples_per_s": shipped["steady_examples_per_s"]},
           "kafka": {"seconds": kafka["seconds"], "examples_per_s": round(n / kafka["seconds"]),
                     "steady_examples_per_s": kafka["steady_examples_per_s"],
                     "examples": kafka["examples"], "commits": kafka["commits"], "rollbacks": kafka["rollbacks"]}}
    res["kafka_vs_shipped"] = round(res["kafka"]["examples_per_s"] / res["shipped"]["examples_per_s"], 2)
    res["kafka_vs_shipped_steady"] = round(res["kafka"]["steady_examples_per_s"]
                                           / res["shipped"]["steady_examples_per_s"], 2)
    write_result(f"kafka-cluster-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}", res)


if __name__ == "__main__":
    main()
