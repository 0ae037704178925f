"""One writer per root: two real writer processes on one
root; the second is refused with an error naming the holder, and takes the
lease over once the holder is gone."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_model.py")


def _worker(root, dump, steps):
    return subprocess.Popen([sys.executable, WORKER, str(root), str(dump), json.dumps(steps)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_second_writer_is_refused_naming_the_holder_and_takes_over_once_it_is_gone(tmp_path):
    root, dump = tmp_path / "root", tmp_path / "dump"
    dump.mkdir()
    first = _worker(root, dump, [["train", 0, 2], ["full", 2], ["sleep", 600]])
    try:
        assert first.stdout.readline().startswith("saved 1"), first.stderr.read()[-3000:]
        second = _worker(root, dump, [["train", 0, 3], ["full", 3]])
        out, err = second.communicate(timeout=300)
        assert second.returncode != 0
        assert "LeaseHeldError" in err and f"host {socket.gethostname()} pid {first.pid}" in err, err[-3000:]
        # The refused writer touched nothing: the holder's checkpoint is whole, nothing else appeared.
        assert sorted(os.listdir(root)) == ["WRITER.lease", "full-0000000001"]
        assert checkpoint.CheckpointManager(str(root), []).chain()[-1].seq == 1
        assert not checkpoint.verify_files(checkpoint.Storage(str(root)), checkpoint.CheckpointManager(
            str(root), []).latest())
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The holder is gone (killed: its lease stays behind, naming a dead pid): the next writer takes over.
    third = _worker(root, dump, [["restore"], ["train", 2, 4], ["delta", 4]])
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err[-3000:]
    assert "saved 2" in out and "taking over the lease" in err


def test_a_fresh_lease_is_taken_over_only_when_asked(tmp_path):
    a = checkpoint.CheckpointManager(str(tmp_path), [], lease_timeout=600)
    a.save_full()
    from checkpoint.lease import Lease
    other = Lease(checkpoint.Storage(str(tmp_path)), timeout=600)      # another writer of this host
    with pytest.raises(checkpoint.LeaseHeldError, match=f"pid {os.getpid()}"):
        other.acquire()
    Lease(checkpoint.Storage(str(tmp_path)), timeout=600, take_over=True).acquire()
    with pytest.raises(checkpoint.LeaseLostError, match="taken over"):
        a.save_delta()


def test_a_refused_manager_stays_refused_every_later_save_raises_the_same_lease_held_error(tmp_path):
    from checkpoint.lease import Lease
    holder = Lease(checkpoint.Storage(str(tmp_path)), timeout=600)      # another writer of this host
    holder.acquire()
    try:
        refused = checkpoint.CheckpointManager(str(tmp_path), [], lease_timeout=600)
        with pytest.raises(checkpoint.LeaseHeldError, match=f"pid {os.getpid()}") as first:
            refused.save_full()
        # The cause again, not "save_delta() needs a chain to extend".
        for save in (refused.save_delta, refused.save_full, refused.save_delta):
            with pytest.raises(checkpoint.LeaseHeldError) as later:
                save()
            assert str(later.value) == str(first.value)
    finally:
        holder.release()
    # Even with the holder gone it never writes: it did not start from the holder's chain.
    with pytest.raises(checkpoint.LeaseHeldError):
        refused.save_full()
    assert os.listdir(tmp_path) == []
    checkpoint.CheckpointManager(str(tmp_path), []).save_full()   # a new manager may
