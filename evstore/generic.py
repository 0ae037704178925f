"""Any Keras 3 optimizer trains EmbeddingVariables: the generic row path.

`evstore.optimizers` fuses seven optimizers into native kernels. Every other
Keras optimizer (`keras.optimizers.RMSprop`, `Nadam`, `Lion`, ... and
`LossScaleOptimizer` around any of them) trains EVs through this module, in
the same `apply_gradients` / `model.fit` as dense variables:

1. the EV's gradient `IndexedSlices(row grads, keys)` becomes, before Keras
   sees it, the dense tensor of its *unique* keys' summed row gradients (the
   keys travel beside it). Keras's loss-scale unscaling, clipping
   (`clipnorm`, `clipvalue`, `global_clipnorm`) and averaging of accumulated
   gradients therefore act on exactly the values a dense variable's gradient
   holds for those rows;
2. the rows of the touched keys and their slots are read
   (`EvReadRows`) into per-EV scratch variables;
3. the optimizer's own `update_step` runs on that dense slice, Keras code
   unchanged (its slot variables for the EV are the scratch slot variables);
4. rows and slots are written back (`EvWriteRows`): version = step, key
   marked dirty, a key evicted meanwhile is skipped.

Slots are ordinary table slots named `<optimizer class>_<Keras slot name>`
(e.g. `rmsprop_velocity`), so they are exported, checkpointed, restored,
delta-saved and evicted with the row like the fused optimizers' slots.

The path is *lazy*, as TensorFlow's own sparse applies: rows not in a step's
gradient neither move nor decay. Optimizers whose rule is not row-local are
refused with a ValueError naming them (`Adafactor`, `Lamb`, `Muon`);
`use_ema=True` is refused for EVs.

When evstore is imported, evstore/keras_compat.py (which owns every change
evstore makes to Keras) sets six methods of Keras's optimizer base classes to
the hooks below: each has a branch for EVs and their proxies; with no EV in
the variable list they run Keras's code unchanged.
"""
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf

from evstore import finite, keras_compat
from evstore._ops import gen
from evstore.variable import EmbeddingVariable, _colocated_with, ev_for_variable

__all__ = ["REFUSED", "HOOKS", "sparse_apply_keras", "slot_initial_values"]

# Optimizers whose update of a row depends on other rows: no lazy row path.
REFUSED = {
    "Adafactor": "its factored second moments are means over all rows and columns of the variable, and its "
                 "update is scaled by the RMS of the whole variable",
    "Lamb": "its trust ratio is the norm of the whole variable over the norm of its whole update",
    "Muon": "it orthogonalises the update of the whole matrix",
}

_lock = threading.Lock()


class _Keys:
    """proxy uid -> the unique keys of the EV gradient being applied. Kept per
    thread (trainer threads may apply to one EV at once) and, for a
    tf.distribute merge_call that applies in the strategy's thread, also
    process-wide (the newest registration)."""

    def __init__(self):
        self._local = threading.local()
        self._shared = {}

    def _mine(self):
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = {}
        return d

    def __contains__(self, uid):
        return uid in self._mine()

    def __setitem__(self, uid, keys):
        self._mine()[uid] = keys
        self._shared[uid] = keys

    def get(self, uid):
        keys = self._mine().get(uid)
        return keys if keys is not None else self._shared.get(uid)

    def pop(self, uid):
        keys = self._mine().pop(uid, None)
        if self._shared.get(uid) is keys:
            self._shared.pop(uid, None)


_KEYS = _Keys()
_STATE = weakref.WeakKeyDictionary()   # optimizer -> _OptimizerRows


class _OptimizerRows:
    """Per optimizer: the scratch variables of each EV it trains."""

    def __init__(self):
        self.rows = {}     # proxy uid -> _Rows
        self.index = {}    # id(scratch weight variable) -> the proxy's variable index


