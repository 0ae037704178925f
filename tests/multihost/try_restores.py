"""The chief of a CTR job on a cluster that commits a chain, trains on, then
tries restores into its model: `python try_restores.py --cluster FILE
--checkpoints ROOT --steps N --out DIR COPY...`.

It trains batches 0 .. N-1 with a commit every --delta-every, writes the
model's state (every table's rows from every PS, the dense weights, the
global step) to DIR/committed.npz, prints `ACTION damage ps 1` and waits for
the test's `ok` (the test copies ROOT to each COPY, damaging PS 1's part in
some), trains 2 batches more, writes DIR/before.npz, then restores each COPY in
turn into the same model, writing the state after each attempt to
DIR/after-<i>.npz. Prints `RESULT <json>`: {"errors": [each attempt's error
as "<class>: <message>", or null]}.
"""
import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import checkpoint  # noqa: E402
from evstore_app.job.cluster_train import ClusterJob  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--checkpoints", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta-every", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("copies", nargs="+")
    a = p.parse_args()
    job = ClusterJob(a.cluster, checkpoints=a.checkpoints, batch_size=a.batch_size, delta_every=a.delta_every,
                     reference=False)

    def dump(name):
        state = dict(job.model.state(), global_step=job.global_step.numpy())
        np.savez(os.path.join(a.out, name), **state)

    job.train(a.steps, sync=True)
    dump("committed.npz")
    print("ACTION damage ps 1", flush=True)
    if sys.stdin.readline().strip() != "ok":
        raise RuntimeError("no answer to the damage")
    job.train(a.steps + 2, sync=True)
    dump("before.npz")
    errors = []
    for i, root in enumerate(a.copies):
        try:
            checkpoint.CheckpointManager(root, job.model, global_step=job.global_step).restore()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the class and message are what the test checks
            errors.append(f"{type(e).__name__}: {e}")
        dump(f"after-{i}.npz")
    print("RESULT " + json.dumps({"errors": errors}), flush=True)
    os._exit(0)  # skip teardown RPCs to the tasks


if __name__ == "__main__":
    main()
