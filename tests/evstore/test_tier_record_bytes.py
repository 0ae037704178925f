"""A tier record's size (one row on a tier's disk) is defined once, in the native core
(core/row_store.h RowFloats/RecordBytes, core/serving_rows.h PackedFloats); Python asks it
(evstore.storage.record_bytes, op EvTierRecordBytes) for the disk a load needs."""
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import evstore
from evstore.storage import record_bytes


def test_a_training_row_s_record_holds_the_embedding_and_each_slot_as_float32():
    assert record_bytes(8) == 32
    assert record_bytes(8, slots=2) == 96   # Adam: embedding, m, v
    assert record_bytes(5, slots=1) == 40


@pytest.mark.parametrize("precision, record", [("float32", 4 * 7), ("bfloat16", 4 * 4), ("float16", 4 * 4),
                                               ("int8", 4 * (1 + 2))])
def test_a_serving_row_s_record_is_the_row_packed_in_its_precision(precision, record):
    # dim 7: two 16-bit codes a word (the odd one padded); int8: a scale word, then four codes a word.
    assert record_bytes(7, precision=precision) == record


def test_an_unknown_precision_or_slots_on_a_serving_row_are_refused():
    with pytest.raises(tf.errors.InvalidArgumentError, match="int4"):
        record_bytes(8, precision="int4")
    with pytest.raises(tf.errors.InvalidArgumentError, match="no slots"):
        record_bytes(8, slots=1, precision="int8")


def test_a_tiered_ev_s_tier_file_is_made_of_records_of_that_size(tmp_path):
    dim, rows = 5, 2000
    ev = evstore.EmbeddingVariable("records", dim, storage=evstore.TieredStorage(dram_bytes=4096,
                                                                                 path=str(tmp_path)))
    keys = np.arange(rows, dtype=np.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(evstore.embedding_lookup(ev, keys))
    evstore.optimizers.Adam(0.1).apply_gradients(zip(tape.gradient(loss, ev.trainable_variables),
                                                     ev.trainable_variables))
    ev.load(keys, np.ones((rows, dim), np.float32))   # every row written, most of them evicted
    record = record_bytes(dim, slots=2)
    (path,) = glob.glob(os.path.join(str(tmp_path), "evstore-tier-*", "rows"))
    size = os.path.getsize(path)
    evicted = rows - ev.stats()["cache_rows"]
    assert size % record == 0 and size // record >= evicted, (size, record, evicted)
