"""TF Serving's API semantics, shared by the REST and the gRPC front ends.

Facts taken from TF Serving's documentation and behaviour (api_rest.md,
http_rest_api_handler, json_tensor): canonical error codes and their HTTP
statuses, the JSON request formats (row "instances" / columnar "inputs", b64
strings, `signature_name` "" meaning the default), the JSON answer formats
(float32 text with at most 9 significant digits, `*_bytes` string outputs as
{"b64": ...}, NaN / Infinity bare), tf.Example requests of :classify /
:regress, and the model status / metadata documents. Nothing here touches a
socket; the model is reached through `Servable` (a ServingModel and its name).
"""
import base64
import binascii
import math

import numpy as np
import orjson

__all__ = ["ServingError", "HTTP_STATUS", "Servable", "parse_predict_json", "format_predict_json",
           "parse_examples_json", "float_text", "DEFAULT_SIGNATURE", "PREDICT_METHOD", "CLASSIFY_METHOD",
           "REGRESS_METHOD"]

DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
INIT_OP_SIGNATURE = "__saved_model_init_op"

# canonical code -> HTTP status (TF Serving's http_server.cc)
HTTP_STATUS = {"CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
               "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429,
               "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501,
               "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401}


class ServingError(Exception):
    """A refused or failed request: a canonical error `code` (gRPC's names,
    e.g. "INVALID_ARGUMENT") and a message. `http_status` is TF Serving's
    HTTP status for the code unless given (e.g. 413 for an oversize body)."""

    def __init__(self, code, message, http_status=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status or HTTP_STATUS[code]


def invalid(message):
    return ServingError("INVALID_ARGUMENT", message)


def serving_note(name, version=None):
    """What an error about a model not served appends to TF Serving's message,
    so the client learns the name to ask for: " (serving 'ctr')", or with
    `version` " (serving 'ctr' version 7)"."""
    return f" (serving {name!r}" + ("" if version is None else f" version {version}") + ")"


def missing_name_message(name):
    """GET /v1/models (no model name): TF Serving's 400 message, which lists no
    model (its REST API has no list of models), and the path to ask instead."""
    return f"Missing model name in request. This server serves {name!r}: GET /v1/models/{name}"


# ---- the served model as TF Serving sees it -----------------------------------
class Servable:
    """A ServingModel served as `name`: its signatures (method, inputs,
    outputs, dtypes) read once, TF Serving's model spec rules, the status and
    metadata documents."""

    def __init__(self, model, name):
        import tensorflow as tf

        self.model = model
        self.name = name
        self.default_signature = model.signature
        self.signature_defs = model.signature_defs
        self.inputs = {}    # signature -> {input name: (np dtype or None for strings, shape list, DT_ name)}
        self.outputs = {}   # signature -> {output name: DT_ name}
        for key, sig in self.signature_defs.items():
            if key == INIT_OP_SIGNATURE:
                continue
            self.inputs[key] = {n: (None if t.dtype == tf.string.as_datatype_enum
                                    else np.dtype(tf.as_dtype(t.dtype).as_numpy_dtype),
                                    [None if d.size < 0 else d.size for d in t.tensor_shape.dim]
                                    if not t.tensor_shape.unknown_rank else None,
                                    tf.as_dtype(t.dtype).name)
                                for n, t in sig.inputs.items()}
            self.outputs[key] = {n: tf.as_dtype(t.dtype).name for n, t in sig.outputs.items()}

    # -- model spec
    def check_spec(self, name, version=None, label=None):
        """TF Serving's servable lookup: NOT_FOUND for another model or a
        version not served, INVALID_ARGUMENT for a label (none is defined)."""
        if version is not None and label is not None:
            raise invalid(f"Both model version ({version}) and model version label ({label}) cannot be supplied.")
        want = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
        if name != self.name:
            raise ServingError("NOT_FOUND", f"Servable not found for request: {want}{serving_note(self.name)}")
        if label is not None:
            raise invalid(f"Unrecognized servable version label: {label}")
        if version is not None and version != self.version:
            raise ServingError("NOT_FOUND", f"Servable not found for request: {want}"
                                            f"{serving_note(self.name, self.version)}")

    def check_status_spec(self, name, label=None):
        if name != self.name:
            raise ServingError("NOT_FOUND", f"Could not find any versions of model {name}{serving_note(self.name)}")
        if label is not None:
            raise invalid(f"Unrecognized servable version label: {label}")

    @property
    def version(self):
        return self.model.version or 0

    def signature(self, name, method=None):
        """The signature key for request field `signature_name` ("" = the
        default); with `method`, it must be of that method (TF Serving's
        :classify / :regress rule)."""
        key = name or DEFAULT_SIGNATURE
        if key not in self.inputs:
            if method is None:
                raise invalid(f'Serving signature name: "{key}" not found in signature def')
            raise invalid(f"No signature was found with the name: {key}")
        if method is not None and self.signature_defs[key].method_name != method:
            what = "classification" if method == CLASSIFY_METHOD else "regression"
            raise invalid(f"Expected {what} signature method_name to be {method}. Was: "
                          f"{self.signature_defs[key].method_name}")
        return key

    # -- documents
    def versions(self, version=None):
        """[(version, "AVAILABLE" | "END")], newest first, as TF Serving's
        model status lists them: the served version, then each version served
        before it in this process (replaced: END)."""
        served = self.version
        seen = [served] + [v for v in reversed(self.model.applied_seqs[-1000:]) if v != served]
        out, done = [], set()
        for v in seen:
            if v not in done:
                done.add(v)
                out.append((v, "AVAILABLE" if v == served else "END"))
        if version is not None:
            out = [x for x in out if x[0] == version]
            if not out:
                raise ServingError("NOT_FOUND", f"Could not find version {version} of model {self.name}")
        return out

    def status_json(self, name, version=None, label=None):
        """TF Serving's model status document (GetModelStatusResponse as JSON)."""
        self.check_status_spec(name, label)
        gate = getattr(self.model, "gate", None)
        held = gate.held if gate is not None else None   # the quality gate holds the served version: say why
        note = (f"held by the quality gate: {held['reason']} ({len(held['commits'])} newer commits held back)"
                if held else "")
        return {"model_version_status": [{"version": str(v), "state": state,
                                          "status": {"error_code": "OK",
                                                     "error_message": note if state == "AVAILABLE" else ""}}
                                         for v, state in self.versions(version)]}

    def metadata_json(self):
        """TF Serving's REST metadata document: every signature of the export
        (the init-op one too) with default-valued fields written."""
        from google.protobuf import json_format

        sigs = {k: json_format.MessageToDict(v, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True)
                for k, v in self.signature_defs.items()}
        return {"model_spec": {"name": self.name, "signature_name": "", "version": str(self.version)},
                "metadata": {"signature_def": {"signature_def": sigs}}}


# ---- JSON requests -------------------------------------------------------------
def _loads(body):
    if not body:
        raise invalid("JSON Parse error: The document is empty")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if b"NaN" in body or b"Infinity" in body:   # TF Serving's parser takes NaN / Infinity
            doc = _loads_nan(body, e)
        else:
            raise invalid(f"JSON Parse error: {e}") from None
    if not isinstance(doc, dict):
        raise invalid(f"JSON Value: {_short(doc)} Is not object")
    return doc


def _loads_nan(body, err):
    import json

    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise invalid(f"JSON Parse error: {err}") from None


def _short(v, n=200):
    """`v` as JSON text, cut at `n` characters. orjson writes at most 254
    levels of nesting (the reader takes 1,024): a deeper value is shown by
    its type."""
    try:
        s = orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY, default=str).decode()
    except orjson.JSONEncodeError:
        return f"<{_json_type(v)} nested too deeply to show>"
    return s if len(s) <= n else s[:n] + "..."


def _signature_name(doc):
    sig = doc.get("signature_name", "")
    if not isinstance(sig, str):
        raise invalid(f"JSON Value: {_short(doc)} not formatted correctly. 'signature_name' key must be a "
                      "string value.")
    return sig


def _is_b64(v):
    return type(v) is dict and len(v) == 1 and type(v.get("b64")) is str


def _b64(v):
    try:
        return base64.b64decode(v["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid("Unable to base64 decode") from None


# A tensor has at most this many dimensions (TensorFlow's limit): deeper
# nesting in a string input is refused before it is walked.
MAX_RANK = 254


def _strings(name, value, depth=0):
    """Nested JSON strings / {"b64": ...} objects -> nested bytes."""
    if type(value) is list:
        if depth >= MAX_RANK:
            raise invalid(f"input {name!r}: nested deeper than {MAX_RANK} levels")
        return [_strings(name, v, depth + 1) for v in value]
    if type(value) is str:
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:   # a lone surrogate ("\ud800"), which only the NaN-tolerant reader lets through
            raise invalid(f"input {name!r}: a string is not valid Unicode (a lone surrogate)") from None
    if _is_b64(value):
        return _b64(value)
    raise invalid(f"JSON Value: {_short(value)} Type: {_json_type(value)} is not of expected type: string "
                  f"(input {name!r})")


def _json_type(v):
    return {dict: "Object", list: "Array", str: "String", bool: "True" if v is True else "False",
            type(None): "Null"}.get(type(v), "Number")


_F32_MAX_INT = 2 ** 24 - 1
_F32_MAX = float(np.finfo(np.float32).max)


def to_array(name, value, spec):
    """JSON `value` as an ndarray for input `name` of `spec` (np dtype or None
    for strings, shape, DT name); ServingError(INVALID_ARGUMENT) otherwise."""
    dtype, shape, dt = spec
    if dtype is None:
        raw = np.array(_strings(name, value), dtype=object)
    else:
        try:
            raw = np.asarray(value)
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise invalid(f"input {name!r}: not a rectangular array of {dt} values") from None
    if shape is not None and (raw.ndim != len(shape) or
                              any(d is not None and d != g for d, g in zip(shape, raw.shape))):
        dims = ",".join("-1" if d is None else str(d) for d in shape)
        raise invalid(f"input {name!r} must have shape [{dims}] (batch first), got "
                      f"[{','.join(map(str, raw.shape))}]")
    if dtype is None:
        return raw
    kind = raw.dtype.kind
    if raw.size == 0:
        return raw.astype(dtype)
    if dtype.kind in "iu":
        if kind not in "iu":
            raise invalid(f"input {name!r}: JSON values of type {_kind_name(raw)} are not of expected type: {dt}")
        info = np.iinfo(dtype)
        if raw.dtype != dtype:
            lo, hi = int(raw.min()), int(raw.max())
            if lo < info.min or hi > info.max:
                raise invalid(f"input {name!r}: values in [{lo}, {hi}] are out of range for {dt}")
            return raw.astype(dtype)
        return raw
    if dtype.kind == "f":
        if kind in "iu":
            if dtype.itemsize == 4 and int(np.abs(raw).max()) > _F32_MAX_INT:
                raise invalid(f"Cannot convert JSON value: {int(np.abs(raw).max())} to float without loss of "
                              f"precision (input {name!r}).")
        elif kind == "f":
            if dtype.itemsize == 4:
                big = np.abs(raw[np.isfinite(raw)])
                if big.size and float(big.max()) > _F32_MAX:
                    raise invalid(f"Cannot convert JSON value: {float(big.max())} to float without loss of "
                                  f"precision (input {name!r}).")
        else:
            raise invalid(f"input {name!r}: JSON values of type {_kind_name(raw)} are not of expected type: {dt}")
        return raw.astype(dtype, copy=False)
    if dtype.kind == "b":
        if kind != "b":
            raise invalid(f"input {name!r}: JSON values of type {_kind_name(raw)} are not of expected type: {dt}")
        return raw
    raise ServingError("UNIMPLEMENTED", f"Conversion of JSON values to type: {dt} (input {name!r})")


def _kind_name(raw):
    return {"f": "Number (decimal)", "b": "Bool", "U": "String", "i": "Number", "u": "Number"}.get(
        raw.dtype.kind, "Object / Null / mixed")


def parse_predict_json(body, servable):
    """A :predict body -> (signature key, {input name: ndarray}, "row" | "columnar").

    TF Serving's rules: unknown top-level fields are ignored; "signature_name"
    "" or absent is the default; exactly one of "instances" / "inputs"."""
    doc = _loads(body)
    key = servable.signature(_signature_name(doc))
    inputs = servable.inputs[key]
    names = sorted(inputs)
    if "instances" in doc:
        if "inputs" in doc:
            raise invalid("Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist")
        rows = doc["instances"]
        if type(rows) is not list:
            raise invalid("Excepting 'instances' to be an list/array")
        if not rows:
            raise invalid("No values in 'instances' array")
        named = type(rows[0]) is dict and not _is_b64(rows[0])
        if not named:
            if len(inputs) > 1:
                raise invalid("instances is a plain list, but expecting list of objects as multiple input tensors "
                              "required as per tensorinfo_map")
            for i, r in enumerate(rows):
                if type(r) is dict and not _is_b64(r):
                    raise invalid(f"Expecting value/list but got object at item {i} of input list")
            return key, {names[0]: to_array(names[0], rows, inputs[names[0]])}, "row"
        want = set(inputs)
        for i, r in enumerate(rows):
            if type(r) is not dict or _is_b64(r):
                raise invalid(f"Expecting object but got list at item {i} of input list")
            if r.keys() != want:
                unknown = sorted(set(r) - want)
                if unknown:
                    raise invalid(f"JSON object: does not have named input: {unknown[0]} (item {i} of "
                                  "'instances')")
                raise invalid(f"Failed to process element: {i} of 'instances' list. JSON object: {_short(r)} "
                              f"keys must be equal to: {','.join(names)}")
        return key, {n: to_array(n, [r[n] for r in rows], inputs[n]) for n in names}, "row"
    if "inputs" in doc:
        cols = doc["inputs"]
        if type(cols) is not dict or _is_b64(cols):
            if len(inputs) > 1:
                raise invalid("inputs is a plain value/list, but expecting an object as multiple input tensors "
                              "required as per tensorinfo_map")
            return key, {names[0]: to_array(names[0], cols, inputs[names[0]])}, "columnar"
        for n in names:
            if n not in cols:
                raise invalid(f"Missing named input: {n} in 'inputs' object.")
        # named keys the signature does not take are ignored, as TF Serving does
        return key, {n: to_array(n, cols[n], inputs[n]) for n in names}, "columnar"
    raise invalid("Missing 'inputs' or 'instances' key")


# ---- JSON answers ----------------------------------------------------------------
def float_text(v, digits9=False):
    """TF Serving's text of a float32 (double: 17 digits): %g, or %.9g where
    6 digits do not round-trip; whole numbers get ".0"; NaN / Infinity bare."""
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "Infinity" if v > 0 else "-Infinity"
    s = "%g" % v
    if digits9:
        if float(s) != v:
            s = "%.17g" % v
    elif float(np.float32(float(s))) != v:
        s = "%.9g" % v
    if "." not in s and "e" not in s:
        s += ".0"
    return s


def _tokens(a, as_bytes):
    """The flat JSON tokens of ndarray `a`."""
    k = a.dtype.kind
    if k == "f":
        if a.dtype == np.float64:
            return [float_text(v, True) for v in a.ravel().tolist()]
        return [float_text(v) for v in a.astype(np.float32, copy=False).ravel().tolist()]
    if k in "iu":
        return [str(v) for v in a.ravel().tolist()]
    if k == "b":
        return ["true" if v else "false" for v in a.ravel().tolist()]
    if k in "SO":
        vals = a.ravel().tolist()
        if as_bytes:
            return ['{"b64":"' + base64.b64encode(v).decode() + '"}' for v in vals]
        return [orjson.dumps(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)).decode()
                for v in vals]
    raise ServingError("INVALID_ARGUMENT", f"Failed to write JSON value for tensor type: {a.dtype}")


def _nest(tokens, shape, start=0):
    if not shape:
        return tokens[start]
    if len(shape) == 1:
        return "[" + ",".join(tokens[start:start + shape[0]]) + "]"
    step = int(np.prod(shape[1:]))
    return "[" + ",".join(_nest(tokens, shape[1:], start + i * step) for i in range(shape[0])) + "]"


def tensor_json(a, name):
    return _nest(_tokens(a, name.endswith("_bytes")), a.shape)


def _key(name):
    return orjson.dumps(name).decode()


def format_predict_json(outputs, fmt):
    """TF Serving's :predict answer (bytes) for `outputs` ({name: ndarray}) to
    a request in format `fmt` ("row" | "columnar")."""
    names = sorted(outputs)
    if not names:
        raise invalid("Cannot convert empty tensor map to JSON")
    if fmt == "columnar":
        if len(names) == 1:
            return ('{"outputs":' + tensor_json(outputs[names[0]], names[0]) + "}").encode()
        return ('{"outputs":{' + ",".join(_key(n) + ":" + tensor_json(outputs[n], n) for n in names)
                + "}}").encode()
    batch = None
    for n in names:
        a = outputs[n]
        if a.ndim == 0:
            raise invalid(f"Tensor name: {n} has no shape information ")
        if batch is not None and a.shape[0] != batch:
            raise invalid(f"Tensor name: {n} has inconsistent batch size: {a.shape[0]} expecting: {batch}")
        batch = a.shape[0]
    if len(names) == 1:
        a = outputs[names[0]]
        toks = _tokens(a, names[0].endswith("_bytes"))
        step = int(np.prod(a.shape[1:]))
        items = [_nest(toks, a.shape[1:], i * step) for i in range(batch)]
        return ('{"predictions":[' + ",".join(items) + "]}").encode()
    cols = {}
    for n in names:
        a = outputs[n]
        cols[n] = (_tokens(a, n.endswith("_bytes")), a.shape[1:], int(np.prod(a.shape[1:])))
    items = ["{" + ",".join(_key(n) + ":" + _nest(t, s, i * st) for n, (t, s, st) in cols.items()) + "}"
             for i in range(batch)]
    return ('{"predictions":[' + ",".join(items) + "]}").encode()


def format_classify_json(scores, classes):
    """{"results": [[[label, score], ...] per example]}: `scores` [batch, n]
    float or None, `classes` [batch, n] bytes or None."""
    ref = scores if scores is not None else classes
    out = []
    for i in range(ref.shape[0]):
        pairs = []
        for j in range(ref.shape[1]):
            label = classes[i, j].decode("utf-8", "replace") if classes is not None else ""
            score = float_text(float(scores[i, j])) if scores is not None else "0.0"
            pairs.append("[" + _key(label) + "," + score + "]")
        out.append("[" + ",".join(pairs) + "]")
    return ('{"results":[' + ",".join(out) + "]}").encode()


def format_regress_json(values):
    return ('{"results":[' + ",".join(float_text(float(v)) for v in values.ravel().tolist()) + "]}").encode()


# ---- tf.Example requests (:classify / :regress) -------------------------------------
def _feature(name, content):
    """A JSON feature value (scalar or list) -> tf.train.Feature, TF Serving's typing rules."""
    from tensorflow.core.example import feature_pb2

    f = feature_pb2.Feature()
    kind = None
    for v in (content if type(content) is list else [content]):
        t = type(v)
        if t is bool:
            k, val = "int64_list", int(v)
        elif t is int:
            if not -2 ** 63 <= v < 2 ** 63:
                raise invalid(f"Feature: {name} has uint64 element. Only int64 is supported.")
            k, val = "int64_list", v
        elif t is float:
            if math.isfinite(v) and abs(v) > _F32_MAX:
                raise invalid(f"Cannot convert JSON value: {v} to float without loss of precision.")
            k, val = "float_list", v
        elif t is str:
            k, val = "bytes_list", v.encode("utf-8")
        elif _is_b64(v):
            k, val = "bytes_list", _b64(v)
        else:
            raise invalid(f"Feature: {name} has element with unexpected JSON type: {_json_type(v)}")
        if kind is not None and k != kind:
            raise invalid(f"Unexpected element type in feature: {name} expecting type: {kind.split('_')[0]}")
        kind = k
        getattr(f, k).value.append(val)
    return f


def _example(obj):
    from tensorflow.core.example import example_pb2

    if type(obj) is not dict:
        raise invalid(f"Example must be JSON object but got JSON {_json_type(obj)}")
    ex = example_pb2.Example()
    for name, content in obj.items():
        ex.features.feature[name].CopyFrom(_feature(name, content))
    return ex


def parse_examples_json(body, method):
    """A :classify / :regress body -> (signature_name, [serialized tf.Example]).
    A "context" example's features are merged into every example (as TF
    Serving does for an ExampleListWithContext)."""
    doc = _loads(body)
    sig = _signature_name(doc)
    context = _example(doc["context"]) if "context" in doc else None
    if "examples" not in doc:
        what = "classify" if method == CLASSIFY_METHOD else "regress"
        raise invalid(f"When method is {what}, key 'examples' is expected and was not found")
    exs = doc["examples"]
    if type(exs) is not list:
        raise invalid("Expecting 'examples' value to be an list/array")
    if not exs:
        raise invalid("'examples' value is an empty array")
    return sig, examples_with_context([_example(e) for e in exs], context)


def examples_with_context(examples, context):
    out = []
    for ex in examples:
        if context is not None:
            merged = type(ex)()
            merged.CopyFrom(context)
            merged.MergeFrom(ex)
            ex = merged
        out.append(ex.SerializeToString())
    return out
