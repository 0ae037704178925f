"""MANIFEST.json protects itself: a one-character edit or a
renamed field is refused with an error naming the file, a refused restore
changes nothing in the model, and `evstore ckpt verify` exits non-zero."""
import os

import pytest

import checkpoint
from evstore_app import cli
from ckpt_model import assert_same_state, make_model, state, train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full (pos 30) and a delta (pos 50) of a trained model: (root, bytes of each manifest)."""
    root = tmp_path_factory.mktemp("root")
    model = make_model()
    mgr = checkpoint.CheckpointManager(str(root), model)
    train(model, 0, 3)
    mgr.save_full(metadata={"pos": 30})
    train(model, 3, 5)
    mgr.save_delta(metadata={"pos": 50})
    return root, {d: (root / d / "MANIFEST.json").read_bytes() for d in os.listdir(root) if (root / d).is_dir()}


@pytest.fixture
def root(saved):
    """The saved root with its original manifests (each test edits one)."""
    r, original = saved
    for d, data in original.items():
        (r / d / "MANIFEST.json").write_bytes(data)
    return r


def _verify_exit_code(root, capsys):
    """`evstore ckpt verify ROOT`: (exit code, output)."""
    capsys.readouterr()
    code = cli.main(["ckpt", "verify", str(root)])
    out = capsys.readouterr()
    return code, out.out + out.err


# (directory, text replaced, replacement): one character, or a field renamed.
EDITS = {
    "ev-name-one-char": ("delta-0000000002", '"item": {', '"itex": {'),
    "metadata-digit": ("delta-0000000002", '"pos": 50', '"pos": 90'),
    "rows-digit-in-full": ("full-0000000001", '"rows": ', '"rows": 1'),
    "renamed-slots": ("delta-0000000002", '"slots":', '"slotz":'),
    "renamed-dim": ("full-0000000001", '"dim":', '"dims":'),
    "renamed-key-dtype": ("delta-0000000002", '"key_dtype":', '"keydtype":'),
    "renamed-shape": ("delta-0000000002", '"shape":', '"shap":'),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_manifest_is_refused_naming_the_file_and_restore_changes_nothing(root, edit, capsys):
    d, old, new = EDITS[edit]
    path = root / d / "MANIFEST.json"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    model = make_model()
    train(model, 0, 2)   # a model with its own state, which a refused restore must keep
    before = state(model)
    with pytest.raises(checkpoint.CheckpointError, match=f"{d}.*MANIFEST.json"):
        checkpoint.CheckpointManager(str(root), model).restore()
    assert_same_state(state(model), before)
    code, out = _verify_exit_code(root, capsys)
    assert code != 0 and "MANIFEST.json" in out, out


def test_unedited_manifests_verify_and_restore(root, capsys):
    code, out = _verify_exit_code(root, capsys)
    assert code == 0, out
    assert checkpoint.CheckpointManager(str(root), make_model()).restore() == {"pos": 50}
