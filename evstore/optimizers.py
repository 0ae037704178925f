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
  SGD with momentum: "momentum"; Adagrad: "accumulator"; Adam, AdamW: "m", "v";
  Ftrl: "accumulator", "linear"; GroupAdam: "m", "v", "linear";
  GroupAdagrad: "accumulator", "linear".
* the learning rate may be a float, a `tf.Variable` (read at every step, so
  assigning to it takes effect at the next step) or a Keras
  `LearningRateSchedule` (evaluated at `optimizer.iterations`).
* hyper-parameters are checked when the optimizer is built: a learning rate
  <= 0, a negative l1 / l2 / l21 / weight decay, or a beta outside [0, 1)
  raises ValueError naming the parameter.
* Adam's bias correction uses the optimizer's global step (global beta powers,
  as TensorFlow, DeepRec and TFPlus do), so a row touched rarely is corrected
  as if it had been updated every step.
* NaN/Inf policy: a batch holding any non-finite EV gradient is refused with
  `tf.errors.InvalidArgumentError` naming the key, and changes nothing (evstore/finite.py).
"""
import threading

import keras
import tensorflow as tf

from evstore import collective as _collective
from evstore import generic
from evstore import training
from evstore.variable import EmbeddingVariable, ev_for_variable

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "GroupAdam", "GroupAdagrad", "VariableLearningRate"]


# Registered Keras serializables ("evstore>Adam", ...): compiled models load
# from .keras files and clone with no custom_objects once evstore is imported.
_serializable = keras.saving.register_keras_serializable(package="evstore")


def _check_lr(learning_rate):
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool) and learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")


def _lr_arg(learning_rate):
    """Validates a learning rate and returns it in a form Keras 3 accepts: a
    float, a `LearningRateSchedule`, a callable, or a `tf.Variable` / keras
    Variable (wrapped in a callable so that every step reads its current value)."""
    if isinstance(learning_rate, bool):
        raise TypeError("learning_rate must be a float, a tf.Variable or a LearningRateSchedule, got a bool")
    if isinstance(learning_rate, (int, float)):
        _check_lr(learning_rate)
        return float(learning_rate)
    if isinstance(learning_rate, (tf.Variable, keras.Variable)):
        return VariableLearningRate(learning_rate)
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) or callable(learning_rate):
        return learning_rate
    raise TypeError("learning_rate must be a float, a tf.Variable or a keras LearningRateSchedule, got "
                    f"{type(learning_rate).__name__}")


@_serializable
class VariableLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate held in a variable, read at every step: assigning to
    the variable takes effect at the next step. What the optimizers make of a
    `tf.Variable` / keras Variable `learning_rate`.

    Its config holds the variable's value when it is taken (a saved model
    loads with a new variable holding that value), so optimizers given a
    variable serialize without code (Keras refuses to load a lambda).
    """

    def __init__(self, variable):
        if not isinstance(variable, (tf.Variable, keras.Variable)):
            variable = tf.Variable(float(variable), trainable=False, name="learning_rate")
        self.variable = variable

    def __call__(self, step):
        del step
        return tf.cast(self.variable, tf.float32)

    def get_config(self):
        return {"variable": float(tf.convert_to_tensor(self.variable).numpy())}


def _check_betas(beta_1, beta_2):
    for n, b in (("beta_1", beta_1), ("beta_2", beta_2)):
        training.check_hyper(n, b, 0.0, True, 1.0)


def _proxy_of(v):
    """The variable an optimizer updates for `v`: an EV's proxy (a
    CollectiveEmbeddingVariable's: its local shard's), else `v`."""
    if isinstance(v, _collective.CollectiveEmbeddingVariable):
        return v.local._proxy
    return v._proxy if isinstance(v, EmbeddingVariable) else v


def _owned_shard(variable):
    ev = ev_for_variable(variable)
    return ev is not None and _collective.owner_of(ev) is not None


