"""The soak's parameter-server trainer (tests/soak/soak.py --hosts --trainer
ps starts it on the chief's host of a tests/host_cluster.HostCluster, SIGKILLs
it and starts it again): the chief of a PS job (evstore_app.job.
cluster_train.ClusterJob: tables sharded over 2 PS tasks, steps run by 2
workers) committing to `--root` every `--delta-batches` batches, a full every
`--full-every` commits, pausing `--pause` seconds between commits.

It journals like soak_trainer.py (one JSON line per event, fsynced):
  {"event": "commit", "seq": s, "kind": ..., "probe": [...]}  after each
      commit: `probe` is the job's click probability on the probe rows,
      computed from the tables on the PS tasks as committed;
  {"event": "restored", "seq": s, "probe": [...]}  at a restart, after
      restoring the newest chain.
The first run (an empty root) trains and commits a full before printing
`ready`; the serving export (tests/multihost/fleet_ctr.py) is uploaded to
`--export-url` unless it is there already. Every run writes the probe inputs
to `--inputs-out` (soak_client.py's --inputs JSON).
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "multihost"))   # fleet_ctr: export and probe inputs
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import fsspec  # noqa: E402
import tensorflow as tf  # noqa: E402

from evstore_app.job.cluster_train import ClusterJob  # noqa: E402
from fleet_ctr import export_and_upload, probe_inputs  # noqa: E402
from soak_client import encode_inputs  # noqa: E402


def _journal(f, **record):
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--export-url", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--inputs-out", required=True)
    p.add_argument("--delta-batches", type=int, default=4, help="batches between commits (4)")
    p.add_argument("--full-every", type=int, default=10, help="every Nth commit is a full (10)")
    p.add_argument("--keep-chains", type=int, default=2)
    p.add_argument("--pause", type=float, default=3.0, help="seconds between commits (3)")
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args(argv)
    fs, path = fsspec.core.url_to_fs(a.export_url)
    if not fs.exists(path.rstrip("/") + "/saved_model.pb"):
        export_and_upload(a.export_url)
    job = ClusterJob(a.cluster, checkpoints=a.root, batch_size=a.batch_size, seed=0, delta_every=a.delta_batches,
                     full_every=a.delta_batches * a.full_every, keep_chains=a.keep_chains)
    probe, (ids, hour) = probe_inputs(job.stream)
    with open(a.inputs_out, "w") as f:
        f.write(encode_inputs(probe))

    def prediction():
        return tf.sigmoid(job.model(ids, hour)).numpy().ravel().tolist()

    with open(a.journal, "a") as journal:
        def on_commit(seq, position):
            _journal(journal, event="commit", seq=seq, kind=job.commits[-1][1], probe=prediction(), pid=os.getpid())

        if job.resume() == 0:
            job.train(a.delta_batches, on_commit=on_commit)
        else:
            _journal(journal, event="restored", seq=job.manager.last_committed.seq, probe=prediction(),
                     pid=os.getpid())
        print("ready", flush=True)
        while True:
            time.sleep(a.pause)   # not a busy loop: the machine is shared with the replicas
            job.train(job.position + a.delta_batches, on_commit=on_commit)


if __name__ == "__main__":
    sys.exit(main())
