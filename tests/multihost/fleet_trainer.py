"""A single-process trainer for the tests on hosts (tests/hosts.py), run on a host of its own:
`python fleet_trainer.py --root s3://B/fleet --export-url s3://B/export`
(`--user-shards N --tables evstore`: the sharded-serving tests' model).

Trains the checkpoint tests' CTR model (tests/checkpoint/ckpt_model.py,
deterministic batches), writes the serving export to its private /tmp and
uploads it to `--export-url` (the replicas' hosts download it from there:
the object store is all the hosts share), commits a full to `--root` and
prints `COMMIT <seq> <probe JSON>` (probe: the model's prediction on
ckpt_model.probe_inputs() for exactly the committed state). Then, per stdin
line: `delta` or `full` trains 3 steps more, commits one and prints its
COMMIT line; `quit` (or end of input) exits 0.
"""
import argparse
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "checkpoint"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import fsspec  # noqa: E402

import checkpoint  # noqa: E402
import serving_loader  # noqa: E402
from ckpt_model import make_model, probe_inputs, train  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--export-url", required=True)
    p.add_argument("--user-shards", type=int, default=None, help="train the user EV as this many shards")
    p.add_argument("--tables", default="stock", help="the export's tables: stock or evstore")
    a = p.parse_args(argv)
    model = make_model(user_shards=a.user_shards)
    train(model, 0, 3)
    serving_loader.export_serving_model(model, "/tmp/export", tables=a.tables)
    fs, path = fsspec.core.url_to_fs(a.export_url)
    fs.put("/tmp/export/", path.rstrip("/") + "/", recursive=True)
    mgr = checkpoint.CheckpointManager(a.root, model)
    step = 3

    def commit(save):
        seq = save()
        probe = model.predict(list(probe_inputs()), verbose=0).ravel().tolist()
        print(f"COMMIT {seq} {json.dumps(probe)}", flush=True)

    commit(mgr.save_full)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd not in ("delta", "full"):
            print(f"fleet_trainer: unknown command {cmd!r}", file=sys.stderr)
            return 2
        train(model, step, step + 3)
        step += 3
        commit(mgr.save_delta if cmd == "delta" else mgr.save_full)
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