class _Rows:
    """The scratch dense slice of one EV for one optimizer: the weights `w`
    [None, dim] and the slot variables, in table-slot order."""

    def __init__(self, ev, name):
        self.ev = ev
        with tf.init_scope(), _colocated_with(ev.resource_handle):   # where the table is (also under a PS strategy)
            self.w = tf.Variable(tf.zeros([0, ev.dim]), shape=tf.TensorShape([None, ev.dim]), trainable=False,
                                 name=f"{name}_rows")
        self.slots = []    # (table slot name, scratch variable, initial value)
        self.acc = None    # (keys, values) accumulation buffers, with gradient_accumulation_steps

    def add_slot(self, table_name, init):
        with tf.init_scope(), _colocated_with(self.ev.resource_handle):
            var = tf.Variable(tf.fill([0, self.ev.dim], np.float32(init)), shape=tf.TensorShape([None, self.ev.dim]),
                              trainable=False, name=table_name)
        self.slots.append((table_name, var, float(init)))
        return var

    def accumulators(self):
        if self.acc is None:
            with tf.init_scope(), _colocated_with(self.ev.resource_handle):
                self.acc = (tf.Variable(tf.zeros([0], self.ev.key_dtype), shape=tf.TensorShape([None]),
                                        trainable=False, name="acc_keys"),
                            tf.Variable(tf.zeros([0, self.ev.dim]), shape=tf.TensorShape([None, self.ev.dim]),
                                        trainable=False, name="acc_values"))
        return self.acc


