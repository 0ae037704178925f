"""The serving table adapter: a restored DenseHashTable driven through TensorFlow's table ops."""
import tensorflow as tf

from serving_loader.served_table import ServedTable

__all__ = ["Table"]


class Table(ServedTable):
    """A loaded DenseHashTable (a restored resource) driven through TF's table ops.
    (The other adapter, for evstore tables: serving_loader/ev_table.py.)"""

    reserves_sentinels = True   # its empty and deleted keys live beside it (export.py)
    weighs_freqs = False        # insert() ignores the keys' frequencies

    def __init__(self, resource, key_dtype):
        self._h = resource.resource_handle
        self._kd = tf.as_dtype(key_dtype)

    def size(self):
        return tf.raw_ops.LookupTableSizeV2(table_handle=self._h)

    def export(self):
        return tf.raw_ops.LookupTableExportV2(table_handle=self._h, Tkeys=self._kd, Tvalues=tf.float32)

    def insert(self, keys, values, freqs=None):
        """Upserts rows (`freqs` is not used: a DenseHashTable keeps no frequencies)."""
        tf.raw_ops.LookupTableInsertV2(table_handle=self._h, keys=tf.constant(keys, self._kd),
                                       values=tf.constant(values, tf.float32))

    def erase(self, keys):
        tf.raw_ops.LookupTableRemoveV2(table_handle=self._h, keys=tf.convert_to_tensor(keys, self._kd))

    def warm(self, keys):
        """Nothing to do: every row is in DRAM."""

    def close(self):
        """Nothing to do: the table is freed with the loaded model."""
