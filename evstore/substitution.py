"""Lookup substitution: the one hook every lookup of an EV goes through.

While `substitute_lookups({ev: fn})` is active (in this thread), every lookup
of `ev` - `embedding_lookup`, `embedding_lookup_sparse`,
`safe_embedding_lookup_sparse`, `embedding_lookup_group` (grouped with other
tables or not) and `evstore.keras.Embedding` - returns `fn(ids)` instead of
running evstore's kernels, for an EmbeddingVariable and a sharded one alike.
`fn` takes the ids tensor (already checked against the EV's key dtype) and
returns float32 rows of shape `ids.shape + [ev.dim]`.

serving_loader.export_serving_model traces a model inside it, with each EV's
lookups replaced by lookups of a stock TensorFlow table, so the SavedModel it
writes holds no evstore op (docs/ARCHITECTURE.md, "Serving").
"""
import contextlib
import threading

__all__ = ["substitute_lookups", "substitute_for"]

_active = threading.local()


@contextlib.contextmanager
def substitute_lookups(fns):
    """Context manager: lookups of each EV key of `fns` ({ev: fn(ids) -> rows})
    return `fn(ids)` while it is active in this thread (nested calls replace
    the outer mapping until they exit).

    Raises:
      TypeError: `fns` is not a mapping, or a value is not callable.
    """
    if not hasattr(fns, "items"):
        raise TypeError(f"substitute_lookups takes a mapping {{ev: fn(ids)}}, got {type(fns).__name__}")
    table = {}
    for ev, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"substitute_lookups: the substitute for {ev!r} is not callable")
        table[id(ev)] = (ev, fn)
    prev = getattr(_active, "table", None)
    _active.table = table
    try:
        yield
    finally:
        _active.table = prev


def substitute_for(ev):
    """The substitute `fn(ids)` active in this thread for `ev`, or None."""
    table = getattr(_active, "table", None)
    if not table:
        return None
    entry = table.get(id(ev))
    return entry[1] if entry is not None and entry[0] is ev else None
