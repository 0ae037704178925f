"""The fleet tests' synchronous trainer: one worker of a synchronous job
(evstore_app.job.sync_train.SyncJob: MultiWorkerMirroredStrategy, each worker
owning a shard of every table), run on a host of its own:
`python fleet_sync_worker.py --rank R --workers A0,A1 --root s3://B/fleet
--export-url s3://B/export --steps N --delta-every K --full-every F`.

Rank 0 first uploads the serving export (fleet_ctr.py, in a process of its
own). Every worker trains,
committing with the others every K batches (a full every F), and speaks
fleet_ctr.py's line protocol; each commit's prediction is computed by every
worker together (a collective lookup of the probe keys), printed by each.
It exits 0 at the end of its input after `DONE`.
"""
import argparse
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from evstore_app.job.sync_train import SyncJob  # noqa: E402
from fleet_ctr import probe_inputs, say_commit, say_probe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--export-url", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta-every", type=int, required=True)
    p.add_argument("--full-every", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args(argv)
    if a.rank == 0:   # in a process of its own: under the job's strategy the export would name its devices
        subprocess.run([sys.executable, os.path.join(HERE, "fleet_ctr.py"), a.export_url], check=True)
    job = SyncJob(a.rank, a.workers.split(","), a.root, batch_size=a.batch_size, seed=0,
                  delta_every=a.delta_every, full_every=a.full_every)
    job.resume()
    probe, (ids, hour) = probe_inputs(job.stream)
    say_probe(probe)

    @tf.function
    def predict():   # on every worker at once: each looks up the probe keys across the shards
        return job.strategy.run(lambda: tf.sigmoid(job.model(ids, hour)))

    def on_commit(seq, position):
        say_commit(seq, job.strategy.experimental_local_results(predict())[0].numpy().ravel())

    job.train(a.steps, on_commit=on_commit)
    print("DONE", flush=True)
    sys.stdin.read()
    sys.stdout.flush()
    os._exit(0)   # the collective runtime's teardown can wait on peers that already left


if __name__ == "__main__":
    sys.exit(main())
