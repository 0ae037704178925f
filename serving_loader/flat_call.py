"""Calling a serving signature fast: its flat inputs straight into the inference function
(FlatCall), and the one-example batch of zeros that probes and warms a signature (zero_example)."""
import logging

import numpy as np
import tensorflow as tf

__all__ = ["zero_example", "FlatCall"]

log = logging.getLogger("evstore.serving")


def zero_example(inputs):
    """One example of zeros (empty strings for string inputs) for a
    signature's `inputs`: {name: (np dtype, or None for strings; shape as a
    list, None for any size)}. Returns {name: ndarray}, unknown sizes 1."""
    return {n: np.full([1 if d is None else d for d in shape], *((b"", object) if dtype is None else (0, dtype)))
            for n, (dtype, shape) in inputs.items()}


class FlatCall:
    """A signature called on its flat inputs, without ConcreteFunction.__call__'s
    per-call argument binding, a large share of a one-row call's cost
    (bench/LOG.md).

    Built once per signature: its parameter order, specs and captured inputs
    (the variables and tables) do not change while a model is served, since
    applies write variables in place. It uses TensorFlow internals
    (`_inference_function.call_preflattened`; the TF minor version is pinned),
    so `build` checks it against the public call on a probe batch and returns
    None (the public call is used) when it is missing or answers otherwise.
    `__call__` returns None for inputs it does not take as they are (names,
    dtypes, shapes); the public call then runs and raises its usual error.
    """

    def __init__(self, fn, positional=None):
        args, kw = fn.structured_input_signature
        if positional is None:
            self.names = list(fn.function_type.parameters)
            self.specs = [kw[n] for n in self.names]
        else:   # a function of positional parameters, fed from inputs named `positional`, in order
            self.names = list(positional)
            self.specs = list(args)
        self.captured = list(fn.captured_inputs)
        self._call = fn._inference_function.call_preflattened

    @classmethod
    def build(cls, fn, name, positional=None):
        """A FlatCall of `fn` (a signature's ConcreteFunction; or, with
        `positional` input names, a concrete function of positional
        parameters), or None when it does not answer as the public call."""
        try:
            flat = cls(fn, positional)
            if any(s.shape.rank is None for s in flat.specs):
                raise ValueError("an input of unknown rank")
            probe = zero_example({n: (None if s.dtype == tf.string else s.dtype.as_numpy_dtype, s.shape.as_list())
                                  for n, s in zip(flat.names, flat.specs)})
            want = fn(**probe) if positional is None else fn(*[probe[n] for n in flat.names])
            got = flat(probe)
            if got is None or set(got) != set(want) or not all(
                    np.array_equal(got[k].numpy(), want[k].numpy()) for k in want):
                raise ValueError("its answer differs from the public call's")
            return flat
        except Exception as e:  # noqa: BLE001 - any doubt: the public call
            log.info("signature %r is called through ConcreteFunction.__call__ (%s)", name, e)
            return None

    def __call__(self, inputs):
        if len(inputs) != len(self.names):
            return None
        flat = []
        for n, spec in zip(self.names, self.specs):
            a = inputs.get(n)
            if a is None:
                return None
            try:
                t = tf.convert_to_tensor(a, spec.dtype)
            except (TypeError, ValueError):
                return None
            if not spec.shape.is_compatible_with(t.shape):
                return None
            flat.append(t)
        return self._call(flat + self.captured)
