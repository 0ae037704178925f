"""Fused sparse updates of EmbeddingVariables, as functions (any execution mode).

These are what `evstore.optimizers` run for EVs; use them directly in
`tf.compat.v1` graph mode (where Keras 3 optimizers cannot build a train op):

    grad = tf.compat.v1.gradients(loss, [ev])[0]          # IndexedSlices(row grads, keys)
    train_op = evstore.training.sparse_apply_adam(ev, grad, 1e-3, global_step)

Optimizers and their slots (stored in the EV row, exported under these names):
sgd (momentum: "momentum"), adagrad ("accumulator"), adam / adamw ("m", "v"),
ftrl ("accumulator", "linear"), group_adam ("m", "v", "linear"),
group_adagrad ("accumulator", "linear"). Hyper-parameters given as Python
numbers are range-checked here (ValueError naming the parameter); tensors are
checked by the kernel (InvalidArgumentError), before anything changes.

Each call sums duplicate keys, updates every admitted key's row and slots in one
pass (absent and not-yet-admitted keys are skipped), stamps `version =
global_step` and marks the keys dirty. A gradient holding NaN/Inf is refused
with InvalidArgumentError naming the key, and nothing changes.
"""
import numpy as np
import tensorflow as tf

from evstore import schema
from evstore._ops import gen

__all__ = ["sparse_apply_sgd", "sparse_apply_adagrad", "sparse_apply_adam", "sparse_apply_adamw",
           "sparse_apply_ftrl", "sparse_apply_group_adam", "sparse_apply_group_adagrad"]


def _unpack(ev, grad):
    if not isinstance(grad, tf.IndexedSlices):
        raise TypeError(f"the gradient of EmbeddingVariable '{ev.name}' must be tf.IndexedSlices "
                        f"(keys, row gradients) from evstore lookups, got {type(grad).__name__}")
    keys = tf.reshape(grad.indices, [-1])
    if keys.dtype != ev.key_dtype:
        keys = tf.cast(keys, ev.key_dtype)
    return keys, tf.cast(grad.values, tf.float32)


def _f32(x):
    return tf.cast(x, tf.float32)


def _step(global_step):
    return tf.cast(global_step, tf.int64)


