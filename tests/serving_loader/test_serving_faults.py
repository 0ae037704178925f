"""Faults between a trainer and a running ServingModel:
a lost acknowledgement never reuses a sequence number and a server that
applied withdrawn content converges; a delta the server cannot hold is
refused whole, counted once, and the next full repairs it."""
import logging
import os
import time

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import register_implementation

import checkpoint
import serving_loader
from ckpt_model import make_model, probe_inputs, train


class LostAckFileSystem(LocalFileSystem):
    """Local disk under its own protocol, seen by evstore as a remote store
    (staged uploads, manifests put whole). Armed, the next MANIFEST.json put
    writes the object and then fails, as a remote store whose reply was lost;
    `on_lost_ack` runs between the two (a server polling at that moment).
    With `unreadable` the writer's read-back of that manifest fails too (it
    cannot tell whether the put landed); with `fail_cleanup` so does its
    delete."""

    protocol = ("lostack",)
    root_marker = "/"
    armed = False
    unreadable = False
    fail_cleanup = False
    on_lost_ack = None
    _read_fails = False

    def pipe_file(self, path, value, **kwargs):
        super().pipe_file(path, value, **kwargs)
        cls = type(self)
        if cls.armed and path.endswith("MANIFEST.json"):
            cls.armed = False
            if cls.on_lost_ack:
                cls.on_lost_ack()
            cls._read_fails = cls.unreadable
            raise TimeoutError(f"lostack: no reply for the put of {path} (the object was written)")

    def _open(self, path, mode="rb", **kwargs):
        cls = type(self)
        if cls._read_fails and "r" in mode and str(path).endswith("MANIFEST.json"):
            cls._read_fails = False
            raise TimeoutError(f"lostack: no reply for the get of {path}")
        return super()._open(path, mode=mode, **kwargs)

    def rm_file(self, path):
        if type(self).fail_cleanup and path.endswith("MANIFEST.json"):
            raise TimeoutError(f"lostack: no reply for the delete of {path}")
        return super().rm_file(path)


register_implementation("lostack", LostAckFileSystem, clobber=True)


@pytest.fixture
def lostack():
    yield LostAckFileSystem
    LostAckFileSystem.armed = LostAckFileSystem.fail_cleanup = LostAckFileSystem.unreadable = False
    LostAckFileSystem._read_fails = False
    LostAckFileSystem.on_lost_ack = None


def _served(tmp_path, root=None, steps=3):
    """A model trained `steps` batches, its serving export, a manager on `root`
    (default: a local directory) that saved a full, and a ServingModel on it."""
    model = make_model()
    train(model, 0, steps)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(root or str(tmp_path / "ckpt"), model)
    mgr.save_full()
    return model, mgr, serving_loader.ServingModel(export, mgr.root)


def _assert_serves(sm, model):
    users, items = probe_inputs()
    out, _ = sm.predict({"users": users, "items": items})
    np.testing.assert_array_equal(out["outputs"], model.predict([users, items], verbose=0))


def _probe(sm):
    users, items = probe_inputs()
    out, version = sm.predict({"users": users, "items": items})
    return out["outputs"], version


# What the writer can find out after the lost reply: the manifest is there
# (the save committed after all), it cannot tell and withdraws it, or it cannot
# withdraw it either.
@pytest.mark.parametrize("case", ["confirmed", "withdrawn", "withdrawal-fails"])
def test_lost_acknowledgement_never_reuses_a_sequence_and_the_server_converges(tmp_path, lostack, case):
    model, mgr, sm = _served(tmp_path, root=f"lostack://{tmp_path}/ckpt")
    assert sm.version == 1
    # The put of delta 2's manifest lands, its reply is lost; the server applies it meanwhile.
    train(model, 3, 5)
    lostack.armed = True
    lostack.unreadable = case != "confirmed"
    lostack.fail_cleanup = case == "withdrawal-fails"
    lostack.on_lost_ack = sm.poll
    if case == "confirmed":
        assert mgr.save_delta() == 2
    else:
        with pytest.raises(TimeoutError):
            mgr.save_delta()
    lostack.on_lost_ack = None
    lostack.fail_cleanup = False
    assert sm.version == 2 and sm.failures == 0
    first = _probe(sm)[0]
    # The writer goes on: never sequence 2 with other content.
    train(model, 5, 8)
    seq = mgr.save_delta()
    assert seq == 3
    chain = [m.seq for m in mgr.chain()]
    assert chain == ([1, 2, 3] if case == "confirmed" else [1, 3])
    # The server converges to the committed chain (reloading from the full if it applied withdrawn content).
    sm.poll()
    out, version = _probe(sm)
    assert version == seq
    np.testing.assert_array_equal(out, model.predict(list(probe_inputs()), verbose=0))
    assert not np.array_equal(out, first)


