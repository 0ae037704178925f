"""The soak's clients: gRPC Predict of the trainer's probe inputs, back to back, to each
replica, each answer reported with the version it names.

tests/soak/soak.py runs `predict_loop` in a thread per replica of its own process
(every process on this machine), or, with --hosts, runs this file as a
process on the client's host (`python soak_client.py --query-every S
--inputs JSON ADDRESS...`), which prints one JSON line per answer or failed call:
  {"i": replica index, "t": time.monotonic(), "v": version, "o": [outputs]}
  {"i": replica index, "t": time.monotonic(), "e": "<grpc status code>"}
(CLOCK_MONOTONIC is the machine's: the soak compares these times with its own.)
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# A restarted replica listens again within seconds: reconnect at least once a second.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


def predict_loop(target, stopping, on_answer, on_error, query_every, inputs, model="soak"):
    """Calls Predict of `inputs` ({name: ndarray}) on `target()` ("host:port", or None while the replica is
    down) until `stopping` is set: `on_answer(t, version, outputs)` per answer, `on_error(t, code)` per
    failed call (then a new channel)."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    for name, value in inputs.items():
        req.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    channel = address = stub = None
    while not stopping.is_set():
        cur = target()
        if cur is None:
            time.sleep(0.1)
            continue
        if cur != address:
            if channel is not None:
                channel.close()
            channel, address = grpc.insecure_channel(cur, options=CHANNEL_OPTIONS), cur
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        try:
            answer = stub.Predict(req, timeout=30)
        except grpc.RpcError as e:
            on_error(time.monotonic(), e.code().name)
            channel.close()
            channel = address = None
            time.sleep(0.2)
            continue
        on_answer(time.monotonic(), answer.model_spec.version.value,
                  tf.make_ndarray(answer.outputs["outputs"]).ravel())
        time.sleep(query_every)
    if channel is not None:
        channel.close()


def encode_inputs(inputs):
    """{name: ndarray} as soak_client.py's --inputs JSON."""
    return json.dumps({k: [str(np.asarray(v).dtype), np.asarray(v).tolist()] for k, v in inputs.items()})


def decode_inputs(text):
    return {k: np.asarray(v, dtype=dtype) for k, (dtype, v) in json.loads(text).items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--query-every", type=float, default=0.05)
    p.add_argument("--model", default="soak")
    p.add_argument("--inputs", required=True, help='the request\'s inputs: JSON {name: [dtype, nested list]}')
    p.add_argument("addresses", nargs="+", help="host:port of each replica's gRPC listener")
    a = p.parse_args(argv)
    inputs = decode_inputs(a.inputs)
    lock = threading.Lock()

    def emit(**record):
        line = json.dumps(record)
        with lock:
            print(line, flush=True)

    stopping = threading.Event()
    threads = [threading.Thread(target=predict_loop, daemon=True, args=(
        lambda addr=addr: addr, stopping,
        lambda t, v, o, i=i: emit(i=i, t=t, v=v, o=[float(x) for x in o]),
        lambda t, code, i=i: emit(i=i, t=t, e=code), a.query_every, inputs, a.model))
        for i, addr in enumerate(a.addresses)]
    for t in threads:
        t.start()
    print("ready", file=sys.stderr, flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
