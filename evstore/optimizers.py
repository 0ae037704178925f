"""Optimizers that train EmbeddingVariables (fused native apply) and ordinary variables.

Each class is the Keras 3 optimizer of the same name (so dense `tf.Variable`s
and `keras.Variable`s train exactly as with `keras.optimizers.X`, and the
object works in `model.compile`), extended so that gradients of
EmbeddingVariables go to one fused native kernel per EV and step:

* the gradient of an EV is `tf.IndexedSlices(values=row grads, indices=keys)`;
  duplicate keys are summed, then each admitted key's row and its slots are
  read once and updated in place. Absent and not-yet-admitted keys are skipped.
* every updated key gets `version = global_step` and is marked dirty. The step
  is `optimizer.iterations` (steps completed before this one), or the
  `global_step=` given to `apply_gradients`.
* slots live in the EV row (`[w | slot...]`) and appear in `ev.export()["slots"]`:
  SGD with momentum: "momentum"; Adagrad: "accumulator"; Adam: "m", "v".
* Adam's bias correction uses the optimizer's global step (global beta powers,
  as TensorFlow, DeepRec and TFPlus do), so a row touched rarely is corrected
  as if it had been updated every step.
* NaN/Inf policy: a batch holding any non-finite EV gradient is refused with
  `tf.errors.InvalidArgumentError` naming the key, and changes nothing.
"""
import threading

import keras
import tensorflow as tf

from evstore import training
from evstore._ops import gen
from evstore.variable import EmbeddingVariable, ev_for_variable

__all__ = ["SGD", "Adagrad", "Adam"]


def _check_lr(learning_rate):
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool) and learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")


class _EVMixin:
    """Routes EV gradients to fused kernels; everything else to Keras."""

    _ev_local = threading.local()  # per-thread `global_step` of the current apply

    def apply_gradients(self, grads_and_vars, global_step=None):
        """Applies gradients to EVs and variables. `global_step` (int or int64
        tensor), when given, stamps the versions of updated EV keys."""
        self._ev_local.global_step = global_step
        try:
            return super().apply_gradients(grads_and_vars)
        finally:
            self._ev_local.global_step = None

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = [v._proxy if isinstance(v, EmbeddingVariable) else v
                                   for v in trainable_variables]
            grads = _refuse_non_finite(list(grads), [ev_for_variable(v) for v in trainable_variables])
        return super().apply(grads, trainable_variables)

    def update_step(self, gradient, variable, learning_rate):
        ev = ev_for_variable(variable)
        if ev is None:
            return super().update_step(gradient, variable, learning_rate)
        step = getattr(self._ev_local, "global_step", None)
        step = self.iterations if step is None else step
        return self._ev_apply(ev, gradient, tf.cast(learning_rate, tf.float32), step)


def _refuse_non_finite(grads, evs):
    """NaN/Inf policy: if any EV gradient is non-finite, fail before *any*
    variable (EV or dense) is updated, so a refused step changes nothing."""
    checks = []
    for g, ev in zip(grads, evs):
        if ev is not None and isinstance(g, tf.IndexedSlices):
            checks.append(gen.ev_check_finite(g.indices, tf.cast(g.values, tf.float32), ev_name=ev.name))
    if not checks:
        return grads
    out = []
    with tf.control_dependencies(checks):
        for g in grads:
            if g is None:
                out.append(g)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape))
            else:
                out.append(tf.identity(g))
    return out


class SGD(_EVMixin, keras.optimizers.SGD):
    """Stochastic gradient descent (Keras semantics), optional momentum / Nesterov."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, **kwargs):
        _check_lr(learning_rate)
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)

    def _ev_apply(self, ev, grad, lr, step):
        return training.sparse_apply_sgd(ev, grad, lr, step, momentum=self.momentum, nesterov=self.nesterov)


class Adagrad(_EVMixin, keras.optimizers.Adagrad):
    """Adagrad (Keras semantics): acc += g^2; w -= lr * g / sqrt(acc + epsilon)."""

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7, **kwargs):
        _check_lr(learning_rate)
        if initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}")
        super().__init__(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value,
                         epsilon=epsilon, **kwargs)

    def _ev_apply(self, ev, grad, lr, step):
        return training.sparse_apply_adagrad(ev, grad, lr, step, epsilon=self.epsilon,
                                             initial_accumulator_value=self.initial_accumulator_value)


class Adam(_EVMixin, keras.optimizers.Adam):
    """Adam (Keras semantics, global beta powers; amsgrad is not supported for EVs)."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, **kwargs):
        _check_lr(learning_rate)
        for n, b in (("beta_1", beta_1), ("beta_2", beta_2)):
            if isinstance(b, (int, float)) and not 0.0 <= b < 1.0:
                raise ValueError(f"{n} must be in [0, 1), got {b}")
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, **kwargs)

    def _ev_apply(self, ev, grad, lr, step):
        if self.amsgrad:
            raise ValueError("evstore.optimizers.Adam: amsgrad is not supported for EmbeddingVariables")
        return training.sparse_apply_adam(ev, grad, lr, step, beta_1=self.beta_1, beta_2=self.beta_2,
                                          epsilon=self.epsilon, adam_step=self.iterations + 1)