class RetentionRaceFileSystem(LocalFileSystem):
    """Local disk under its own protocol (a remote store to evstore). Armed
    with a checkpoint directory, the server's first read of one of its data
    files first runs `before_read`: the writer saving a full whose retention
    deletes that checkpoint, between the server's scan and its staging."""

    protocol = ("racy",)
    root_marker = "/"
    target = None
    before_read = None

    def _open(self, path, mode="rb", **kwargs):
        cls = type(self)
        if cls.target and "r" in mode and f"/{cls.target}/" in str(path) and not str(path).endswith("MANIFEST.json"):
            cls.target, hook = None, cls.before_read
            hook()
        return super()._open(path, mode=mode, **kwargs)


register_implementation("racy", RetentionRaceFileSystem, clobber=True)


# The server is staging a delta of the chain it serves, or reloading a new chain,
# when the writer's next full (keep_chains=1) deletes it.
@pytest.mark.parametrize("staging", ["delta", "chain"])
def test_a_checkpoint_retention_deletes_while_it_is_staged_is_not_a_failure(tmp_path, staging):
    # Reported: `make demo` with --keep-chains 1 counted "cannot apply delta-...: No such file or directory".
    model = make_model()
    train(model, 0, 3)
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)
    mgr = checkpoint.CheckpointManager(f"racy://{tmp_path}/ckpt", model, keep_chains=1)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    train(model, 3, 5)
    staged = mgr.save_delta() if staging == "delta" else mgr.save_full()
    RetentionRaceFileSystem.target = mgr.chain()[-1].dir

    def next_full():
        train(model, 5, 7)
        return mgr.save_full()

    newest = []
    RetentionRaceFileSystem.before_read = lambda: newest.append(next_full())
    try:
        version = sm.poll()
    finally:
        RetentionRaceFileSystem.target = RetentionRaceFileSystem.before_read = None
    assert newest and staged not in [m.seq for m in mgr.chain()]   # the race happened
    assert sm.failures == 0 and sm.last_error is None
    assert version == newest[0]                                     # the same poll serves what is committed
    _assert_serves(sm, model)


def _extreme_batch(i, key_dtype_min=True):
    """A batch whose ids include the two smallest keys of each EV's dtype (int64 users, int32 items)."""
    users = np.array([[np.iinfo(np.int64).min, np.iinfo(np.int64).min + 1]] * 8 + [[5 + i, 6]] * 8, np.int64)
    items = np.array([[np.iinfo(np.int32).min]] * 8 + [[np.iinfo(np.int32).min + 1]] * 8, np.int32)
    y = np.arange(16).reshape(16, 1) % 2
    return [users, items], y.astype(np.float32)


def test_the_two_smallest_keys_of_the_dtype_are_exported_applied_whole_and_predicted(tmp_path):
    model = make_model()
    train(model, 0, 2)
    for i in range(2):
        model.train_on_batch(*_extreme_batch(i))   # admitted (min_freq 2) and trained
    export = str(tmp_path / "export")
    serving_loader.export_serving_model(model, export)   # holds them (a raw TF error before)
    mgr = checkpoint.CheckpointManager(str(tmp_path / "ckpt"), model)
    mgr.save_full()
    sm = serving_loader.ServingModel(export, mgr.root)
    x, _ = _extreme_batch(0)
    out, version = sm.predict({"users": x[0], "items": x[1]})
    np.testing.assert_array_equal(out["outputs"], model.predict(x, verbose=0))
    # A delta changing those keys' rows (and many others) is applied whole.
    model.train_on_batch(*_extreme_batch(2))
    train(model, 2, 4)
    seq = mgr.save_delta()
    assert sm.poll() == seq and sm.failures == 0
    out, _ = sm.predict({"users": x[0], "items": x[1]})
    np.testing.assert_array_equal(out["outputs"], model.predict(x, verbose=0))
    _assert_serves(sm, model)


def test_a_bad_delta_is_counted_once_not_retried_and_the_next_full_repairs(tmp_path):
    model, mgr, sm = _served(tmp_path)
    train(model, 3, 5)
    bad = mgr.save_delta()
    d = tmp_path / "ckpt" / f"delta-{bad:010d}"
    f = max((p for p in d.iterdir() if ".data-" in p.name), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    for _ in range(3):
        assert sm.poll() == 1
    assert sm.failures == 1 and "crc32c" in sm.last_error   # one failed checkpoint, polled three times
    full = mgr.save_full()
    assert sm.poll() == full and sm.failures == 1
    _assert_serves(sm, model)


def test_fast_polling_does_not_fill_the_log_with_skipped_runs(tmp_path, caplog):
    model, mgr, sm = _served(tmp_path, steps=2)
    for i in range(6):
        train(model, 2 + i, 3 + i)
        mgr.save_delta()
    sm.poll()
    with caplog.at_level("DEBUG"):
        sm.start(every_s=0.001)   # each poll (a scan of 7 checkpoints) takes longer than that
        time.sleep(2)
        sm.stop()
    skipped = [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    assert skipped, "no poll overlapped its successor: the test did not exercise skips"
    assert all(r.levelno == logging.DEBUG for r in skipped)
