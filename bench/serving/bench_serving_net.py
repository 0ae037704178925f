"""Serving over the network: `evstore serve` (REST and gRPC) against the same
export's in-process signature call rate, measured side by side in one run.

    .venv/bin/python -m bench.serving.bench_serving_net                 # ~5 minutes
    .venv/bin/python -m bench.serving.bench_serving_net --seconds 5     # quicker

The served model is the demo's (evstore_app/job/synthetic.py SPEC: three EVs,
a dense feature, MLP 64-32), trained on the synthetic click stream for a few
batches, exported (serving_loader.export_serving_model) and checkpointed.

  in-process   one thread calls the export's `serving_default` signature
               (ServingModel's loaded concrete function) on batch-1 tensors,
               back to back: calls/s. Interleaved with the network runs
               (--rounds rounds of in-process, REST, gRPC); each round gives
               ratios, the medians are reported.
  REST         wrk (C, 2 threads) with a lua script POSTing one fixed
               :predict body ("instances", batch 1 or 64), --connections
               keep-alive connections, --seconds each: requests/s, p50, p99.
  gRPC         h2load (C, nghttp2's HTTP/2 load generator: the gRPC
               counterpart of wrk) POSTing one fixed gRPC frame (the
               PredictRequest serialized once) to
               /tensorflow.serving.PredictionService/Predict over --connections
               connections, one call in flight on each: requests/s, p50, p99
               (from its per-request log). h2load does not read gRPC's status
               trailer, so the same bytes are first sent with the real
               PredictionServiceStub and checked, and the run counts only if the
               server's batcher answered at least as many requests as h2load saw
               succeed (its /metrics). Also reported: a Python load loop in its
               own process (grpc.aio, same connections), whose own CPU competes
               with the server's on a small machine.
  CPU          the server process's user + system CPU seconds per request
               during each network run (/proc/<pid>/stat).
  live         p99 of REST predict (wrk, same load) while the trainer in
               this process trains continuously and commits a delta every
               --delta-every seconds, which the server (polling every 0.25 s)
               applies, against the same with the trainer training but not
               committing (idle); --rounds interleaved pairs, medians; p99
               ratio live / idle.
Prints one JSON line (the last line of stdout); progress on stderr.
"""
import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd

TARGETS = {"served_over_inprocess": 1.0, "p99_ms": 20.0, "grpc_over_rest": 1.0, "live_p99_ratio": 2.0}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- the job ------------------------------------------------------------------------
def make_job(workdir, seed=0, warmup=20):
    from evstore_app.job.synthetic import SPEC, ClickStream
    from evstore_app.job.trainer import Trainer
    import serving_loader

    root, export = os.path.join(workdir, "ckpt"), os.path.join(workdir, "export")
    spec = dict(SPEC, batch_size=256)
    trainer = Trainer(spec, root, seed=seed)
    stream = ClickStream(seed=seed, batch_size=256)
    serving_loader.export_serving_model(trainer.model, export)
    batches = stream.batches()
    for _ in range(warmup):
        b, (cols, y) = next(batches)
        trainer.train(trainer.inputs(cols), y, b + 1)
    trainer.manager.save_full(metadata=trainer.metadata())
    b, (cols, _) = next(batches)
    probe = {k: np.asarray(v) for k, v in trainer.inputs(cols).items()}
    return trainer, batches, root, export, probe


def rows(probe, n):
    return {k: v[:n] for k, v in probe.items()}


def inprocess_rate(sm, x, seconds):
    import tensorflow as tf

    t = {k: tf.constant(v) for k, v in x.items()}
    for _ in range(50):
        sm._fn(**t)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            sm._fn(**t)
        n += 100
    return n / (time.perf_counter() - t0)


# ---- servers and load generators ------------------------------------------------------
class Server:
    def __init__(self, export, root, poll_every, workdir, name, extra=()):
        cmd = [sys.executable, "-m", "evstore_app.cli", "serve", "--export", export, "--checkpoints", root,
               "--port", "0", "--rest_api_port", "0", "--model_name", "m", "--poll-every", str(poll_every), *extra]
        self.log = open(os.path.join(workdir, f"server-{name}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        deadline = time.time() + 300
        self.rest = self.grpc = None
        while self.rest is None or self.grpc is None:
            try:
                ln = lines.get(timeout=1)
            except queue.Empty:
                ln = ""
            if ln.startswith("serving "):
                self.rest = int(ln.rsplit(":", 1)[1])
            elif ln.startswith("grpc "):
                self.grpc = int(ln.rsplit(":", 1)[1])
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start (see {self.log.name})")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _ms(text):
    v, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk(port, body, connections, seconds, workdir):
    script = os.path.join(workdir, "post.lua")
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(body)}\n")
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script,
                          f"http://127.0.0.1:{port}/v1/models/m:predict"], capture_output=True, text=True,
                         check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": _ms(lat["50"]), "p99_ms": _ms(lat["99"]),
            "errors": int(errors.group(1)) if errors else 0}