def _uid(variable):
    """The stable id of a proxy (tf.Variable or keras.Variable)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return variable._unique_id


def _is_fused(opt):
    return hasattr(opt, "_ev_apply")


def _prefix(opt):
    return type(opt).__name__.lower()


def _refuse(opt, ev):
    name = type(opt).__name__
    for base in type(opt).__mro__:
        if base.__name__ in REFUSED and base.__module__.startswith("keras"):
            raise ValueError(f"{name} cannot train EmbeddingVariable '{ev.name}': {REFUSED[base.__name__]}, "
                             "so its rule cannot be applied row by row to the touched rows. Train the EV with "
                             "another optimizer (e.g. evstore.optimizers.Adam or keras.optimizers.RMSprop).")
    if getattr(opt, "use_ema", False):
        raise ValueError(f"{name}(use_ema=True) cannot train EmbeddingVariable '{ev.name}': a moving average of "
                         "every row of a table is not kept; set use_ema=False")


def _state(opt):
    with _lock:
        s = _STATE.get(opt)
        if s is None:
            s = _STATE[opt] = _OptimizerRows()
        return s


def _rows_for(opt, proxy, ev):
    """The scratch slice of `ev` (reached through `proxy`) for `opt`, created once."""
    st = _state(opt)
    uid = _uid(proxy)
    r = st.rows.get(uid)
    if r is None:
        _refuse(opt, ev)
        r = st.rows[uid] = _Rows(ev, f"{_prefix(opt)}_{ev.name}")
        st.index[id(r.w)] = opt._get_variable_index(proxy)
    return r


def slot_initial_values(opt):
    """{id(ev): {table slot name: initial value}} of the EVs `opt` trains
    through this path (known once `opt` is built)."""
    st = _STATE.get(opt)
    return {} if st is None else {id(r.ev): {n: i for n, _, i in r.slots} for r in st.rows.values()}


def _constant_of(initializer, what):
    init = keras.initializers.get(initializer)
    if isinstance(init, keras.initializers.Zeros):
        return 0.0
    if isinstance(init, keras.initializers.Ones):
        return 1.0
    if isinstance(init, keras.initializers.Constant) and np.size(init.value) == 1:
        return float(np.asarray(init.value).reshape(()))
    with tf.init_scope():
        v = init(shape=(2,), dtype="float32")
        v = tf.get_static_value(v) if tf.is_tensor(v) else np.asarray(v)
    if v is None or v[0] != v[1]:
        raise ValueError(f"the initializer of optimizer slot {what!r} is not a constant; EV rows need one "
                         "initial slot value")
    return float(v[0])


class _NullAccumulator:
    """Keras's gradient accumulator of an EV proxy: EV gradients are
    accumulated by key before Keras sees them (see `_accumulate`), so Keras's
    own accumulator adds nothing and stores nothing."""

    shape = ()
    dtype = "float32"

    def assign(self, value):
        return None

    def assign_add(self, value):
        return None


tf.register_tensor_conversion_function(
    _NullAccumulator, lambda v, dtype=None, name=None, as_ref=False: tf.zeros([], dtype or tf.float32))


# ---- the Keras hooks (set by keras_compat.install) ----------------------------------


def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
    ev = ev_for_variable(reference_variable)
    if ev is not None and name == "gradient_accumulator":
        return _NullAccumulator()
    if ev is None or _is_fused(self):
        return keras_compat.original("BaseOptimizer.add_variable_from_reference")(self, reference_variable, name=name, initializer=initializer)
    if name == "average":
        _refuse(self, ev)
    rows = _rows_for(self, reference_variable, ev)
    table_name = f"{_prefix(self)}_{name or 'var'}"
    taken = {n for n, _, _ in rows.slots}
    base, i = table_name, 2
    while table_name in taken:
        table_name, i = f"{base}_{i}", i + 1
    return rows.add_slot(table_name, _constant_of(initializer, table_name))


def get_variable_index(self, variable):
    st = _STATE.get(self)
    if st is not None:
        i = st.index.get(id(variable))
        if i is not None:
            return i
    return keras_compat.original("BaseOptimizer._get_variable_index")(self, variable)


def _unique_sum(keys, values):
    """Unique keys (first-occurrence order) and their summed gradient rows."""
    return gen.ev_unique_sum(keys, values)


def _accumulate(opt, rows, keys, values):
    """Gradient accumulation by key: EV gradients of the steps between two
    updates are kept as (keys, values) and summed by key at the update step
    (Keras divides the sum by the number of steps, as for dense variables);
    between updates the EV gets an empty gradient."""
    kb, vb = rows.accumulators()
    steps = opt.gradient_accumulation_steps
    is_update = tf.equal((opt._iterations + 1) % steps, 0)
    all_k = tf.concat([kb.read_value(), keys], 0)
    all_v = tf.concat([vb.read_value(), values], 0)

    def flush():
        with tf.control_dependencies([kb.assign(tf.zeros([0], kb.dtype)), vb.assign(tf.zeros([0, rows.ev.dim]))]):
            k, v = _unique_sum(all_k, all_v)
            return tf.identity(k), tf.identity(v)

    def keep():
        with tf.control_dependencies([kb.assign(all_k), vb.assign(all_v)]):
            return tf.zeros([0], kb.dtype), tf.zeros([0, rows.ev.dim])

    return tf.cond(is_update, flush, keep)


def _needs_dense(opt):
    """Whether an EV gradient must be deduplicated before Keras sees it (the
    generic path always; fused optimizers when Keras transforms gradients)."""
    if not _is_fused(opt):
        return True
    return bool(opt.clipnorm or opt.clipvalue or opt.global_clipnorm or opt.gradient_accumulation_steps
                or opt.loss_scale_factor)


def _prepare(opt, grads, variables, dense):
    """EVs -> their proxies; EV gradients -> (unique keys aside, summed rows)
    when `dense`. Returns (grads, variables, uids registered here)."""
    grads, variables, registered = list(grads), list(variables), []
    for i, (g, v) in enumerate(zip(grads, variables)):
        ev = ev_for_variable(v)
        if ev is None:
            continue
        if isinstance(v, EmbeddingVariable):
            v = variables[i] = v._proxy
        uid = _uid(v)
        if g is None or not dense or uid in _KEYS:
            continue
        if not isinstance(g, tf.IndexedSlices):
            raise TypeError(f"the gradient of EmbeddingVariable '{ev.name}' must be tf.IndexedSlices (keys, row "
                            f"gradients) from evstore lookups, got {type(g).__name__}")
        with tf.device(g.values.device or None):
            keys = tf.reshape(g.indices, [-1])
            if keys.dtype != ev.key_dtype:
                keys = tf.cast(keys, ev.key_dtype)
            values = tf.reshape(tf.cast(g.values, tf.float32), [-1, ev.dim])
            keys, values = _unique_sum(keys, values)
            if opt.gradient_accumulation_steps:
                keys, values = _accumulate(opt, _rows_for(opt, v, ev), keys, values)
        _KEYS[uid] = keys
        registered.append(uid)
        grads[i] = values
    return grads, variables, registered


def ev_gradient(gradient, variable, ev):
    """The IndexedSlices(row grads, keys) of an EV gradient that `_prepare`
    turned into summed rows (a fused optimizer's update_step); else as is."""
    keys = _KEYS.get(_uid(variable))
    if keys is None or isinstance(gradient, tf.IndexedSlices):
        return gradient
    return tf.IndexedSlices(tf.convert_to_tensor(gradient), keys)


def refuse_non_finite(grads, variables):
    """The NaN/Inf policy (evstore/finite.py) over `grads` of `variables`,
    dense gradients of EV proxies checked against the keys they were
    accumulated for."""
    return finite.refuse_non_finite(grads, [ev_for_variable(v) for v in variables],
                                    keys=[_KEYS.get(_uid(v)) for v in variables])


def with_evs(apply_fn, check):
    def apply(self, grads, trainable_variables=None):
        variables = trainable_variables
        if variables is None and self.built:
            variables = self._trainable_variables
        if variables is None or not any(ev_for_variable(v) is not None for v in variables):
            return apply_fn(self, grads, trainable_variables)
        variables = list(variables)
        if not self.built:
            # Build on the proxies first, so that the accumulation buffers
            # below belong to a built optimizer.
            proxies = [v._proxy if isinstance(v, EmbeddingVariable) else v for v in variables]
            with keras.name_scope(self.name, caller=self):
                self.build(proxies)
            self.built = True
        for v in variables:
            ev = ev_for_variable(v)
            if ev is not None and not _is_fused(self):
                _refuse(self, ev)
        grads, proxies, registered = _prepare(self, grads, variables, _needs_dense(self))
        try:
            if check and not _is_fused(self):
                grads = refuse_non_finite(grads, proxies)
            return apply_fn(self, grads, proxies)
        finally:
            for uid in registered:
                _KEYS.pop(uid)
    return apply


def distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
    # Keras's TFOptimizer._distributed_tf_update_step with one branch: a
    # non-fused optimizer updates an EV proxy through the generic row path.
    def apply_grad_to_update_var(var, grad, learning_rate):
        ev = ev_for_variable(var)
        if ev is not None and not _is_fused(self):
            return apply_rows(self, ev, var, grad, learning_rate)
        return self.update_step(grad, var, learning_rate)

    for grad, var in grads_and_vars:
        distribution.extended.update(var, apply_grad_to_update_var, args=(grad, learning_rate), group=False)


def apply_rows(opt, ev, proxy, grad, learning_rate, global_step=None):
    """One generic update of `ev`'s touched rows by `opt`'s own update_step.

    `grad`: the summed row gradients of the unique keys registered for `proxy`
    (or an IndexedSlices(row grads, keys), deduplicated here). Returns the
    number of rows written (int64 scalar)."""
    if isinstance(grad, tf.IndexedSlices):
        keys, values = _unique_sum(tf.cast(tf.reshape(grad.indices, [-1]), ev.key_dtype),
                                   tf.reshape(tf.cast(grad.values, tf.float32), [-1, ev.dim]))
    else:
        keys, values = _KEYS.get(_uid(proxy)), tf.cast(grad, tf.float32)
    rows = _rows_for(opt, proxy, ev)
    names = tf.constant([n for n, _, _ in rows.slots], tf.string, shape=[len(rows.slots)])
    inits = tf.constant([i for _, _, i in rows.slots], tf.float32, shape=[len(rows.slots)])
    with tf.device(ev.device or None):
        # Rows of keys without one (not admitted, evicted) read as zeros and
        # are computed on like the others; EvWriteRows skips them.
        w, slots, _ = gen.ev_read_rows(ev.resource_handle, keys, names, inits, dim=ev.dim)
        rows.w.assign(w)
        for i, (_, var, _) in enumerate(rows.slots):
            var.assign(slots[i])
        if getattr(opt, "weight_decay", None) and opt._use_weight_decay(proxy):
            # Keras decays every weight before the update step; here the touched rows.
            lr = tf.cast(opt.learning_rate, tf.float32)
            rows.w.assign_sub(rows.w * tf.cast(opt.weight_decay, tf.float32) * lr)
        opt.update_step(values, rows.w, learning_rate)
        step = opt.iterations if global_step is None else global_step
        new_slots = (tf.stack([var.read_value() for _, var, _ in rows.slots], axis=0) if rows.slots
                     else tf.zeros([0, tf.shape(keys)[0], ev.dim]))
        return gen.ev_write_rows(ev.resource_handle, keys, rows.w.read_value(), new_slots, names, inits,
                                 tf.cast(step, tf.int64))


def backend_increment_gradient_accumulators(self, grads, acc_grads):
    # EV gradients were accumulated by key (_accumulate); Keras's accumulators
    # of their proxies hold nothing.
    pairs = [(g, a) for g, a in zip(grads, acc_grads) if not isinstance(a, _NullAccumulator)]
    return keras_compat.original("TFOptimizer._backend_increment_gradient_accumulators")(self, [g for g, _ in pairs], [a for _, a in pairs])


# What evstore/keras_compat.py sets in Keras (installed when this module is imported, which
# evstore/__init__.py makes happen when Keras is): "Owner.attribute" -> the replacement made from Keras's own.
HOOKS = {
    "BaseOptimizer.add_variable_from_reference": lambda own: add_variable_from_reference,
    "BaseOptimizer._get_variable_index": lambda own: get_variable_index,
    "BaseOptimizer.apply": lambda own: with_evs(own, check=True),
    "LossScaleOptimizer.apply": lambda own: with_evs(own, check=False),
    "TFOptimizer._distributed_tf_update_step": lambda own: distributed_tf_update_step,
    "TFOptimizer._backend_increment_gradient_accumulators": lambda own: backend_increment_gradient_accumulators,
}

keras_compat.install(HOOKS)


def sparse_apply_keras(optimizer, grads_and_evs, global_step):
    """One step of a Keras optimizer's own rule on EVs, as a function (any
    execution mode, including `tf.compat.v1` graph mode with a Session, where
    Keras 3 optimizers cannot build a train op themselves).

    `grads_and_evs`: (IndexedSlices(row grads, keys), EmbeddingVariable)
    pairs, e.g. from `tf.compat.v1.gradients(loss, evs)`. The optimizer's
    `iterations` is set to `global_step` (steps completed before this one: what
    its rule's bias corrections and schedules read), every EV's touched rows
    are updated lazily (the generic row path) and stamped `version =
    global_step`. Returns the op (graph) / the rows written (eager). Optimizers
    refused by the generic path raise ValueError; so do the fused
    `evstore.optimizers` (use `evstore.training.sparse_apply_*`)."""
    pairs = [(g, ev) for g, ev in grads_and_evs if g is not None]
    if _is_fused(optimizer):
        raise ValueError(f"{type(optimizer).__name__} is fused: use evstore.training.sparse_apply_* for it")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError("sparse_apply_keras takes the optimizer inside a LossScaleOptimizer (unscaled gradients)")
    for _, ev in pairs:
        if not isinstance(ev, EmbeddingVariable):
            raise TypeError(f"sparse_apply_keras trains EmbeddingVariables, got {type(ev).__name__}")
    if not optimizer.built:
        optimizer.build([ev._proxy for _, ev in pairs])
    for _, ev in pairs:
        _rows_for(optimizer, ev._proxy, ev)

    def step():
        optimizer._iterations.assign(tf.cast(global_step, optimizer._iterations.dtype))
        lr = optimizer._get_current_learning_rate()
        optimizer._backend_update_step([], [], lr)   # per-step work of the rule (e.g. Nadam's momentum product)
        out = [apply_rows(optimizer, ev, ev._proxy, g, lr, global_step=global_step) for g, ev in pairs]
        return tf.add_n(out) if out else tf.constant(0, tf.int64)

    if tf.compat.v1.executing_eagerly_outside_functions():
        return step()
    return tf.function(step, autograph=False)()   # v1 graph: ordered like a tf.function body
