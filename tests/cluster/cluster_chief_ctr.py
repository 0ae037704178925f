"""The chief of a CTR training job on a cluster for the cluster-training tests,
run as a real subprocess (evstore_app.job.cluster_train.ClusterJob plus test
hooks): `python cluster_chief_ctr.py --cluster FILE --steps N [options]`.

Prints `ACTION kill <job> <task>` (answered `ok` by the test, which owns the
processes) when asked to kill a task mid-training, `COMMITTED <seq> <position>`
after each commit (after writing the state dump of that commit when
--dump-dir is given), `PAUSED` (then sleeps until killed) with
--pause-after-commits, and finally `RESULT <json>`; the final state goes to
--state-out (npz).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from evstore_app.job.cluster_train import ClusterJob  # noqa: E402


def save_npz(path, state):
    tmp = path + ".tmp.npz"
    np.savez(tmp, **state)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--checkpoints", default=None)
    p.add_argument("--delta-every", type=int, default=10)
    p.add_argument("--shards", type=int, default=None)
    p.add_argument("--kill-worker-at", type=int, default=None, help="position at which worker 1 is killed")
    p.add_argument("--dump-dir", default=None)
    p.add_argument("--pause-after-commits", type=int, default=None)
    p.add_argument("--state-out", required=True)
    p.add_argument("--tiered-dram-bytes", type=int, default=None, help="tables on evstore.TieredStorage")
    p.add_argument("--tier-path", default=None)
    p.add_argument("--take-over", action="store_true", help="take the root's writer lease from a live-looking holder")
    p.add_argument("--lease-timeout", type=float, default=60.0)
    p.add_argument("--serving-view", default=None)
    p.add_argument("--reference-gate", default=None, help="the reference's judgement (ClusterJob's reference_gate)")
    a = p.parse_args()
    storage = None
    if a.tiered_dram_bytes is not None:
        import evstore
        storage = evstore.TieredStorage(dram_bytes=a.tiered_dram_bytes, path=a.tier_path)
    job = ClusterJob(a.cluster, checkpoints=a.checkpoints, batch_size=a.batch_size, delta_every=a.delta_every,
                     shards=a.shards, storage=storage, take_over=a.take_over,
                     lease_timeout=a.lease_timeout, serving_view=a.serving_view, reference_gate=a.reference_gate)
    resumed_at = job.resume()
    if a.dump_dir and a.checkpoints:
        save_npz(os.path.join(a.dump_dir, "restored.npz"), job.model.state())

    def on_commit(seq, position):
        if a.dump_dir:
            save_npz(os.path.join(a.dump_dir, f"commit-{seq}.npz"), job.model.state())
        print(f"COMMITTED {seq} {position}", flush=True)
        print(f"SENT {seq} {job.manager.last_save_stats.get('bytes_sent_here', -1)}", flush=True)
        if a.pause_after_commits is not None and len(job.commits) >= a.pause_after_commits:
            print("PAUSED", flush=True)
            while True:
                time.sleep(60)

    if a.kill_worker_at is not None:
        job.train(a.kill_worker_at, sync=a.sync, on_commit=on_commit)
        print("ACTION kill worker 1", flush=True)
        if sys.stdin.readline().strip() != "ok":
            raise RuntimeError("no answer to the kill")
    job.train(a.steps, sync=a.sync, on_commit=on_commit)
    save_npz(a.state_out, job.model.state())
    print("RESULT " + json.dumps({"resumed_at": resumed_at, "position": job.position,
                                  "global_step": int(job.global_step.numpy()), "commits": job.commits,
                                  "devices": {f: list(t.devices) for f, t in job.model.tables.items()},
                                  "cache_misses": sum(int(t.stats()["cache_misses"])
                                                      for t in job.model.tables.values())}),
          flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip teardown RPCs to tasks that may be gone


if __name__ == "__main__":
    main()
