"""EV metrics: ev.stats() and TensorBoard scalars (evstore.summary.ev_stats)."""
import glob

import numpy as np
import pytest
import tensorflow as tf

import evstore


def test_stats_report_size_admitted_filtered_evicted_free_rows_and_bytes():
    ev = evstore.EmbeddingVariable("st", 4, filter=evstore.CounterFilter(2), evict=evstore.GlobalStepEvict(0))
    evstore.embedding_lookup(ev, tf.constant([1, 1, 2, 2, 3], tf.int64))   # 1, 2 admitted; 3 counted
    evstore.training.sparse_apply_sgd(ev, tf.IndexedSlices(tf.zeros([1, 4]), tf.constant([1], tf.int64)), 0.1, 5)
    s = ev.stats()
    assert (s["size"], s["admitted"], s["filtered"], s["evicted"], s["free_rows"]) == (3, 2, 1, 0, 0)
    assert s["bytes"] == s["index_bytes"] + s["meta_bytes"] + s["row_bytes"] + s["filter_bytes"] > 0
    ev.evict(7)   # 1: updated at 5; 2 and 3: reference unknown (seen before any step) -> stamped, kept
    ev.evict(8)
    s = ev.stats()
    assert (s["size"], s["admitted"], s["filtered"], s["evicted"], s["free_rows"]) == (0, 0, 0, 3, 2)


def test_ev_stats_writes_tensorboard_scalars(tmp_path):
    ev = evstore.EmbeddingVariable("tb", 4)
    evstore.embedding_lookup(ev, tf.constant([1, 2, 3], tf.int64))
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        stats = evstore.summary.ev_stats(ev, step=7)
    writer.flush()
    got = {}
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                assert v.metadata.plugin_data.plugin_name == "scalars"   # TensorBoard's scalar dashboard
                got[v.tag] = (event.step, float(tf.make_ndarray(v.tensor)))
    assert set(got) == {f"evstore/tb/{k}" for k in evstore.summary.SCALARS}
    assert got["evstore/tb/admitted"] == (7, 3.0) and got["evstore/tb/bytes"] == (7, float(stats["bytes"]))


def test_ev_stats_without_a_writer_only_returns_the_stats():
    ev = evstore.EmbeddingVariable("tb_none", 4)
    assert evstore.summary.ev_stats(ev)["size"] == 0
    with pytest.raises(TypeError, match="expects an evstore.EmbeddingVariable"):
        evstore.summary.ev_stats(np.zeros(3))
