"""A client of a sharded fleet run on a host of its own (gRPC channels have I/O
threads of their own, so they cannot borrow the test thread's namespace):

    python shard_call.py stage TARGET FLEET ADDR...   # Stage on each shard; prints each answer's JSON
    python shard_call.py predict ADDR [OFFSET]         # a Predict of ckpt_model.probe_inputs() (users + OFFSET)
                                                       # at the front; prints {"code", "details", "version",
                                                       # "outputs"}
"""
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "checkpoint"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402


def stage(target, fleet, addresses):
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            body = json.dumps({"target": int(target), "fleet": int(fleet)}).encode()
            print(ch.unary_unary("/evstore.ServingShard/Stage")(body, timeout=120).decode(), flush=True)


def predict(address, offset=0):
    import numpy as np
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from ckpt_model import probe_inputs
    from serving_loader.tensor_proto import array_to_tensor

    users, items = probe_inputs()
    users = users + offset
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "ctr"
    array_to_tensor(users, req.inputs["users"])
    array_to_tensor(items, req.inputs["items"])
    with grpc.insecure_channel(address) as ch:
        try:
            resp = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=60)
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details()}), flush=True)
            return
    out = np.frombuffer(resp.outputs["outputs"].tensor_content, np.float32)
    print(json.dumps({"code": "OK", "version": resp.model_spec.version.value, "outputs": out.tolist()}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "stage":
        stage(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        predict(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
