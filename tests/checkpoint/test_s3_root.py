"""A checkpoint root on S3 for real: a full + delta chain, a restore and a
serving poll through s3fs against moto's standalone S3 server, started as a
separate process on 127.0.0.1. Credentials and endpoint come from the usual
AWS environment variables only (what docs/guides/checkpoints.md tells users to set)."""

import numpy as np
import pytest

import checkpoint
import serving_loader
from ckpt_model import make_model, probe_inputs, train
from s3_server import moto_bucket


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    """A bucket on a moto S3 server process; AWS_* variables point at it."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with moto_bucket(log, before_stop=checkpoint.lease._release_all) as bucket:   # the writer lease first
        yield bucket


def _predict(sm):
    users, items = probe_inputs()
    return sm.predict({"users": users, "items": items})


def test_s3_root_full_delta_restore_and_serving_poll(tmp_path, s3_bucket):
    import fsspec

    root = f"s3://{s3_bucket}/job/ckpt"
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(root, model)
    full = mgr.save_full()
    train(model, 3, 5)
    delta = mgr.save_delta()
    assert [m.seq for m in mgr.chain()] == [full, delta]
    objects = fsspec.filesystem("s3").find(f"{s3_bucket}/job/ckpt")
    assert any(o.endswith("MANIFEST.json") for o in objects), objects

    fresh = make_model()
    checkpoint.CheckpointManager(root, fresh).restore()
    users, items = probe_inputs()
    np.testing.assert_array_equal(fresh.predict([users, items], verbose=0), model.predict([users, items], verbose=0))

    sm = serving_loader.ServingModel(export, root)
    assert _predict(sm)[1] == delta
    train(model, 5, 7)
    newer = mgr.save_delta()
    assert sm.poll() == newer
    out, version = _predict(sm)
    assert version == newer
    np.testing.assert_array_equal(out["outputs"], model.predict([users, items], verbose=0))


def test_lease_checks_on_s3_while_the_holder_renews_it(s3_bucket):
    """A save's lease check reads the lease object while the heartbeat thread
    replaces it; on S3 a read of a replaced object must see one version or the
    other, never fail (the soak's trainer died of s3fs's FileExpired here)."""
    import threading

    from checkpoint.lease import Lease
    from checkpoint.storage import Storage

    lease = Lease(Storage(f"s3://{s3_bucket}/lease-race"), timeout=600.0)
    lease.acquire()
    stop, first = threading.Event(), threading.Event()
    renewed, errors = [], []

    def renew():
        try:
            while not stop.is_set():
                renewed.append(lease.renew())   # False: it read a record that is not its own (a torn read)
                first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)
            first.set()

    t = threading.Thread(target=renew)
    t.start()
    try:
        assert first.wait(120)
        during = len(renewed)
        for _ in range(300):
            lease.check()   # raises LeaseLostError on a read that did not see this writer's record
        during = len(renewed) - during
    finally:
        stop.set()
        t.join()
        lease.release()
    assert errors == [], errors
    assert during > 0, "no renewal ran while the checks read the lease"
    assert all(renewed), f"{renewed.count(False)} of {len(renewed)} renewals did not read this writer's record"
