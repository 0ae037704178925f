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


def test_a_sharded_ev_keeps_each_key_in_its_shard_from_the_same_shard_of_the_source():
    src = evstore.EmbeddingVariable("keep_sh_src", 2, shards=3, default_value=[-1.0, -1.0])
    dst = evstore.EmbeddingVariable("keep_sh_dst", 2, shards=3)
    keys = np.arange(40, dtype=np.int64)
    src.load(keys, np.stack([keys, -keys], axis=1).astype(np.float32))
    dst.load([5], [[9.0, 9.0]])
    assert int(dst.keep_from(src, np.concatenate([keys, [40, 40]]))) == 40   # 5 held; 40 once, absent
    want = dst.shard_index(np.arange(41)).numpy()
    for i, shard in enumerate(dst.shards):
        np.testing.assert_array_equal(np.sort(shard.export()["keys"].numpy()), np.flatnonzero(want == i))
    rows = evstore.embedding_lookup(dst, tf.constant([3, 5, 40], tf.int64), training=False).numpy()
    assert rows.tolist() == [[3.0, -3.0], [9.0, 9.0], [-1.0, -1.0]]


def test_a_sharded_ev_keeps_rows_only_of_a_sharded_ev_of_as_many_shards():
    dst = evstore.EmbeddingVariable("keep_sh_dst_b", 2, shards=3)
    with pytest.raises(ValueError, match="as many shards"):
        dst.keep_from(evstore.EmbeddingVariable("keep_sh_src_b", 2, shards=2), [1])
    with pytest.raises(ValueError, match="as many shards"):
        dst.keep_from(evstore.EmbeddingVariable("keep_sh_src_c", 2), [1])
