"""Fused sparse updates of EmbeddingVariables, as functions (any execution mode).

These are what `evstore.optimizers` run for EVs; use them directly in
`tf.compat.v1` graph mode (where Keras 3 optimizers cannot build a train op):

    grad = tf.compat.v1.gradients(loss, [ev])[0]          # IndexedSlices(row grads, keys)
    train_op = evstore.training.sparse_apply_adam(ev, grad, 1e-3, global_step)

Each call sums duplicate keys, updates every admitted key's row and slots in one
pass (absent and not-yet-admitted keys are skipped), stamps `version =
global_step` and marks the keys dirty. A gradient holding NaN/Inf is refused
with InvalidArgumentError naming the key, and nothing changes.
"""
import tensorflow as tf

from evstore._ops import gen

__all__ = ["sparse_apply_sgd", "sparse_apply_adagrad", "sparse_apply_adam"]


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


def sparse_apply_sgd(ev, grad, learning_rate, global_step, momentum=0.0, nesterov=False):
    """w -= lr * g; with momentum (Keras semantics, slot "momentum"):
    m = momentum * m - lr * g; w += m (nesterov: w += momentum * m - lr * g)."""
    keys, values = _unpack(ev, grad)
    if momentum == 0:
        return gen.ev_apply_sgd(ev.resource_handle, keys, values, _step(global_step), _f32(learning_rate))
    return gen.ev_apply_momentum(ev.resource_handle, keys, values, _step(global_step), _f32(learning_rate),
                                 _f32(momentum), nesterov=bool(nesterov))


def sparse_apply_adagrad(ev, grad, learning_rate, global_step, epsilon=1e-7, initial_accumulator_value=0.1):
    """acc += g^2; w -= lr * g / sqrt(acc + epsilon) (slot "accumulator", new
    rows start at `initial_accumulator_value`)."""
    keys, values = _unpack(ev, grad)
    return gen.ev_apply_adagrad(ev.resource_handle, keys, values, _step(global_step), _f32(learning_rate),
                                _f32(epsilon), initial_accumulator_value=float(initial_accumulator_value))


def sparse_apply_adam(ev, grad, learning_rate, global_step, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                      adam_step=None):
    """Adam with global beta powers (slots "m", "v"):
    m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); w -= alpha * m / (sqrt(v) + epsilon),
    alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), t = `adam_step` (default global_step + 1)."""
    keys, values = _unpack(ev, grad)
    t = _f32(_step(global_step) + 1 if adam_step is None else adam_step)
    b1, b2 = _f32(beta_1), _f32(beta_2)
    alpha = _f32(learning_rate) * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
    return gen.ev_apply_adam(ev.resource_handle, keys, values, _step(global_step), alpha, b1, b2, _f32(epsilon))