class _EVMixin:
    """Routes EV gradients to fused kernels; everything else to Keras."""

    _ev_local = threading.local()  # per-thread `global_step` of the current apply

    def apply_gradients(self, grads_and_vars, global_step=None):
        """Applies gradients to EVs and variables. `global_step` (int or int64
        tensor), when given, stamps the versions of updated EV keys."""
        self._ev_local.global_step = global_step
        # Under a tf.distribute strategy in a replica context (ParameterServerStrategy
        # runs each replica function in its own thread), Keras applies the
        # updates in a merge_call, which runs in the strategy's main thread:
        # the thread-local value is not visible there, this one is.
        outer, self._ev_merge_step = getattr(self, "_ev_merge_step", None), global_step
        try:
            return super().apply_gradients(grads_and_vars)
        finally:
            self._ev_local.global_step = None
            self._ev_merge_step = outer

    def build(self, var_list):
        # A worker's shard of a CollectiveEmbeddingVariable keeps its slots in
        # its table; Keras slots for its (worker-local, zero-size) proxy would be
        # mirrored, and broadcasting a zero-size variable is a zero-element
        # collective, which the runtime does not survive (model.fit builds the
        # optimizer on every trainable weight).
        return super().build([v for v in var_list if not _owned_shard(v)])

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            trainable_variables = [_proxy_of(v) for v in trainable_variables]
            grads = generic.refuse_non_finite(list(grads), trainable_variables)
            evs = [ev_for_variable(v) for v in trainable_variables]
            owned = [i for i, ev in enumerate(evs) if ev is not None and _collective.owner_of(ev) is not None]
            if owned:
                return self._apply_with_owned_shards(grads, trainable_variables, owned)
        self._ev_scalars = {}
        try:
            return super().apply(grads, trainable_variables)
        finally:
            self._ev_scalars = None

    def _apply_with_owned_shards(self, grads, variables, owned):
        """Synchronous mode (evstore/collective.py): a worker's shard of a
        CollectiveEmbeddingVariable gets its gradient from the all-to-all,
        summed over the workers already, and applies it here, at the step's
        `iterations`; only the other variables go through Keras (all-reduced
        by the strategy, which then counts the step)."""
        self._ev_scalars = {}
        try:
            lr = self._get_current_learning_rate()
            for i in owned:
                if grads[i] is not None:
                    self.update_step(grads[i], variables[i], lr)
        finally:
            self._ev_scalars = None
        rest = [i for i in range(len(variables)) if i not in set(owned)]
        if rest:
            self._ev_scalars = {}
            try:
                return super().apply([grads[i] for i in rest], [variables[i] for i in rest])
            finally:
                self._ev_scalars = None
        self.iterations.assign_add(1)

    def _ev_scalar(self, name, fn):
        """A per-step scalar shared by every EV apply of this step (computed
        once, where the step is computed): on parameter servers each distinct
        tensor is one transfer per server, so one per step, not one per table."""
        cache = getattr(self, "_ev_scalars", None)
        if cache is None:
            return fn()
        if name not in cache:
            with tf.device(None):
                cache[name] = fn()
        return cache[name]

    def ev_slot_initial_values(self):
        """{slot name: initial value} of the slots this optimizer keeps in EV
        rows, as its kernels declare them: `initial_accumulator_value` for an
        "accumulator" (Adagrad, Ftrl, GroupAdagrad), 0 for every other slot."""
        acc = float(getattr(self, "initial_accumulator_value", 0.0))
        return {n: acc if n == "accumulator" else 0.0 for n in self.ev_slot_names}

    def _adam_step(self):
        return self._ev_scalar("adam_step", lambda: self.iterations + 1)

    def update_step(self, gradient, variable, learning_rate):
        ev = ev_for_variable(variable)
        if ev is None:
            return super().update_step(gradient, variable, learning_rate)
        gradient = generic.ev_gradient(gradient, variable, ev)
        step = getattr(self._ev_local, "global_step", None)
        if step is None:
            step = getattr(self, "_ev_merge_step", None)
        step = self.iterations if step is None else step
        step = self._ev_scalar("step", lambda: tf.cast(step, tf.int64))
        lr = self._ev_scalar("learning_rate", lambda: tf.cast(learning_rate, tf.float32))
        # The per-table hyper-parameter arithmetic (Adam's alpha, constants)
        # runs where the table is: computed on the worker, each would be one
        # more transfer per table and step.
        with tf.device(ev.device or None):
            return self._ev_apply(ev, gradient, lr, step, variable=variable)


@_serializable
class SGD(_EVMixin, keras.optimizers.SGD):
    """Stochastic gradient descent (Keras semantics), optional momentum / Nesterov."""

    @property
    def ev_slot_names(self):
        """Names of the slots this optimizer keeps in EV rows."""
        return ("momentum",) if self.momentum else ()

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, **kwargs):
        learning_rate = _lr_arg(learning_rate)
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        return training.sparse_apply_sgd(ev, grad, lr, step, momentum=self.momentum, nesterov=self.nesterov)


