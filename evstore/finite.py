"""The NaN/Inf policy of the optimizers, in one place (its native half, the
rule and the message, is evstore/native/core/finite.h).

A training step whose EV gradients hold any non-finite value is refused with
InvalidArgument naming the first offending key and EV, before *any* variable
(EV or dense) is updated, so a refused step changes nothing:

* `refuse_non_finite(grads, evs)` (the optimizers' `apply`) puts every EV
  gradient's check (`EvCheckFinite`) in front of every update;
* gradients of grouped lookups (evstore/group.py) are checked on the worker
  before they are sent to the parameter server that applies them;
  `note_checked` records those checks in the graph, and `refuse_non_finite`
  waits for them instead of copying the gradients back to check them again.
"""
import tensorflow as tf

from evstore._ops import gen

__all__ = ["check", "note_checked", "refuse_non_finite"]

_CHECKS = "evstore_grouped_gradient_checks"


def check(keys, values, ev_name):
    """`values` (rows of gradients for `keys`) passed through, or an
    InvalidArgument naming the first non-finite key of EV `ev_name`."""
    return gen.ev_check_finite(keys, tf.cast(values, tf.float32), ev_name=ev_name)


def note_checked(checks, slices):
    """Records that the gradients `slices` were checked by the ops `checks`
    where they were computed, so that no variable is updated before those
    checks pass (graph mode; eagerly the checks have run, and raised, already)."""
    if tf.executing_eagerly():
        return
    tf.compat.v1.add_to_collection(_CHECKS, (tf.group(checks), [s.values for s in slices]))


def _checked_gradients(grads):
    """(check ops, ids of gradient values they checked) recorded in this
    graph for any of `grads` (checks of other gradient computations in the
    same graph are not this apply's business)."""
    if tf.executing_eagerly():
        return [], set()
    mine = {id(g.values) for g in grads if isinstance(g, tf.IndexedSlices)}
    entries = [(op, vs) for op, vs in tf.compat.v1.get_collection(_CHECKS) if any(id(v) in mine for v in vs)]
    return [op for op, _ in entries], {id(v) for _, vs in entries for v in vs}


def refuse_non_finite(grads, evs, keys=None):
    """`grads` behind a check of every EV gradient (`evs[i]` is the EV of
    `grads[i]`, or None for a dense variable): if any is non-finite the step
    fails before any variable is updated. An EV gradient is IndexedSlices
    (keys are its indices) or, where `keys[i]` is given, dense rows for those
    keys (the generic row path's accumulated gradients)."""
    checks, prechecked = _checked_gradients(grads)
    checks = list(checks)
    for i, (g, ev) in enumerate(zip(grads, evs)):
        if ev is None or g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if id(g.values) not in prechecked:
                checks.append(check(g.indices, g.values, ev.name))
        elif keys is not None and keys[i] is not None:
            checks.append(check(keys[i], g, ev.name))
    if not checks:
        return grads
    out = []
    passed = tf.group(checks)   # one op: one control edge per parameter server below
    with tf.control_dependencies([passed]):
        for g in grads:
            if g is None:
                out.append(g)
            elif isinstance(g, tf.IndexedSlices) and id(g.values) in prechecked:
                with tf.device(g.values.device or None):   # stays where it is applied
                    out.append(tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape))
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape))
            else:
                out.append(tf.identity(g))
    return out
