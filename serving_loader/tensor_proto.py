"""TensorProto <-> ndarray for the gRPC API, with hostile input refused
before anything is allocated for it.

A TensorProto names its dtype and shape and then carries its values, either
packed (`tensor_content`) or one by one in a typed field (`float_val`, ...,
`string_val`), where fewer values than elements is TF's broadcast form (the
last value repeats). A 117-byte request can therefore ask for a tensor of any
size. Before decoding, tensor_to_array checks, in this order, and answers
INVALID_ARGUMENT (a ServingError) for:

* a dtype enum that is not the signature's (unknown enums such as 9999 or -1
  included);
* a rank over MAX_RANK, or a negative dimension;
* an element count whose bytes (8 a string: one reference each) exceed
  `limits.max_bytes` (the server's --max_request_bytes: no decoded input is
  larger than a request may be), or a 0th dimension over `limits.max_batch`
  (the batcher's max_batch_size) when the input is batched;
* `tensor_content` that is not exactly elements x item size bytes.

Only then are values read, so memory spent on a request is bounded by its
own bytes and those two limits.
"""
import math

import numpy as np
import tensorflow as tf

from serving_loader.tfs import invalid

__all__ = ["MAX_RANK", "TensorLimits", "tensor_to_array", "array_to_tensor"]

# Highest rank of an input tensor; the served signatures' inputs have rank 1-3.
MAX_RANK = 32

_STRING = tf.string.as_datatype_enum
_ENUM = {}   # np.dtype -> DataType enum
_STRING_ITEM_BYTES = 8   # one object reference per element of a decoded string tensor

# DataType enum -> the TensorProto field holding its values one by one.
_VALUE_FIELD = {tf.float32.as_datatype_enum: "float_val", tf.float64.as_datatype_enum: "double_val",
                tf.int32.as_datatype_enum: "int_val", tf.int16.as_datatype_enum: "int_val",
                tf.int8.as_datatype_enum: "int_val", tf.uint8.as_datatype_enum: "int_val",
                tf.int64.as_datatype_enum: "int64_val", tf.bool.as_datatype_enum: "bool_val"}


class TensorLimits:
    """Bounds on one decoded input tensor.

    Args:
      max_bytes: most bytes of its decoded values (strings: 8 per element).
      max_batch: most rows (0th dimension), or None for no bound.
    """

    def __init__(self, max_bytes, max_batch=None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                      or max_batch <= 0):
            raise ValueError(f"max_batch must be a positive integer or None, got {max_batch!r}")
        self.max_bytes = max_bytes
        self.max_batch = max_batch


def _enum(dtype):
    e = _ENUM.get(dtype)
    if e is None:
        e = _ENUM[dtype] = tf.as_dtype(dtype).as_datatype_enum
    return e


def _dtype_name(enum):
    """DT name of a DataType enum, for messages (any int32, unknown ones included)."""
    if enum == 0:
        return "DT_INVALID"
    try:
        return tf.as_dtype(enum).name
    except TypeError:
        return f"unknown dtype enum {enum}"


def _checked_dims(name, proto, item_bytes, limits):
    """The dims of `proto` once rank, signs and element count are within bounds."""
    dim = proto.tensor_shape.dim
    if len(dim) > MAX_RANK:
        raise invalid(f"input {name!r} has rank {len(dim)}, over the most this server takes ({MAX_RANK})")
    dims = [d.size for d in dim]
    if any(d < 0 for d in dims):
        raise invalid(f"input {name!r} has a negative dimension in its shape {dims}")
    if limits is not None:
        if limits.max_batch is not None and dims and dims[0] > limits.max_batch:
            raise invalid(f"input {name!r} has {dims[0]} rows (0th dimension), over the batch limit "
                          f"{limits.max_batch} (--max_batch_size)")
        most = limits.max_bytes // item_bytes
        n = 1
        for d in dims:   # stops before the product grows past `most` (no overflow, no huge ints)
            n *= d
            if n > most:
                raise invalid(f"input {name!r} of shape {dims} holds more than {most} elements of "
                              f"{item_bytes} bytes, over the request limit of {limits.max_bytes} bytes "
                              "(--max_request_bytes)")
    return dims


def _values(name, proto, dtype, dims):
    """The ndarray of TensorProto `proto` (dtype: np dtype, None for strings)."""
    n = math.prod(dims)   # np.prod builds an array for a short list; math.prod does not
    if dtype is not None and proto.tensor_content:
        if len(proto.tensor_content) != n * dtype.itemsize:
            raise invalid(f"input {name!r}: tensor_content holds {len(proto.tensor_content)} bytes, shape {dims} "
                          f"of {dtype.name} needs {n * dtype.itemsize}")
        return np.frombuffer(proto.tensor_content, dtype=dtype).reshape(dims)
    field = None if dtype is None else _VALUE_FIELD.get(proto.dtype)
    if field is not None and len(getattr(proto, field)) == n:
        # One value per element in a typed field (what tf.make_tensor_proto
        # writes for a single value, so every batch-1 request): read directly,
        # at a fraction of tf.make_ndarray's cost per request.
        return np.array(getattr(proto, field), dtype=dtype).reshape(dims)
    try:   # strings, broadcast forms (fewer values than elements), packed half / complex
        a = tf.make_ndarray(proto)
    except (ValueError, TypeError) as e:
        raise invalid(f"input {name!r}: {e}") from None
    return a if dtype is None else a.astype(dtype, copy=False)


def tensor_to_array(name, proto, spec, limits=None):
    """TensorProto -> ndarray for input `name` of signature spec (np dtype or
    None for strings, shape, DT name), within TensorLimits `limits` (None: no
    size bounds, for trusted callers). Raises ServingError INVALID_ARGUMENT
    when it does not fit, before decoding anything (see the module docstring)."""
    dtype, shape, dt = spec
    want = _STRING if dtype is None else _enum(dtype)
    if proto.dtype != want:
        raise invalid(f"Expects arg[{name}] to be {dt} but {_dtype_name(proto.dtype)} is provided")
    dims = _checked_dims(name, proto, _STRING_ITEM_BYTES if dtype is None else np.dtype(dtype).itemsize, limits)
    if shape is not None and (len(dims) != len(shape) or any(d is not None and d != g for d, g in zip(shape, dims))):
        want_dims = ",".join("-1" if d is None else str(d) for d in shape)
        raise invalid(f"input {name!r} must have shape [{want_dims}], got [{','.join(map(str, dims))}]")
    return _values(name, proto, None if dtype is None else np.dtype(dtype), dims)


def array_to_tensor(a, proto):
    """Fills TensorProto `proto` with ndarray `a` (tensor_content for numbers,
    string_val for strings, as TF Serving answers)."""
    if a.dtype.kind in "SO":
        proto.dtype = _STRING
        proto.string_val.extend(a.ravel().tolist())
    else:
        proto.dtype = _enum(a.dtype)
        proto.tensor_content = np.ascontiguousarray(a).tobytes()
    dim = proto.tensor_shape.dim
    for s in a.shape:
        dim.add().size = s
    return proto

