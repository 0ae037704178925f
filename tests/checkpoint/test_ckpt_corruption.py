"""Damaged checkpoints: truncated and bit-flipped data and index files, a
missing delta, a manifest naming a wrong parent, a corrupt manifest. Each is a
clear error naming the file, and a refused restore changes nothing."""
import json
import os

import pytest

import checkpoint
from checkpoint.manifest import canonical_checksum
from ckpt_model import assert_same_state, make_model, state, train


@pytest.fixture
def chain(tmp_path):
    """full-1, delta-2, delta-3 of a trained model; returns (root, model)."""
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(tmp_path), model)
    train(model, 0, 3)
    mgr.save_full()
    train(model, 3, 5)
    mgr.save_delta()
    train(model, 5, 7)
    mgr.save_delta()
    return tmp_path, model


def _restore_fresh(root, **kw):
    fresh = make_model()
    before = state(fresh)
    try:
        checkpoint.CheckpointManager(str(root), fresh).restore(**kw)
    except Exception:
        assert_same_state(state(fresh), before)   # nothing changed
        raise
    return fresh


def _write_manifest(path, d):
    """Writes manifest dict `d` with a valid checksum: a manifest a (buggy) writer could have produced."""
    d["checksum"] = canonical_checksum(d)
    path.write_text(json.dumps(d))


def _biggest_data_file(d):
    return max((p for p in d.iterdir() if ".data-" in p.name), key=lambda p: p.stat().st_size)


def test_bit_flipped_data_file_is_named_and_restore_changes_nothing(chain):
    root, _ = chain
    f = _biggest_data_file(root / "delta-0000000002")
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=f.name + r".*tensor '[^']+'.*corrupt"):
        _restore_fresh(root)


def test_truncated_data_file_is_named(chain):
    root, _ = chain
    f = _biggest_data_file(root / "full-0000000001")
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(checkpoint.CorruptCheckpointError, match=f.name + ".*truncated"):
        _restore_fresh(root)


def test_bit_flipped_index_file_is_named(chain):
    root, _ = chain
    f = root / "delta-0000000003" / "ckpt.index"
    b = bytearray(f.read_bytes())
    b[5] ^= 0x01
    f.write_bytes(bytes(b))
    with pytest.raises(checkpoint.CorruptCheckpointError, match="delta-0000000003.*ckpt.index"):
        _restore_fresh(root)


def test_missing_data_file_is_named(chain):
    root, _ = chain
    f = _biggest_data_file(root / "delta-0000000003")
    f.unlink()
    with pytest.raises(checkpoint.CorruptCheckpointError, match=f.name + ": missing"):
        _restore_fresh(root)


def test_missing_delta_in_the_middle_is_a_chain_gap(chain):
    root, _ = chain
    (root / "delta-0000000002" / "MANIFEST.json").unlink()
    with pytest.raises(checkpoint.ChainError, match="delta-0000000003 follows checkpoint 2.*gap"):
        _restore_fresh(root)


def test_manifest_pointing_at_a_wrong_parent_is_refused(chain):
    root, _ = chain
    m = root / "delta-0000000003" / "MANIFEST.json"
    d = json.loads(m.read_text())
    d["parent"] = 9
    _write_manifest(m, d)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="delta 3 names parent 9"):
        _restore_fresh(root)


def test_manifest_pointing_at_another_chains_parent_is_refused(chain):
    root, model = chain
    mgr = checkpoint.CheckpointManager(str(root), model)
    mgr.restore()
    mgr.save_full()                                          # full-4 starts chain 4
    mgr.save_delta()                                         # delta-5 in chain 4
    (root / "delta-0000000006").mkdir()
    for f in (root / "delta-0000000003").iterdir():          # a chain-1 delta...
        (root / "delta-0000000006" / f.name).write_bytes(f.read_bytes())
    d = json.loads((root / "delta-0000000003" / "MANIFEST.json").read_text())
    d.update(seq=6, parent=5, base=1)                        # ...claiming a chain-4 parent
    d.pop("parent_checksum")                                 # (by number only, as older writers did)
    _write_manifest(root / "delta-0000000006" / "MANIFEST.json", d)
    with pytest.raises(checkpoint.ChainError, match="delta-0000000006 names base 1.*wrong parent"):
        _restore_fresh(root)


def test_corrupt_newest_manifest_is_an_error_not_a_silent_rollback(chain):
    root, _ = chain
    (root / "delta-0000000003" / "MANIFEST.json").write_text('{"format": "evstore-checkpoint", "ver')
    with pytest.raises(checkpoint.CorruptCheckpointError, match="delta-0000000003.*MANIFEST.json.*JSON"):
        _restore_fresh(root)
    fresh = _restore_fresh(root, seq=2)   # going back explicitly works
    assert len(state(fresh)["user:keys"]) > 0


def test_directory_without_manifest_does_not_exist_for_readers(chain):
    root, model = chain
    (root / "delta-0000000004").mkdir()
    (root / "delta-0000000004" / "ckpt.index").write_bytes(b"half")
    fresh = _restore_fresh(root)
    assert_same_state(state(fresh), state(model))


def test_load_of_a_corrupt_bundle_without_verification_fails_in_the_native_reader(chain):
    root, _ = chain
    f = _biggest_data_file(root / "delta-0000000002")
    b = bytearray(f.read_bytes())
    b[3] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.raises(Exception, match="checksum mismatch.*" + f.name):
        checkpoint.CheckpointManager(str(root), make_model()).restore(verify=False)
