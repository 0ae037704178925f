"""Restores a CTR job's chain (sharded, or saved by synchronous workers) into one
process with unsharded tables and writes its state:
`python restore_one.py ROOT OUT.npz`. Prints one JSON line: the resumed
position and each commit's `deleted_complete` flag."""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from evstore_app.job.cluster_train import ClusterJob  # noqa: E402


def main():
    root, out = sys.argv[1], sys.argv[2]
    job = ClusterJob(local=True, checkpoints=root)
    position = job.resume()
    np.savez(out, **job.model.state())
    flags = [m.deleted_complete for m in job.manager.chain()]
    print(json.dumps({"position": position, "deleted_complete": flags}), flush=True)


if __name__ == "__main__":
    main()