def _cpu_s(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _batched(rest_port):
    """The server's count of requests answered by its batcher (/metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{rest_port}/metrics", timeout=30).read().decode()
    return float(re.search(r"^evstore_serving_batched_requests_total (\S+)$", text, re.M).group(1))


def predict_request(x):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    req = predict_pb2.PredictRequest()
    req.model_spec.name = "m"
    for k, v in x.items():
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return req


def grpc_h2load(server, x, connections, seconds, workdir, refresh_s=1.0):
    """h2load against server's gRPC port; see the module docstring."""
    import grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    req = predict_request(x)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:   # the frame is a valid Predict
        answer = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=60)
    n = len(next(iter(x.values())))
    assert all(t.tensor_shape.dim[0].size == n for t in answer.outputs.values()), answer
    body = req.SerializeToString()
    frame, log_path = os.path.join(workdir, "predict.grpc"), os.path.join(workdir, "h2load.log")
    with open(frame, "wb") as f:
        f.write(b"\0" + len(body).to_bytes(4, "big") + body)
    time.sleep(refresh_s + 0.2)
    before, cpu0 = _batched(server.rest), _cpu_s(server.proc.pid)
    out = subprocess.run(["h2load", "-c", str(connections), "-m", "1", "-t", "1", "-D", str(seconds), "-d", frame,
                          "-H", "content-type: application/grpc", "-H", "te: trailers", "--log-file", log_path,
                          f"http://127.0.0.1:{server.grpc}/tensorflow.serving.PredictionService/Predict"],
                         capture_output=True, text=True, check=True).stdout
    cpu = _cpu_s(server.proc.pid) - cpu0
    ok = int(re.search(r"status codes: (\d+) 2xx", out).group(1))
    time.sleep(refresh_s + 0.2)
    answered = _batched(server.rest) - before
    if answered < ok:
        raise RuntimeError(f"h2load saw {ok} HTTP 200s but the server's batcher answered only {answered:.0f} requests: "
                           "some calls failed in their gRPC status")
    lat = np.array([int(ln.split()[2]) for ln in open(log_path) if ln.strip()]) / 1e3
    rps = float(re.search(r"finished in .*?, ([\d.]+) req/s", out).group(1))
    return {"rps": rps, "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "cpu_us_per_req": cpu / max(ok, 1) * 1e6, "calls": ok}


def wrk_cpu(server, body, connections, seconds, workdir):
    cpu0 = _cpu_s(server.proc.pid)
    r = wrk(server.rest, body, connections, seconds, workdir)
    r["cpu_us_per_req"] = (_cpu_s(server.proc.pid) - cpu0) / max(r["rps"] * seconds, 1) * 1e6
    return r


def grpc_load(port, x, connections, seconds, client="aio"):
    """Runs this file's --grpc-client mode in its own process; returns its JSON."""
    req = predict_request(x)
    with tempfile.NamedTemporaryFile(suffix=".pb", delete=False) as f:
        f.write(req.SerializeToString())
    try:
        out = subprocess.run(module_cmd(__spec__.name) + ["--grpc-client", f.name, "--port", str(port),
                              "--connections", str(connections), "--seconds", str(seconds), "--client", client],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return json.loads(out.strip().splitlines()[-1])


def grpc_client(args):
    import asyncio

    import grpc

    body = open(args.grpc_client, "rb").read()
    if args.client == "threads":
        ch = grpc.insecure_channel(f"127.0.0.1:{args.port}")
        call = ch.unary_unary("/tensorflow.serving.PredictionService/Predict")
        call(body)
        lat = [[] for _ in range(args.connections)]
        stop = time.perf_counter() + args.seconds

        def worker(out):
            while time.perf_counter() < stop:
                t = time.perf_counter()
                call(body)
                out.append(time.perf_counter() - t)

        ts = [threading.Thread(target=worker, args=(lat[i],)) for i in range(args.connections)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        a = np.concatenate([np.asarray(x) for x in lat]) * 1e3
        print(json.dumps({"rps": a.size / dt, "p50_ms": float(np.percentile(a, 50)),
                          "p99_ms": float(np.percentile(a, 99))}))
        return

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}") as ch:
            call = ch.unary_unary("/tensorflow.serving.PredictionService/Predict")   # bytes in, bytes out
            await call(body)
            lat = []
            stop = time.perf_counter() + args.seconds

            async def worker():
                while time.perf_counter() < stop:
                    t = time.perf_counter()
                    await call(body)
                    lat.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            await asyncio.gather(*[worker() for _ in range(args.connections)])
            dt = time.perf_counter() - t0
            a = np.asarray(lat) * 1e3
            return {"rps": len(lat) / dt, "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}

    print(json.dumps(asyncio.run(main())))


def instances(x):
    keys = sorted(x)
    n = len(x[keys[0]])
    return json.dumps({"instances": [{k: x[k][i].tolist() for k in keys} for i in range(n)]})


def markdown(res):
    T = res["targets"]

    def mark(ok):
        return "✓" if ok else "✗"

    def row(name, r, rows=1, extra=""):
        cpu = f"{r['cpu_us_per_req']:,.0f}" if "cpu_us_per_req" in r else ""
        return (f"| {name} | {r['rps']:,.0f} | {r['rps'] * rows:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
                f" {cpu} | {extra} |")

    ip = res["inprocess_calls_per_s"]
    out = [f"\n### Serving over the network: `evstore serve`, REST and gRPC, {res['connections']} connections\n",
           "The demo's model (3 EVs, MLP 64-32). In-process = one thread calling the export's `serving_default` "
           "signature back to back (batch 1); REST = wrk (C, keep-alive); gRPC = h2load (C, HTTP/2, one fixed "
           "gRPC frame, answers checked through the server's batcher count); gRPC (Python) = a grpc.aio load loop in "
           "its own process. CPU = the server's CPU per request. Batch 1 rows: medians of "
           f"{len(res['rounds'])} interleaved rounds (in-process, REST, gRPC, gRPC Python); batching on, timeout 0.\n",
           "| load | requests/s | rows/s | p50 ms | p99 ms | server CPU us/request | vs target |",
           "|---|---|---|---|---|---|---|",
           f"| in-process `serving_default`, 1 thread, batch 1 | {ip:,.0f} | {ip:,.0f} | | | | baseline |",
           row("REST batch 1", res["rest_b1"], 1,
               f"{res['rest_over_inprocess']:.2f}x in-process (≥ {T['served_over_inprocess']}x "
               f"{mark(res['rest_over_inprocess'] >= T['served_over_inprocess'])}), p99 ≤ {T['p99_ms']:.0f} ms "
               f"{mark(res['rest_b1']['p99_ms'] <= T['p99_ms'])}"),
           row("gRPC batch 1", res["grpc_b1"], 1,
               f"{res['grpc_over_inprocess']:.2f}x in-process, {res['grpc_over_rest']:.2f}x REST (≥ "
               f"{T['grpc_over_rest']}x {mark(res['grpc_over_rest'] >= T['grpc_over_rest'])})"),
           row("gRPC (Python grpc.aio client) batch 1", res["grpc_py_b1"], 1, f"{res['grpc_py_over_rest']:.2f}x REST"),
           f"| in-process `serving_default`, 1 thread, batch 64 | {res['inprocess_b64_calls_per_s']:,.0f} | "
           f"{res['inprocess_b64_calls_per_s'] * 64:,.0f} | | | | |",
           row("REST batch 64", res["rest_b64"], 64), row("gRPC batch 64", res["grpc_b64"], 64),
           row("REST batch 1, trainer training, not committing (idle)", res["idle"], 1),
           row(f"REST batch 1, applying a delta every ~{res.get('delta_every', 0.5)} s (live: "
               f"{res['live']['deltas_committed']} deltas over {len(res['live_rounds'])} runs)", res["live"], 1,
               f"p99 {res['live_p99_ratio']:.2f}x idle (≤ {T['live_p99_ratio']}x "
               f"{mark(res['live_p99_ratio'] <= T['live_p99_ratio'])})")]
    rounds = res["rounds"]
    out.append("\nPer round (in-process calls/s; REST / in-process; gRPC / REST): " + "; ".join(
        f"{x['inprocess_calls_per_s']:,.0f}, {x['rest_over_inprocess']:.2f}x, {x['grpc_over_rest']:.2f}x" for x in rounds)
        + ". Live / idle p99 per pair: " + ", ".join(
        f"{x['live']['p99_ms'] / x['idle']['p99_ms']:.2f}x" for x in res["live_rounds"]) + ".")
    return "\n".join(out) + "\n"


# ---- the run ----------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=10, help="seconds per load run")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved in-process / REST / gRPC rounds at batch 1")
    ap.add_argument("--delta-every", type=float, default=0.5, help="live: seconds between deltas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-timeout-micros", type=int, default=0, help="the server's --batch_timeout_micros")
    ap.add_argument("--grpc-client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--client", default="aio", choices=["aio", "threads"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.grpc_client:
        return grpc_client(args)
    missing = [t for t, pkg in (("wrk", "wrk"), ("h2load", "nghttp2-client")) if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"bench_serving_net.py needs {' and '.join(missing)} (apt-get install "
                         + " ".join({"wrk": "wrk", "h2load": "nghttp2-client"}[t] for t in missing) + ")")
    from serving_loader import ServingModel

    workdir = tempfile.mkdtemp(prefix="evstore-bench-net-")
    res = {"connections": args.connections, "seconds": args.seconds}
    try:
        trainer, batches, root, export, probe = make_job(workdir, args.seed)
        sm = ServingModel(export, root)
        one, sixty_four = rows(probe, 1), rows(probe, 64)
        server = Server(export, root, 0.25, workdir, "serve",
                        ["--batch_timeout_micros", str(args.batch_timeout_micros)])
        try:
            # batch 1: in-process, REST, gRPC, interleaved --rounds times (the machine is shared)
            for r in range(args.rounds):
                ip = inprocess_rate(sm, one, args.seconds / 2)
                rest = wrk_cpu(server, instances(one), args.connections, args.seconds, workdir)
                g = grpc_h2load(server, one, args.connections, args.seconds, workdir)
                gpy = grpc_load(server.grpc, one, args.connections, args.seconds)
                res.setdefault("rounds", []).append({"inprocess_calls_per_s": ip, "rest_b1": rest, "grpc_b1": g,
                                                     "grpc_py_b1": gpy,
                                                     "rest_over_inprocess": rest["rps"] / ip,
                                                     "grpc_over_inprocess": g["rps"] / ip,
                                                     "grpc_over_rest": g["rps"] / rest["rps"],
                                                     "grpc_py_over_rest": gpy["rps"] / rest["rps"]})
                log(f"round {r}: in-process {ip:.0f} calls/s, REST {rest}, gRPC (h2load) {g}, gRPC (Python) {gpy}")
            for k in ("rest_over_inprocess", "grpc_over_inprocess", "grpc_over_rest", "grpc_py_over_rest"):
                res[k] = float(np.median([x[k] for x in res["rounds"]]))
            for k in ("rest_b1", "grpc_b1", "grpc_py_b1"):
                res[k] = {m: float(np.median([x[k][m] for x in res["rounds"] if m in x[k]]))
                          for m in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req") if m in res["rounds"][0][k]}
            res["inprocess_calls_per_s"] = float(np.median([x["inprocess_calls_per_s"] for x in res["rounds"]]))
            res["rest_b64"] = wrk_cpu(server, instances(sixty_four), args.connections, args.seconds, workdir)
            log(f"REST batch 64: {res['rest_b64']}")
            res["grpc_b64"] = grpc_h2load(server, sixty_four, args.connections, args.seconds, workdir)
            log(f"gRPC batch 64: {res['grpc_b64']}")
            res["inprocess_b64_calls_per_s"] = inprocess_rate(sm, sixty_four, args.seconds / 2)

            # live: the same load with the trainer running, alternately committing deltas or not
            stop, commit = threading.Event(), threading.Event()
            deltas = []

            def train():
                last = time.time()
                while not stop.is_set():
                    b, (cols, y) = next(batches)
                    trainer.train(trainer.inputs(cols), y, b + 1)
                    if commit.is_set() and time.time() - last >= args.delta_every:
                        deltas.append(trainer.manager.save_delta(metadata=trainer.metadata()))
                        last = time.time()

            t = threading.Thread(target=train, daemon=True)
            t.start()
            try:
                for r in range(args.rounds):
                    commit.clear()
                    time.sleep(1.0)            # a delta being applied finishes
                    idle = wrk(server.rest, instances(one), args.connections, args.seconds, workdir)
                    commit.set()
                    before = len(deltas)
                    live = wrk(server.rest, instances(one), args.connections, args.seconds, workdir)
                    live["deltas_committed"] = len(deltas) - before
                    res.setdefault("live_rounds", []).append({"idle": idle, "live": live})
                    log(f"round {r}: idle (trainer running, no commits) {idle}; live (committing) {live}")
                status = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{server.rest}/v1/models/m"],
                                                   capture_output=True, text=True).stdout)
                res["served_version"] = int(status["model_version_status"][0]["version"])
                res["newest_delta"] = deltas[-1] if deltas else None
            finally:
                stop.set()
                t.join()
            for k in ("idle", "live"):
                res[k] = {m: float(np.median([x[k][m] for x in res["live_rounds"]])) for m in ("rps", "p50_ms", "p99_ms")}
            res["live"]["deltas_committed"] = int(sum(x["live"]["deltas_committed"] for x in res["live_rounds"]))
            res["live_p99_ratio"] = res["live"]["p99_ms"] / res["idle"]["p99_ms"]
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["targets"] = TARGETS
    res["delta_every"] = args.delta_every
    res["markdown"] = markdown(res)
    log(res["markdown"])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