@_serializable
class Adagrad(_EVMixin, keras.optimizers.Adagrad):
    """Adagrad (Keras semantics): acc += g^2; w -= lr * g / sqrt(acc + epsilon)."""

    ev_slot_names = ("accumulator",)   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7, **kwargs):
        learning_rate = _lr_arg(learning_rate)
        if initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}")
        super().__init__(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value,
                         epsilon=epsilon, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        return training.sparse_apply_adagrad(ev, grad, lr, step, epsilon=self.epsilon,
                                             initial_accumulator_value=self.initial_accumulator_value)


@_serializable
class Adam(_EVMixin, keras.optimizers.Adam):
    """Adam (Keras semantics, global beta powers; amsgrad is not supported for EVs)."""

    ev_slot_names = ("m", "v")   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, **kwargs):
        learning_rate = _lr_arg(learning_rate)
        _check_betas(beta_1, beta_2)
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        if self.amsgrad:
            raise ValueError("evstore.optimizers.Adam: amsgrad is not supported for EmbeddingVariables")
        return training.sparse_apply_adam(ev, grad, lr, step, beta_1=self.beta_1, beta_2=self.beta_2,
                                          epsilon=self.epsilon, adam_step=self._adam_step())


@_serializable
class AdamW(_EVMixin, keras.optimizers.AdamW):
    """AdamW (Keras semantics; slots "m", "v"): decoupled weight decay
    `w -= w * weight_decay * lr`, then the Adam update.

    Dense variables decay every step exactly as with `keras.optimizers.AdamW`.
    **EmbeddingVariables decay only the rows being updated** (the keys in the
    step's gradient), in the same fused pass as the Adam update: a row not seen
    in a step keeps its value. (Decaying every row of a table each step would
    cost O(table) per step and would dirty every key for the next delta
    checkpoint.) `exclude_from_weight_decay` applies to EVs by their name.
    """

    ev_slot_names = ("m", "v")   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 **kwargs):
        learning_rate = _lr_arg(learning_rate)
        _check_betas(beta_1, beta_2)
        if weight_decay is None:
            raise ValueError("weight_decay must be a float >= 0, got None")
        training.check_hyper("weight_decay", weight_decay)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        if self.amsgrad:
            raise ValueError("evstore.optimizers.AdamW: amsgrad is not supported for EmbeddingVariables")
        decays = variable is None or self._use_weight_decay(variable)
        return training.sparse_apply_adamw(ev, grad, lr, step, weight_decay=self.weight_decay if decays else 0.0,
                                           beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                                           adam_step=self._adam_step())


