"""The serving table adapter: a restored DenseHashTable driven through TensorFlow's table ops."""
import tensorflow as tf

__all__ = ["Table"]


class Table:
    """A loaded DenseHashTable (a restored resource) driven through TF's table ops."""

    def __init__(self, resource, key_dtype):
        self._h = resource.resource_handle
        self._kd = tf.as_dtype(key_dtype)

    def size(self):
        return tf.raw_ops.LookupTableSizeV2(table_handle=self._h)

    def export(self):
        return tf.raw_ops.LookupTableExportV2(table_handle=self._h, Tkeys=self._kd, Tvalues=tf.float32)

    def insert(self, keys, values):
        tf.raw_ops.LookupTableInsertV2(table_handle=self._h, keys=keys, values=values)

    def erase(self, keys):
        tf.raw_ops.LookupTableRemoveV2(table_handle=self._h, keys=keys)
