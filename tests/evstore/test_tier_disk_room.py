"""A rollback of a running tiered EV needs disk for a second tier file (its staging table's) beside the
live one's: a restore checks the tier directory's free space first and refuses, before reading any
row, one whose full cannot fit (evstore/staging.py, "Disk"; docs/guides/tiered-storage.md).

The disk is real: a 1 MiB tmpfs mounted on the tier directory in a private mount namespace
(`unshare -m`), which the trainer process (a real process inside it) fills with its live tier file,
then grows to 2 MiB (`mount -o remount`)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import hosts  # noqa: E402  (tests/hosts.py: the one probe for namespaces)

HERE = os.path.dirname(os.path.abspath(__file__))

TRAINER = textwrap.dedent("""
    import json, os, subprocess, sys, warnings
    import numpy as np
    sys.path.insert(0, {here!r})
    import checkpoint, evstore
    from test_tiered import DIM, state, train_step

    def bytes_read():
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    def same(a, b):
        return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)

    tier, tmp, out = sys.argv[1:4]
    root = os.path.join(tmp, "ckpt")
    warnings.simplefilter("ignore", evstore.storage.RamTierWarning)   # a tmpfs: the only small disk at hand
    ev = evstore.EmbeddingVariable("t", DIM, storage=evstore.TieredStorage(dram_bytes=40 * 104, path=tier))
    train_step(ev, evstore.optimizers.Adam(0.05), 0)   # rows of 3 x DIM floats: embedding, m, v
    keys = np.arange(8000, dtype=np.int64) * 13
    rows = np.random.default_rng(0).normal(size=(len(keys), DIM)).astype(np.float32)
    ev.load(keys, rows)
    mgr = checkpoint.CheckpointManager(root, {{"t": ev}}, lease=False)
    mgr.save_full()
    committed = state(ev)
    ev.load(keys[:100], rows[:100] * 2)   # trained after the commit: what a rollback replaces
    live, dirs = state(ev), sorted(os.listdir(tier))
    full = mgr.chain()[0]
    result = {{"full_bytes": full.total_bytes, "full_rows": full.evs["t"]["rows"]}}
    before = bytes_read()
    try:
        mgr.restore()
        result["refused"] = None
    except evstore.TierSpaceError as e:
        result["refused"], result["errno"] = str(e), e.errno
    result["read"] = bytes_read() - before
    result["unchanged"] = same(state(ev), live)
    result["same_tier_dirs"] = sorted(os.listdir(tier)) == dirs
    ev.load(keys[:1], rows[:1])   # the live table still takes writes
    ev.load(keys[:1], rows[:1] * 2)
    subprocess.run(["mount", "-o", "remount,size=2m", tier], check=True)
    mgr.restore()
    result["restored_with_room"] = same(state(ev), committed)
    result["tier_dirs_after"] = len(os.listdir(tier))
    json.dump(result, open(out, "w"))
""")


def _run_on_a_small_tier_disk(tmp, script):
    """Runs `script` (python source; argv: tier directory, scratch directory, result file) in a private
    mount namespace whose tier directory is a 1 MiB tmpfs; returns the JSON it wrote."""
    hosts.mount_namespace_or_skip()
    tier = tmp / "tier"
    tier.mkdir()
    (tmp / "script.py").write_text(script)
    out = tmp / "result.json"
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        'mount -t tmpfs -o size=1m evstore-tier-room "$1" && shift && exec "$@"', "sh",
                        str(tier), sys.executable, str(tmp / "script.py"), str(tier), str(tmp), str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rollback_on_a_small_disk(tmp_path_factory):
    """Runs the trainer in a private mount namespace with a 1 MiB tier disk; returns its findings."""
    return _run_on_a_small_tier_disk(tmp_path_factory.mktemp("tier-room"), TRAINER.format(here=HERE))


def test_a_rollback_whose_staging_tier_file_cannot_fit_the_disk_is_refused_naming_the_bytes(rollback_on_a_small_disk):
    r = rollback_on_a_small_disk
    assert r["refused"] is not None, r
    assert r["errno"] == 28   # ENOSPC: an OSError
    # The full's rows (8,000 loaded, 83 trained) of 96 bytes less the 4,160-byte DRAM budget; the 1 MiB
    # disk already holds the live tier file.
    need = r["full_rows"] * 96 - 40 * 104
    assert f"needs at least {need:,} bytes of disk under " in r["refused"], r["refused"]
    assert f"'t': {r['full_rows']:,} rows x 96 bytes - 4,160 of DRAM" in r["refused"], r["refused"]
    assert "bytes free" in r["refused"] and "nothing was loaded or changed" in r["refused"], r["refused"]


def test_a_refused_rollback_reads_no_row_and_leaves_the_live_table_and_its_tier_directory(rollback_on_a_small_disk):
    r = rollback_on_a_small_disk
    assert r["refused"] is not None, r
    assert r["unchanged"] and r["same_tier_dirs"], r
    assert r["read"] < r["full_bytes"] / 4, r   # manifests only: refused before the load read the full


def test_the_same_rollback_loads_once_the_disk_has_room_for_both_tier_files(rollback_on_a_small_disk):
    r = rollback_on_a_small_disk
    assert r["restored_with_room"] and r["tier_dirs_after"] == 1, r   # the replaced table's directory went


CHIEF = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    import checkpoint, evstore
    from evstore.storage import free_bytes
    from evstore_app.cluster import load_cluster

    cluster, tier, root = sys.argv[1:4]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(load_cluster(cluster)), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    with strategy.scope(), tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
        ev = evstore.EmbeddingVariable("t", 8, storage=evstore.TieredStorage(dram_bytes=40 * 40, path=tier))
    keys = np.arange(20000, dtype=np.int64) * 13
    ev.load(keys, np.random.default_rng(0).normal(size=(len(keys), 8)).astype(np.float32))
    mgr = checkpoint.CheckpointManager(root, {"t": ev}, lease=False)
    mgr.save_full()
    before = ev.export()["values"].numpy()
    result = {"rows": mgr.chain()[0].evs["t"]["rows"], "chief_free": free_bytes(tier)[0],
              "ps_free": free_bytes(tier, ev.device)[0]}
    try:
        mgr.restore()
        result["refused"] = None
    except evstore.TierSpaceError as e:
        result["refused"] = str(e)
    result["unchanged"] = bool(np.array_equal(ev.export()["values"].numpy(), before))
    print("RESULT " + json.dumps(result), flush=True)
""")


