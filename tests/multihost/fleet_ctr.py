"""What the fleet tests' job trainers share (tests/multihost/fleet_ps_chief.py,
fleet_sync_worker.py): the serving export of the jobs' CTR model
(evstore_app.job.cluster_train.CtrModel), uploaded to the object store; the
probe inputs; the line protocol with the test.

Protocol (stdout / stdin): `PROBE <inputs JSON>` once (PROBE rows of batch 0
of the job's stream: keys the job trains); after each commit `COMMIT <seq>
<prediction JSON>` (the job's click probability on the probe inputs, from
the state just committed), then the trainer waits for one line on stdin
before training on, so the test sees each commit while it is the newest;
`DONE` after the last commit.
"""
import json
import sys

import fsspec
import tensorflow as tf

import serving_loader
from evstore_app.job.cluster_train import FIELDS, CtrModel

PROBE = 16
INPUTS = [f for f, _ in FIELDS] + ["hour"]


class Served(tf.Module):
    """The serving signature over a CtrModel: one input per field and the hour, the click probability out."""

    def __init__(self, model):
        super().__init__(name="served")
        self.model = model

    def __call__(self, inputs):   # [user, item, category, hour], as the signature lists them
        user, item, category, hour = inputs
        return tf.sigmoid(self.model({"user": user, "item": item, "category": category}, hour))


def export_and_upload(url, seed=0):
    """Writes the serving export of an unsharded CtrModel (the job's tables and weights by name) to this
    host's /tmp/export and uploads it to `url`."""
    signature = [tf.TensorSpec([None], tf.int64, name=f) for f, _ in FIELDS] + \
        [tf.TensorSpec([None], tf.float32, name="hour")]
    serving_loader.export_serving_model(Served(CtrModel(shards=None, seed=seed)), "/tmp/export",
                                        input_signature=signature)
    fs, path = fsspec.core.url_to_fs(url)
    fs.put("/tmp/export/", path.rstrip("/") + "/", recursive=True)


def probe_inputs(stream):
    """({input: list} to print, (ids dict, hour) tensors) of the probe rows."""
    cols, _ = stream.batch(0)
    probe = {k: cols[k][:PROBE] for k in INPUTS}
    return probe, ({f: tf.constant(probe[f]) for f, _ in FIELDS}, tf.constant(probe["hour"]))


def say_probe(probe):
    print("PROBE " + json.dumps({k: v.tolist() for k, v in probe.items()}), flush=True)


def say_commit(seq, prediction, wait=True):
    print(f"COMMIT {seq} {json.dumps([float(x) for x in prediction])}", flush=True)
    if wait:
        sys.stdin.readline()


if __name__ == "__main__":   # python fleet_ctr.py EXPORT_URL: export_and_upload in a process of its own
    export_and_upload(sys.argv[1])
