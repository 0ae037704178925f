"""Which runtime carries a serving front's lookups to its shards: grpcio or TensorFlow's distributed runtime.

    .venv/bin/python -m bench.serving.bench_shard_runtime            # ~1 minute

The same work behind both: a shard process holds a [--rows, --dim] float32 table and answers the rows of
the keys it is sent; the front (this process) sends --keys distinct row ids and waits for the rows,
--calls times per size, one call at a time (a request's fan-out waits for its slowest shard).

  grpcio  the shard serves evstore.ServingShard/Lookup as serving_loader/shard_service.py does (a
          PredictRequest of keys in, a PredictResponse of rows out, grpcio's server and channel);
  tf      the shard is a tf.distribute.Server task (`/job:shard/task:0`, as `evstore server` starts
          one); the table is a tf.Variable placed there and the lookup a tf.function whose gather
          runs on that task (the front is a client of the cluster: experimental_connect_to_cluster).

Reported: p50 / p99 of one round trip (ms) per runtime and key count; the last line is JSON.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench.harness.paths import ROOT
from bench.harness.peers import module_cmd


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_grpc(port, rows, dim):
    from concurrent import futures

    import grpc
    from tensorflow_serving.apis import predict_pb2

    from serving_loader.shard_service import SERVICE
    from serving_loader.tensor_proto import TensorLimits, array_to_tensor, tensor_to_array

    table = np.random.default_rng(0).normal(size=(rows, dim)).astype(np.float32)
    limits = TensorLimits(64 << 20)

    def lookup(request, context):
        req = predict_pb2.PredictRequest.FromString(request)
        keys = tensor_to_array("emb", req.inputs["emb"], (np.int64, [None], "DT_INT64"), limits)
        resp = predict_pb2.PredictResponse()
        resp.model_spec.version.value = req.model_spec.version.value
        array_to_tensor(table[keys], resp.outputs["emb"])
        return resp.SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[grpc.method_handlers_generic_handler(
        SERVICE, {"Lookup": grpc.unary_unary_rpc_method_handler(lookup)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def serve_tf(port):
    import tensorflow as tf

    cluster = tf.train.ClusterSpec({"shard": [f"127.0.0.1:{port}"]})
    server = tf.distribute.Server(cluster, job_name="shard", task_index=0, protocol="grpc")
    print("ready", flush=True)
    server.join()


def start(mode, port, args):
    p = subprocess.Popen(module_cmd("bench.serving.bench_shard_runtime", "--serve", mode, "--port", port,
                                    "--rows", args.rows, "--dim", args.dim),
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    return p


def pct(xs, q):
    return round(float(np.percentile(xs, q)) * 1e3, 3)


def time_calls(call, sizes, calls, rows):
    out = {}
    rng = np.random.default_rng(1)
    for n in sizes:
        keys = [np.sort(rng.choice(rows, n, replace=False)).astype(np.int64) for _ in range(16)]
        for k in keys[:4]:
            call(k)   # warm
        ts = []
        for i in range(calls):
            t0 = time.perf_counter()
            call(keys[i % len(keys)])
            ts.append(time.perf_counter() - t0)
        out[n] = {"p50_ms": pct(ts, 50), "p99_ms": pct(ts, 99)}
    return out


def bench_grpc(args, port):
    import grpc
    from tensorflow_serving.apis import predict_pb2

    from serving_loader.shard_service import SERVICE
    from serving_loader.tensor_proto import array_to_tensor

    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = ch.unary_unary(f"/{SERVICE}/Lookup")

    def call(keys):
        req = predict_pb2.PredictRequest()
        req.model_spec.version.value = 1
        array_to_tensor(keys, req.inputs["emb"])
        resp = predict_pb2.PredictResponse.FromString(stub.future(req.SerializeToString(), timeout=10).result())
        return np.frombuffer(resp.outputs["emb"].tensor_content, np.float32)

    return time_calls(call, args.keys, args.calls, args.rows)


def bench_tf(args, port):
    import tensorflow as tf

    cluster = tf.train.ClusterSpec({"shard": [f"127.0.0.1:{port}"], "front": [f"127.0.0.1:{free_port()}"]})
    tf.config.experimental_connect_to_cluster(cluster, job_name="front", task_index=0)
    with tf.device("/job:shard/task:0"):
        table = tf.Variable(np.random.default_rng(0).normal(size=(args.rows, args.dim)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def lookup(keys):
        with tf.device("/job:shard/task:0"):
            rows = tf.gather(table, keys)
        with tf.device("/job:front/task:0"):
            return tf.identity(rows)

    return time_calls(lambda k: lookup(k).numpy(), args.keys, args.calls, args.rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--keys", type=int, nargs="+", default=[8, 512])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--serve", choices=["grpc", "tf"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "grpc":
        return serve_grpc(args.port, args.rows, args.dim)
    if args.serve == "tf":
        return serve_tf(args.port)
    result = {}
    for mode, fn in (("grpcio", bench_grpc), ("tf", bench_tf)):
        port = free_port()
        p = start("grpc" if mode == "grpcio" else "tf", port, args)
        try:
            result[mode] = fn(args, port)
        finally:
            p.kill()
            p.wait()
        for n, r in result[mode].items():
            print(f"{mode:7s} {n:5d} keys x {args.dim}: p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms",
                  file=sys.stderr, flush=True)
    print(json.dumps({"rows": args.rows, "dim": args.dim, "calls": args.calls, "result": result}))


if __name__ == "__main__":
    main()