def test_a_parameter_server_s_tier_disk_is_measured_on_its_own_host(tmp_path):
    """The PS task runs in a mount namespace of its own whose tier directory is a 1 MiB tmpfs; the chief
    sees the same path on the machine's disk. The restore is refused by what the PS's disk holds."""
    hosts.mount_namespace_or_skip()
    from evstore_app.cluster import LocalCluster
    tier = tmp_path / "tier"
    tier.mkdir()
    python = tmp_path / "python-with-a-small-tier-disk"   # every task's interpreter, in its own namespace
    python.write_text("#!/bin/sh\nexec unshare -m --propagation private sh -c "
                      "'mount -t tmpfs -o size=1m evstore-ps-tier \"$0\" && exec \"$@\"' "
                      f"'{tier}' '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    (tmp_path / "chief.py").write_text(CHIEF)
    with LocalCluster(num_ps=1, num_workers=1, directory=str(tmp_path / "cluster"), python=str(python)) as lc:
        p = subprocess.run([sys.executable, str(tmp_path / "chief.py"), lc.cluster_file, str(tier),
                            str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    need = r["rows"] * 32 - 40 * 40   # rows of 8 floats, no slots, less the DRAM budget
    assert r["ps_free"] < need < r["chief_free"], r   # only the PS's own disk is too small
    assert r["refused"] is not None and f"needs at least {need:,} bytes of disk under {tier} on /job:ps/task:0" \
        in r["refused"], r
    assert r["unchanged"], r


SERVER = textwrap.dedent("""
    import json, os, sys, warnings
    import numpy as np
    sys.path.insert(0, {checkpoint_tests!r})
    import checkpoint, evstore, serving_loader
    from ckpt_model import make_model, probe_inputs, train

    tier, tmp, out = sys.argv[1:4]
    warnings.simplefilter("ignore", evstore.storage.RamTierWarning)   # a tmpfs: the only small disk at hand
    model = make_model()
    train(model, 0, 3)
    serving_loader.export_serving_model(model, os.path.join(tmp, "export"), tables="evstore")
    keys = np.arange(20000, dtype=np.int64) * 7 + 1000
    model.get_layer("user").ev.load(keys, np.random.default_rng(0).normal(size=(len(keys), 8)).astype(np.float32))
    mgr = checkpoint.CheckpointManager(os.path.join(tmp, "ckpt"), model, lease=False)
    served = mgr.save_full()
    sm = serving_loader.ServingModel(os.path.join(tmp, "export"), mgr.root,
                                     storage=evstore.TieredStorage(dram_bytes=512, path=tier))
    users, items = probe_inputs()
    before, _ = sm.predict({{"users": users, "items": items}})
    newer = mgr.save_full()   # a new full: streamed into replacement tables beside the served ones
    sm.poll()
    after, version = sm.predict({{"users": users, "items": items}})
    json.dump({{"served": served, "newer": newer, "version": version, "error": sm.last_error,
               "rows": mgr.chain()[0].evs["user"]["rows"],
               "same_answers": bool(np.array_equal(before["outputs"], after["outputs"]))}}, open(out, "w"))
    sm.close()
""")


def test_a_tiered_serving_reload_that_cannot_fit_the_disk_is_refused_and_the_served_version_stays(tmp_path):
    r = _run_on_a_small_tier_disk(tmp_path, SERVER.format(checkpoint_tests=os.path.join(os.path.dirname(HERE),
                                                                                         "checkpoint")))
    assert r["version"] == r["served"] != r["newer"] and r["same_answers"], r
    # The user table's rows of 8 floats beyond the reload's cache (the item table's 50 rows of 4 add 288).
    assert f"'user': {r['rows']:,} rows x 32 bytes - 512 of DRAM" in r["error"], r["error"]
    need = r["rows"] * 32 - 512 + 50 * 16 - 512
    assert f"needs at least {need:,} bytes of disk under " in r["error"] and "bytes free" in r["error"], r["error"]
