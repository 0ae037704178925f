"""`EmbeddingVariable.keep_from`: copy-on-write of another EV's values, the
reference model's copy of the rows a batch is about to change
(evstore_app/job/reference.py)."""
import numpy as np
import pytest
import tensorflow as tf

import evstore


def test_keep_from_copies_what_the_source_reads_for_keys_not_held_and_leaves_held_rows():
    src = evstore.EmbeddingVariable("keep_src", 2, default_value=[-1.0, -1.0])
    dst = evstore.EmbeddingVariable("keep_dst", 2)
    src.load([1, 2], [[1.0, 2.0], [3.0, 4.0]])
    dst.load([2], [[9.0, 9.0]])
    assert int(dst.keep_from(src, np.array([[1], [2], [3], [1]]))) == 2      # 1 once; 2 held
    src.load([1, 3], [[5.0, 5.0], [6.0, 6.0]])                                # the source changes on
    assert int(dst.keep_from(src, [1, 3])) == 0
    rows = evstore.embedding_lookup(dst, tf.constant([1, 2, 3], tf.int64), training=False).numpy()
    assert rows.tolist() == [[1.0, 2.0], [9.0, 9.0], [-1.0, -1.0]]           # 3: the source's default then
    assert dst.version([1, 3]).numpy().tolist() == [-1, -1] and dst.frequency([1, 3]).numpy().tolist() == [0, 0]


def test_keep_from_an_ev_of_another_dim_or_key_dtype_is_refused():
    dst = evstore.EmbeddingVariable("keep_dst_b", 2)
    with pytest.raises(ValueError, match="cannot keep rows"):
        dst.keep_from(evstore.EmbeddingVariable("keep_src_b", 3), [1])
    with pytest.raises(ValueError, match="cannot keep rows"):
        dst.keep_from(evstore.EmbeddingVariable("keep_src_c", 2, key_dtype=tf.string), [1])