@_serializable
class Ftrl(_EVMixin, keras.optimizers.Ftrl):
    """FTRL-proximal with TensorFlow's semantics (Keras Ftrl, TF's ApplyFtrlV2);
    slots "accumulator" (starts at `initial_accumulator_value`) and "linear".

    learning_rate_power (<= 0; -0.5 is Adagrad-like), l1 / l2 regularisation,
    l2_shrinkage (an L2 penalty in the gradient, TF's "online" L2), beta (adds
    beta / (2 * lr) to l2, as Keras). Dense variables train exactly as with
    `keras.optimizers.Ftrl`; EV rows get the same update fused in one pass.
    """

    ev_slot_names = ("accumulator", "linear")   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l2_shrinkage_regularization_strength=0.0, beta=0.0, **kwargs):
        learning_rate = _lr_arg(learning_rate)
        if isinstance(learning_rate_power, (int, float)) and learning_rate_power > 0:
            raise ValueError(f"learning_rate_power must be <= 0, got {learning_rate_power}")
        for n, v in (("initial_accumulator_value", initial_accumulator_value),
                     ("l1_regularization_strength", l1_regularization_strength),
                     ("l2_regularization_strength", l2_regularization_strength),
                     ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength),
                     ("beta", beta)):
            training.check_hyper(n, v)
        super().__init__(learning_rate=learning_rate, learning_rate_power=learning_rate_power,
                         initial_accumulator_value=initial_accumulator_value,
                         l1_regularization_strength=l1_regularization_strength,
                         l2_regularization_strength=l2_regularization_strength,
                         l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength, beta=beta,
                         **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        return training.sparse_apply_ftrl(
            ev, grad, lr, step, learning_rate_power=self.learning_rate_power,
            initial_accumulator_value=self.initial_accumulator_value, l1=self.l1_regularization_strength,
            l2=self.l2_regularization_strength, l2_shrinkage=self.l2_shrinkage_regularization_strength,
            beta=self.beta)


# ---- sparse group lasso (GroupAdam, GroupAdagrad) ------------------------------------
#
# Dense variables are solved row-wise, like EV rows: a variable of rank >= 2 is
# viewed as [shape[0], rest] and each row (e.g. one input feature of a Dense
# kernel) is a group; a 1-D variable of n elements is n groups of one element
# (the group lasso then acts as an extra L1 on each); a scalar is one group.
# The math is the fused row update's (core/optimizers.h: GroupLassoRow), in
# the same float operations.

def _rows(x):
    """`x` viewed as [groups, group size] (see above)."""
    if x.shape.rank is not None and x.shape.rank >= 2:
        return tf.reshape(x, [tf.shape(x)[0], -1])
    return tf.reshape(x, [-1, 1])


def _group_lasso(w, u, d, q, l1, l2, l21):
    """One row solve: returns (new w, new linear) for rows `w` [r, k], linear
    u = z_prev + Q_prev * w, first-order term d and denominator q."""
    z = u + d - q * w
    s = tf.clip_by_value(z, -l1, l1) - z
    norm = tf.sqrt(tf.reduce_sum(s * s, axis=1, keepdims=True))
    thr = l21 * tf.sqrt(tf.cast(tf.shape(w)[1], tf.float32))
    scale = tf.where(norm > thr, 1.0 - thr / tf.maximum(norm, 1e-30), 0.0)
    w_new = tf.where(scale == 0.0, tf.zeros_like(w), scale * s / (q + 2.0 * l2))
    return w_new, z + q * w_new


def _dense(gradient):
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


class _DenseGroupAdam(keras.optimizers.Optimizer):
    def __init__(self, learning_rate, beta_1, beta_2, epsilon, l1_regularization_strength,
                 l2_regularization_strength, l21_regularization_strength, name, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.l21_regularization_strength = l21_regularization_strength

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities, self._linears = self.add_optimizer_variables(
            var_list, ["m", "v", "linear"])

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        m_var, v_var, u_var = self._momentums[i], self._velocities[i], self._linears[i]
        lr = tf.cast(learning_rate, tf.float32)
        t = tf.cast(self.iterations + 1, tf.float32)
        b1, b2 = tf.cast(self.beta_1, tf.float32), tf.cast(self.beta_2, tf.float32)
        alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
        g = _rows(tf.cast(_dense(gradient), tf.float32))
        w, m, v, u = (_rows(tf.convert_to_tensor(x)) for x in (variable, m_var, v_var, u_var))
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        q = (tf.sqrt(v) + self.epsilon) / alpha
        w, u = _group_lasso(w, u, m, q, self.l1_regularization_strength, self.l2_regularization_strength,
                            self.l21_regularization_strength)
        shape = tf.shape(variable)
        for var, val in ((m_var, m), (v_var, v), (u_var, u), (variable, w)):
            self.assign(var, tf.reshape(val, shape))

    def get_config(self):
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                       "l1_regularization_strength": self.l1_regularization_strength,
                       "l2_regularization_strength": self.l2_regularization_strength,
                       "l21_regularization_strength": self.l21_regularization_strength})
        return config