def check_hyper(name, value, low=0.0, low_inclusive=True, high=None):
    """Raises ValueError naming `name` unless low <= value (low < value when not
    low_inclusive) and value < high. Only Python / numpy numbers are checked
    here; tensors and variables are checked by the kernels at run time
    (InvalidArgumentError naming the parameter), before anything changes."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return
    ok = (value >= low if low_inclusive else value > low) and (high is None or value < high)
    if not ok:
        rng = f"{'>=' if low_inclusive else '>'} {low}" + ("" if high is None else f" and < {high}")
        if high is not None and low_inclusive:
            rng = f"in [{low}, {high})"
        raise ValueError(f"{name} must be {rng}, got {value}")


def _apply_inputs(ev, keys, values, global_step):
    """The inputs every fused apply takes first, by name (schema.APPLY_INPUTS)."""
    return {schema.HANDLE: ev.resource_handle, schema.KEYS_INPUT: keys, schema.GRADS_INPUT: values,
            schema.GLOBAL_STEP_INPUT: _step(global_step)}


def _adam_alpha(learning_rate, global_step, beta_1, beta_2, adam_step):
    t = _f32(_step(global_step) + 1 if adam_step is None else adam_step)
    b1, b2 = _f32(beta_1), _f32(beta_2)
    return _f32(learning_rate) * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t)), b1, b2


def sparse_apply_sgd(ev, grad, learning_rate, global_step, momentum=0.0, nesterov=False):
    """w -= lr * g; with momentum (Keras semantics, slot "momentum"):
    m = momentum * m - lr * g; w += m (nesterov: w += momentum * m - lr * g)."""
    keys, values = _unpack(ev, grad)
    if momentum == 0:
        return gen.ev_apply_sgd(**_apply_inputs(ev, keys, values, global_step), lr=_f32(learning_rate))
    return gen.ev_apply_momentum(**_apply_inputs(ev, keys, values, global_step), lr=_f32(learning_rate),
                                 momentum=_f32(momentum), nesterov=bool(nesterov))


def sparse_apply_adagrad(ev, grad, learning_rate, global_step, epsilon=1e-7, initial_accumulator_value=0.1):
    """acc += g^2; w -= lr * g / sqrt(acc + epsilon) (slot "accumulator", new
    rows start at `initial_accumulator_value`)."""
    keys, values = _unpack(ev, grad)
    return gen.ev_apply_adagrad(**_apply_inputs(ev, keys, values, global_step), lr=_f32(learning_rate),
                                epsilon=_f32(epsilon), initial_accumulator_value=float(initial_accumulator_value))


def sparse_apply_adam(ev, grad, learning_rate, global_step, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                      adam_step=None):
    """Adam with global beta powers (slots "m", "v"):
    m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); w -= alpha * m / (sqrt(v) + epsilon),
    alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), t = `adam_step` (default global_step + 1)."""
    keys, values = _unpack(ev, grad)
    alpha, b1, b2 = _adam_alpha(learning_rate, global_step, beta_1, beta_2, adam_step)
    return gen.ev_apply_adam(**_apply_inputs(ev, keys, values, global_step), alpha=alpha, beta1=b1, beta2=b2,
                             epsilon=_f32(epsilon))


def sparse_apply_adamw(ev, grad, learning_rate, global_step, weight_decay=0.004, beta_1=0.9, beta_2=0.999,
                       epsilon=1e-7, adam_step=None):
    """AdamW (Keras semantics; slots "m", "v"): w -= w * weight_decay * lr, then Adam.

    The decoupled weight decay is applied to the rows in this batch only (the
    keys being updated), not to every row of the table: a sparse table has no
    "all rows" to shrink each step, and rows not seen keep their values (a
    dense Keras AdamW decays every row of a dense variable each step).
    """
    for n, v in (("beta_1", beta_1), ("beta_2", beta_2)):
        check_hyper(n, v, 0.0, True, 1.0)
    check_hyper("learning_rate", learning_rate, 0.0, False)
    check_hyper("weight_decay", weight_decay)
    check_hyper("epsilon", epsilon)
    keys, values = _unpack(ev, grad)
    alpha, b1, b2 = _adam_alpha(learning_rate, global_step, beta_1, beta_2, adam_step)
    return gen.ev_apply_adam_w(**_apply_inputs(ev, keys, values, global_step), alpha=alpha, beta1=b1, beta2=b2,
                               epsilon=_f32(epsilon), lr=_f32(learning_rate), weight_decay=_f32(weight_decay))


def sparse_apply_ftrl(ev, grad, learning_rate, global_step, learning_rate_power=-0.5,
                      initial_accumulator_value=0.1, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0):
    """FTRL-proximal with TensorFlow's semantics (ApplyFtrlV2 / Keras Ftrl;
    slots "accumulator" n, starting at `initial_accumulator_value`, and "linear" z):

        g' = g + 2 * l2_shrinkage * w;   n' = n + g^2
        z += g' - (n'^-p - n^-p) / lr * w                     (p = learning_rate_power <= 0)
        w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 * (l2 + beta / (2 * lr)));   n = n'
    """
    check_hyper("learning_rate", learning_rate, 0.0, False)
    for n, v in (("initial_accumulator_value", initial_accumulator_value), ("l1", l1), ("l2", l2),
                 ("l2_shrinkage", l2_shrinkage), ("beta", beta)):
        check_hyper(n, v)
    if isinstance(learning_rate_power, (int, float)) and learning_rate_power > 0:
        raise ValueError(f"learning_rate_power must be <= 0, got {learning_rate_power}")
    keys, values = _unpack(ev, grad)
    lr = _f32(learning_rate)
    l2_total = _f32(l2) + _f32(beta) / (2.0 * lr)
    return gen.ev_apply_ftrl(**_apply_inputs(ev, keys, values, global_step), lr=lr, l1=_f32(l1), l2=l2_total,
                             l2_shrinkage=_f32(l2_shrinkage), lr_power=_f32(learning_rate_power),
                             initial_accumulator_value=float(initial_accumulator_value))


def sparse_apply_group_adam(ev, grad, learning_rate, global_step, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                            l1=0.0, l2=0.0, l21=0.0, adam_step=None):
    """GroupAdam: Adam with a sparse group lasso per row (slots "m", "v", "linear").

    m, v as Adam; per coordinate Q = (sqrt(v) + epsilon) / alpha with Adam's
    alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); FTRL linear term
    z = z_prev + m - (Q - Q_prev) * w; s = clip(z, -l1, l1) - z; the row becomes
    exactly zero if ||s|| <= l21 * sqrt(dim), else
    w = (1 - l21 * sqrt(dim) / ||s||) * s / (Q + 2 * l2). The "linear" slot
    stores z + Q * w (z re-centred at the current weights). With
    l1 = l2 = l21 = 0 this is Adam.
    """
    for n, v in (("beta_1", beta_1), ("beta_2", beta_2)):
        check_hyper(n, v, 0.0, True, 1.0)
    check_hyper("learning_rate", learning_rate, 0.0, False)
    for n, v in (("epsilon", epsilon), ("l1", l1), ("l2", l2), ("l21", l21)):
        check_hyper(n, v)
    keys, values = _unpack(ev, grad)
    alpha, b1, b2 = _adam_alpha(learning_rate, global_step, beta_1, beta_2, adam_step)
    return gen.ev_apply_group_adam(**_apply_inputs(ev, keys, values, global_step), alpha=alpha, beta1=b1,
                                   beta2=b2, epsilon=_f32(epsilon), l1=_f32(l1), l2=_f32(l2), l21=_f32(l21))


def sparse_apply_group_adagrad(ev, grad, learning_rate, global_step, initial_accumulator_value=0.1,
                               epsilon=1e-7, l1=0.0, l2=0.0, l21=0.0):
    """GroupAdagrad (sparse group FTRL): Adagrad with a sparse group lasso per
    row (slots "accumulator" n, starting at `initial_accumulator_value`, and "linear").

    n += g^2; Q = sqrt(n + epsilon) / lr; z = z_prev + g - (Q - Q_prev) * w;
    then the same row solve as GroupAdam. With l1 = l2 = l21 = 0 this is
    Keras's Adagrad.
    """
    check_hyper("learning_rate", learning_rate, 0.0, False)
    for n, v in (("initial_accumulator_value", initial_accumulator_value), ("epsilon", epsilon), ("l1", l1),
                 ("l2", l2), ("l21", l21)):
        check_hyper(n, v)
    keys, values = _unpack(ev, grad)
    return gen.ev_apply_group_adagrad(**_apply_inputs(ev, keys, values, global_step), lr=_f32(learning_rate),
                                      epsilon=_f32(epsilon), l1=_f32(l1), l2=_f32(l2), l21=_f32(l21),
                                      initial_accumulator_value=float(initial_accumulator_value))
