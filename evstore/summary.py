"""TensorBoard scalars for EmbeddingVariables.

    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        evstore.summary.ev_stats(ev, step=step)   # evstore/<ev name>/<stat> scalars

Stats (see `EmbeddingVariable.stats`): size, admitted, filtered, evicted,
free_rows, bytes, index_bytes, meta_bytes, row_bytes, filter_bytes, dirty,
deleted.
"""
import tensorflow as tf

__all__ = ["ev_stats", "SCALARS"]

# TensorBoard's scalar plugin metadata, written with tf.summary.write (part of
# TensorFlow; tf.summary.scalar needs the tensorboard package, which evstore
# does not depend on). TensorBoard shows these exactly like tf.summary.scalar's.
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))

SCALARS = ("size", "admitted", "filtered", "evicted", "free_rows", "bytes", "index_bytes", "meta_bytes",
           "row_bytes", "filter_bytes", "dirty", "deleted")


def ev_stats(ev, step=None, prefix="evstore"):
    """Returns `ev.stats()` and, when a default summary writer is active
    (`with writer.as_default():`), writes each stat as a scalar named
    `<prefix>/<ev.name>/<stat>` at `step` (None: `tf.summary.experimental.get_step()`).

    Raises:
      TypeError: `ev` is not an EmbeddingVariable.
      ValueError: a writer is active but no step is given or set (tf.summary's rule).
    """
    from evstore.variable import EmbeddingVariable
    if not isinstance(ev, EmbeddingVariable):
        raise TypeError(f"ev_stats expects an evstore.EmbeddingVariable, got {type(ev).__name__}")
    stats = ev.stats()
    for k in SCALARS:   # no-ops without a default writer
        tf.summary.write(f"{prefix}/{ev.name}/{k}", tf.cast(stats[k], tf.float32), step=step,
                         metadata=_SCALAR_METADATA)
    return stats