@_serializable
class GroupAdam(_EVMixin, _DenseGroupAdam):
    """Group Adam: Adam with a sparse group lasso (l1, l2, l21) per row; slots
    "m", "v", "linear". From "Adaptive Optimizers with Sparse Group Lasso for
    Neural Networks in CTR Prediction" (ECML PKDD 2021), TFPlus' GroupAdam.

    Per row (one EV key; for dense variables see the note above), with Adam's
    m, v and alpha = lr * sqrt(1 - b2^t) / (1 - b1^t) (global beta powers):
    Q = (sqrt(v) + epsilon) / alpha; z = z_prev + m - (Q - Q_prev) * w;
    s = clip(z, -l1, l1) - z; if ||s|| <= l21 * sqrt(dim) the row becomes
    exactly zero (the feature is dropped), else
    w = (1 - l21 * sqrt(dim) / ||s||) * s / (Q + 2 * l2).
    The "linear" slot stores z + Q * w. With l1 = l2 = l21 = 0 this is Adam.
    Zeroed rows are counted in `ev.stats()["zero_rows"]` and listed by
    `ev.zero_row_keys()`; they stay zero while their gradients stay small.
    """

    ev_slot_names = ("m", "v", "linear")   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l21_regularization_strength=0.0, name="group_adam", **kwargs):
        learning_rate = _lr_arg(learning_rate)
        _check_betas(beta_1, beta_2)
        for n, v in (("epsilon", epsilon), ("l1_regularization_strength", l1_regularization_strength),
                     ("l2_regularization_strength", l2_regularization_strength),
                     ("l21_regularization_strength", l21_regularization_strength)):
            training.check_hyper(n, v)
        super().__init__(learning_rate, beta_1, beta_2, epsilon, l1_regularization_strength,
                         l2_regularization_strength, l21_regularization_strength, name, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        return training.sparse_apply_group_adam(
            ev, grad, lr, step, beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
            l1=self.l1_regularization_strength, l2=self.l2_regularization_strength,
            l21=self.l21_regularization_strength, adam_step=self._adam_step())


class _DenseGroupAdagrad(keras.optimizers.Optimizer):
    def __init__(self, learning_rate, initial_accumulator_value, epsilon, l1_regularization_strength,
                 l2_regularization_strength, l21_regularization_strength, name, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.initial_accumulator_value, self.epsilon = initial_accumulator_value, epsilon
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.l21_regularization_strength = l21_regularization_strength

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators, self._linears = self.add_optimizer_variables(
            var_list, ["accumulator", "linear"],
            initializer=[keras.initializers.Constant(self.initial_accumulator_value), "zeros"])

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        n_var, u_var = self._accumulators[i], self._linears[i]
        lr = tf.cast(learning_rate, tf.float32)
        g = _rows(tf.cast(_dense(gradient), tf.float32))
        w, n, u = (_rows(tf.convert_to_tensor(x)) for x in (variable, n_var, u_var))
        n = n + g * g
        q = tf.sqrt(n + self.epsilon) / lr
        w, u = _group_lasso(w, u, g, q, self.l1_regularization_strength, self.l2_regularization_strength,
                            self.l21_regularization_strength)
        shape = tf.shape(variable)
        for var, val in ((n_var, n), (u_var, u), (variable, w)):
            self.assign(var, tf.reshape(val, shape))

    def get_config(self):
        config = super().get_config()
        config.update({"initial_accumulator_value": self.initial_accumulator_value, "epsilon": self.epsilon,
                       "l1_regularization_strength": self.l1_regularization_strength,
                       "l2_regularization_strength": self.l2_regularization_strength,
                       "l21_regularization_strength": self.l21_regularization_strength})
        return config


@_serializable
class GroupAdagrad(_EVMixin, _DenseGroupAdagrad):
    """Group Adagrad (sparse group FTRL): Adagrad with a sparse group lasso
    (l1, l2, l21) per row; slots "accumulator" (starts at
    `initial_accumulator_value`) and "linear". TFPlus' SparseGroupFtrl.

    n += g^2; Q = sqrt(n + epsilon) / lr (sigma = Q - Q_prev, the FTRL step);
    z = z_prev + g - (Q - Q_prev) * w; then the row solve of `GroupAdam`. With
    l1 = l2 = l21 = 0 this is Keras's Adagrad from any initial row (unlike
    `Ftrl`, whose linear term starts at 0 and so pulls weights towards 0).
    """

    ev_slot_names = ("accumulator", "linear")   # the slots this optimizer keeps in EV rows

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l21_regularization_strength=0.0, name="group_adagrad", **kwargs):
        learning_rate = _lr_arg(learning_rate)
        for n, v in (("initial_accumulator_value", initial_accumulator_value), ("epsilon", epsilon),
                     ("l1_regularization_strength", l1_regularization_strength),
                     ("l2_regularization_strength", l2_regularization_strength),
                     ("l21_regularization_strength", l21_regularization_strength)):
            training.check_hyper(n, v)
        super().__init__(learning_rate, initial_accumulator_value, epsilon, l1_regularization_strength,
                         l2_regularization_strength, l21_regularization_strength, name, **kwargs)

    def _ev_apply(self, ev, grad, lr, step, variable=None):
        return training.sparse_apply_group_adagrad(
            ev, grad, lr, step, initial_accumulator_value=self.initial_accumulator_value, epsilon=self.epsilon,
            l1=self.l1_regularization_strength, l2=self.l2_regularization_strength,
            l21=self.l21_regularization_strength)
