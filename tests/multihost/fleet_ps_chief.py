"""The fleet tests' parameter-server trainer: the chief of a PS job
(evstore_app.job.cluster_train.ClusterJob: tables sharded over the PS tasks,
steps run by the workers), run on the chief's host of a
tests/host_cluster.HostCluster:
`python fleet_ps_chief.py --cluster FILE --root s3://B/fleet --export-url s3://B/export
--steps N --delta-every K --full-every F`.

It uploads the serving export (fleet_ctr.py), then trains, committing to
`--root` every K batches (a full every F), and speaks fleet_ctr.py's line
protocol; each commit's prediction is computed on the chief from the tables
on the PS tasks. It exits 0 at the end of its input after `DONE`.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from evstore_app.job.cluster_train import ClusterJob  # noqa: E402
from fleet_ctr import export_and_upload, probe_inputs, say_commit, say_probe  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--export-url", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta-every", type=int, required=True)
    p.add_argument("--full-every", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args(argv)
    export_and_upload(a.export_url)
    job = ClusterJob(a.cluster, checkpoints=a.root, batch_size=a.batch_size, seed=0, delta_every=a.delta_every,
                     full_every=a.full_every)
    job.resume()
    probe, (ids, hour) = probe_inputs(job.stream)
    say_probe(probe)
    job.train(a.steps, sync=True,
              on_commit=lambda seq, position: say_commit(seq, tf.sigmoid(job.model(ids, hour)).numpy().ravel()))
    print("DONE", flush=True)
    sys.stdin.read()
    sys.stdout.flush()
    os._exit(0)   # skip teardown RPCs to tasks that may be gone


if __name__ == "__main__":
    sys.exit(main())
