"""The soak's trainer (tests/soak/soak.py starts it, SIGKILLs it and starts it
again): trains the checkpoint tests' small CTR model (tests/checkpoint/
ckpt_model.py, deterministic batches) and commits a delta every
`--delta-every` seconds, a full every `--full-every` commits, to `--root`.

It appends one JSON line per event to `--journal` (flushed and fsynced, so
a line written is a line kept across a SIGKILL):
  {"event": "commit", "seq": s, "kind": "full"|"delta", "probe": [...]}
      after the commit returned: `probe` is the model's prediction on
      ckpt_model.probe_inputs() for exactly the committed state;
  {"event": "restored", "seq": s, "probe": [...]}
      at a restart, after restoring the newest chain (this also covers a
      commit whose process was killed before it could journal it).
The first run (an empty root) exports the serving model to `--export` first
(and uploads it to `--export-url` when given). Every run writes the probe
inputs to `--inputs-out` (soak_client.py's --inputs JSON).
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))   # ckpt_model: the tests' model and batches
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import fsspec  # noqa: E402

import checkpoint  # noqa: E402
import serving_loader  # noqa: E402
from ckpt_model import make_model, probe_inputs, train  # noqa: E402
from soak_client import encode_inputs  # noqa: E402


def _journal(f, **record):
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _probe(model):
    return model.predict(list(probe_inputs()), verbose=0).ravel().tolist()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--delta-every", type=float, default=2.0, help="seconds between commits (default 2)")
    p.add_argument("--full-every", type=int, default=10, help="every Nth commit is a full (default 10)")
    p.add_argument("--keep-chains", type=int, default=2, help="retention: chains kept (default 2)")
    p.add_argument("--steps", type=int, default=4, help="most training steps between commits (default 4)")
    p.add_argument("--inputs-out", required=True, help="the probe inputs go here (soak_client.py's --inputs)")
    p.add_argument("--export-url", default=None,
                   help="also upload the export here (an fsspec URL: replicas on other hosts download it)")
    a = p.parse_args(argv)
    users, items = probe_inputs()
    with open(a.inputs_out, "w") as f:
        f.write(encode_inputs({"users": users, "items": items}))
    model = make_model()
    mgr = checkpoint.CheckpointManager(a.root, model, keep_chains=a.keep_chains, lease_timeout=30.0)
    with open(a.journal, "a") as journal:
        if mgr.latest() is None:
            train(model, 0, 3)
            if not os.path.exists(os.path.join(a.export, "saved_model.pb")):
                serving_loader.export_serving_model(model, a.export)
            if a.export_url:
                fs, path = fsspec.core.url_to_fs(a.export_url)
                fs.put(a.export.rstrip("/") + "/", path.rstrip("/") + "/", recursive=True)
            probe = _probe(model)
            _journal(journal, event="commit", seq=mgr.save_full(), kind="full", probe=probe, pid=os.getpid())
        else:
            mgr.restore()
            _journal(journal, event="restored", seq=mgr.last_committed.seq, probe=_probe(model), pid=os.getpid())
        print("ready", flush=True)
        step = int(model.optimizer.iterations.numpy())
        commits = 0
        while True:
            next_commit = time.monotonic() + a.delta_every
            for _ in range(a.steps):   # a few steps, not a busy loop: the machine is shared with the replicas
                if time.monotonic() >= next_commit:
                    break
                train(model, step, step + 1)
                step += 1
            time.sleep(max(0.0, next_commit - time.monotonic()))
            commits += 1
            kind = "full" if commits % a.full_every == 0 else "delta"
            probe = _probe(model)
            seq = (mgr.save_full if kind == "full" else mgr.save_delta)()
            _journal(journal, event="commit", seq=seq, kind=kind, probe=probe, pid=os.getpid())


if __name__ == "__main__":
    sys.exit(main())
