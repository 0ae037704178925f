"""gRPC under many concurrent calls, every answer's status and rows checked.

    .venv/bin/python -m bench.serving.bench_grpc_concurrency                  # ~2 minutes
    .venv/bin/python -m bench.serving.bench_grpc_concurrency --levels 8 64 --seconds 5

h2load (bench_serving_net.py) does not read gRPC's status trailer, so its
request rate says nothing of what the answers were. Here a grpc.aio client
(tensorflow-serving-api's request, grpcio's transport) in its own process
keeps --levels concurrent Predict calls in flight over --channels HTTP/2
connections for --seconds each, and counts every call's status code; each OK
answer's outputs are compared with the first answer's (the same request, no
deltas applied: they must be equal). Also reported: the server's CPU per call
and resident memory after each level (/proc). The served model is the
demo's, as in bench_serving_net.py, at batch 1.

Prints one JSON line (the last line of stdout) and a markdown table on stderr.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np


from bench.harness.peers import module_cmd
from bench.harness.rss import rss_mib
from bench.serving import bench_serving_net as net


def client(args):
    """The load process: prints {"ok", "codes", "mismatched", "rps", "p50_ms", "p99_ms"}."""
    import asyncio

    import grpc
    from tensorflow_serving.apis import predict_pb2

    body = open(args.client, "rb").read()

    async def main():
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{args.port}") for _ in range(args.channels)]
        calls = [ch.unary_unary("/tensorflow.serving.PredictionService/Predict") for ch in channels]
        first = predict_pb2.PredictResponse.FromString(await calls[0](body, timeout=60))
        want = {k: v.tensor_content for k, v in first.outputs.items()}
        codes, lat, mismatched = {}, [], 0
        stop = time.perf_counter() + args.seconds

        async def worker(call):
            nonlocal mismatched
            while time.perf_counter() < stop:
                t = time.perf_counter()
                try:
                    raw = await call(body, timeout=60)
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] = codes.get(e.code().name, 0) + 1
                    continue
                lat.append(time.perf_counter() - t)
                codes["OK"] = codes.get("OK", 0) + 1
                got = predict_pb2.PredictResponse.FromString(raw)
                if {k: v.tensor_content for k, v in got.outputs.items()} != want:
                    mismatched += 1

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(calls[i % len(calls)]) for i in range(args.level)])
        dt = time.perf_counter() - t0
        for ch in channels:
            await ch.close()
        a = np.asarray(lat) * 1e3
        return {"ok": codes.get("OK", 0), "codes": codes, "mismatched": mismatched, "rps": len(lat) / dt,
                "p50_ms": float(np.percentile(a, 50)) if a.size else None,
                "p99_ms": float(np.percentile(a, 99)) if a.size else None}

    print(json.dumps(asyncio.run(main())))


def run(args):
    wd = tempfile.mkdtemp(prefix="evstore-bench-grpc-conc-")
    net.log("training and exporting the demo model ...")
    _, _, root, export, probe = net.make_job(wd)
    req = net.predict_request(net.rows(probe, 1))
    path = os.path.join(wd, "predict.pb")
    with open(path, "wb") as f:
        f.write(req.SerializeToString())
    server = net.Server(export, root, 0.25, wd, "serve")
    results = []
    try:
        for level in args.levels:
            channels = max(1, min(args.channels, level))
            cpu0 = net._cpu_s(server.proc.pid)
            out = subprocess.run(module_cmd(__spec__.name) + ["--client", path, "--port", str(server.grpc),
                                  "--level", str(level), "--channels", str(channels), "--seconds", str(args.seconds)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            calls = sum(r["codes"].values())
            r.update(level=level, channels=channels,
                     cpu_us_per_call=(net._cpu_s(server.proc.pid) - cpu0) / max(1, calls) * 1e6,
                     server_rss_mb=rss_mib(pid=server.proc.pid))
            net.log(f"{level} in flight over {channels} connection(s): {r}")
            results.append(r)
    finally:
        server.stop()
    rows = ["| calls in flight | connections | calls/s | p50 ms | p99 ms | statuses | answers differing | "
            "server CPU us/call | server RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        statuses = ", ".join(f"{k} {v:,}" for k, v in sorted(r["codes"].items()))
        rows.append(f"| {r['level']} | {r['channels']} | {r['rps']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{statuses} | {r['mismatched']} | {r['cpu_us_per_call']:.0f} | {r['server_rss_mb']:,.0f} |")
    net.log("\n".join(rows))
    print(json.dumps({"seconds": args.seconds, "levels": results}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 64, 256, 1024], help="concurrent calls")
    ap.add_argument("--channels", type=int, default=16, help="HTTP/2 connections at most (one per call below it)")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--level", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
