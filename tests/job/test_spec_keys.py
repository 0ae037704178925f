"""The trainer's spec takes string columns as keys ("keys": "string"), lists of
ids per row ("split"), or hashed ids ("keys": "hash", explicit); a string column
read as int64 ids is a clear error, not a silent hash."""
import numpy as np
import pytest
import tensorflow as tf

import evstore

from evstore_app.job.model import build_model, field_ev, model_inputs
from evstore_app.job.source import FileStream
from evstore_app.job.spec import SpecError, load_spec


def _data(tmp_path, field):
    (tmp_path / "events.csv").write_text(
        "user,tags,y\n1,Comedy|Drama,1\n2,,0\n3,Drama||War|Comedy|Film-Noir,1\n4,caf\u00e9,0\n")
    return load_spec({"label": {"column": "y"}, "batch_size": 4,
                      "sparse": [{"name": "u", "column": "user", "dim": 2}, {"name": "t", "column": "tags",
                                                                               "dim": 2, **field}]})


def test_a_string_column_read_as_int64_ids_is_refused_naming_the_options(tmp_path):
    spec = _data(tmp_path, {})
    with pytest.raises(ValueError, match=r"spec: sparse\[1\]: column 'tags' holds string, not integers: set "
                                         r"\"keys\": \"string\" .* or \"hash\""):
        FileStream(str(tmp_path / "events.csv"), spec)


def test_string_keys_are_the_column_values_as_bytes(tmp_path):
    stream = FileStream(str(tmp_path / "events.csv"), _data(tmp_path, {"keys": "string"}))
    assert stream.cols["tags"].tolist() == [b"Comedy|Drama", b"", b"Drama||War|Comedy|Film-Noir",
                                            "caf\u00e9".encode()]
    assert stream.cols["user"].dtype == np.int64


def test_hash_keys_are_tf_hash_bucket_fast_of_the_text(tmp_path):
    stream = FileStream(str(tmp_path / "events.csv"), _data(tmp_path, {"keys": "hash"}))
    want = tf.strings.to_hash_bucket_fast(["Comedy|Drama", "", "Drama||War|Comedy|Film-Noir", "caf\u00e9"], 2**62)
    assert stream.cols["tags"].tolist() == want.numpy().tolist()


def test_a_split_field_is_a_padded_list_of_ids_per_row(tmp_path):
    stream = FileStream(str(tmp_path / "events.csv"), _data(tmp_path, {"keys": "string", "split": "|",
                                                                       "max_ids": 3}))
    assert stream.cols["tags"].tolist() == [[b"Comedy", b"Drama", b""], [b"", b"", b""],
                                            [b"Drama", b"War", b"Comedy"], ["caf\u00e9".encode(), b"", b""]]


@pytest.mark.parametrize("field, message", [
    ({"split": "|"}, r"sparse\[0\] has split but keys 'int64'"),
    ({"keys": "hash", "split": "|"}, r"sparse\[0\] has split but keys 'hash'"),
    ({"keys": "string", "max_ids": 4}, r"sparse\[0\].max_ids needs split"),
    ({"keys": "strings"}, r"sparse\[0\].keys must be one of \['int64', 'string', 'hash'\]"),
])
def test_inconsistent_key_settings_are_one_line_naming_the_field(field, message):
    with pytest.raises(SpecError, match=message):
        load_spec({"label": {"column": "y"}, "sparse": [{"name": "t", "column": "tags", "dim": 2, **field}]})


def test_a_split_field_averages_the_rows_of_its_ids_and_never_looks_up_the_padding(tmp_path):
    spec = _data(tmp_path, {"keys": "string", "split": "|", "max_ids": 3})
    stream = FileStream(str(tmp_path / "events.csv"), spec)
    model = build_model(spec)
    _, (cols, y) = next(stream.batches())
    x = model_inputs(spec, cols)
    assert x["t_ids"].dtype == tf.string and x["t_ids"].shape == (4, 3)
    model.train_on_batch(x, y.reshape(-1, 1))
    ev = field_ev(model, "t")
    assert sorted(ev.export()["keys"].numpy().tolist()) == [b"Comedy", b"Drama", b"War", "caf\u00e9".encode()]
    layer = next(la for la in model.layers if la.name == "t_mean")
    rows = layer(tf.constant([[b"Comedy", b"Drama", b""], [b"", b"", b""]])).numpy()
    comedy, drama = evstore.embedding_lookup(ev, tf.constant([b"Comedy", b"Drama"]), training=False).numpy()
    np.testing.assert_allclose(rows[0], (comedy + drama) / 2, rtol=1e-6)
    np.testing.assert_array_equal(rows[1], np.zeros(2, np.float32))
