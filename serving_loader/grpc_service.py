"""TF Serving's gRPC API: tensorflow.serving.PredictionService (Predict,
Classify, Regress, GetModelMetadata) and tensorflow.serving.ModelService
(GetModelStatus), on the protos and stubs of the `tensorflow-serving-api`
package, served by grpc's asyncio server on the REST server's event loop.

Requests reach the model exactly as REST ones do (ServingApp.submit: the
default signature through the batcher, resolved on the loop without a thread
hand-off); errors are TF Serving's canonical codes (grpc.StatusCode of
ServingError.code) with its messages. The asyncio server costs about a third
of the CPU per call of grpc's thread-pool server here (no handler thread per
call, no thread wake-up per answer; BENCHMARKS.md "Serving over the network").
ModelService.HandleReloadConfigRequest is not served (UNIMPLEMENTED): the
model comes from the export and its checkpoint root.
"""
import grpc
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc,
                                     regression_pb2)

from serving_loader.tfs import CLASSIFY_METHOD, REGRESS_METHOD, ServingError, examples_with_context, invalid

__all__ = ["start_grpc", "tensor_to_array", "array_to_tensor"]

_STRING = tf.string.as_datatype_enum
_ENUM = {}   # np.dtype -> DataType enum


# DataType enum -> the TensorProto field holding its values one by one.
_VALUE_FIELD = {tf.float32.as_datatype_enum: "float_val", tf.float64.as_datatype_enum: "double_val",
                tf.int32.as_datatype_enum: "int_val", tf.int16.as_datatype_enum: "int_val",
                tf.int8.as_datatype_enum: "int_val", tf.uint8.as_datatype_enum: "int_val",
                tf.int64.as_datatype_enum: "int64_val", tf.bool.as_datatype_enum: "bool_val"}


def _enum(dtype):
    e = _ENUM.get(dtype)
    if e is None:
        e = _ENUM[dtype] = tf.as_dtype(dtype).as_datatype_enum
    return e


def _values(name, proto, dtype, dims):
    """The ndarray of TensorProto `proto` (dtype: np dtype, None for strings)."""
    n = int(np.prod(dims))
    if dtype is not None and proto.tensor_content:
        a = np.frombuffer(proto.tensor_content, dtype=dtype)
        if a.size != n:
            raise invalid(f"input {name!r}: tensor_content holds {a.size} values, shape {dims} needs {n}")
        return a.reshape(dims)
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


def tensor_to_array(name, proto, spec):
    """TensorProto -> ndarray for input `name` of signature spec (np dtype or
    None for strings, shape, DT name); INVALID_ARGUMENT when it does not fit."""
    dtype, shape, dt = spec
    want = _STRING if dtype is None else _enum(dtype)
    if proto.dtype != want:
        got = tf.as_dtype(proto.dtype).name if proto.dtype else "DT_INVALID"
        raise invalid(f"Expects arg[{name}] to be {dt} but {got} is provided")
    a = _values(name, proto, dtype, [d.size for d in proto.tensor_shape.dim])
    if shape is not None and (a.ndim != len(shape) or any(d is not None and d != g for d, g in zip(shape, a.shape))):
        want_dims = ",".join("-1" if d is None else str(d) for d in shape)
        raise invalid(f"input {name!r} must have shape [{want_dims}], got [{','.join(map(str, a.shape))}]")
    return a


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


def _spec(request):
    spec = request.model_spec
    version = spec.version.value if spec.HasField("version") else None
    label = spec.version_label if spec.WhichOneof("version_choice") == "version_label" else None
    return spec.name, version, label


async def _abort(context, e):
    if isinstance(e, ServingError):
        await context.abort(getattr(grpc.StatusCode, e.code), e.message)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, app):
        self.app = app
        self.servable = app.servable

    def _fill_spec(self, response, key, version):
        response.model_spec.name = self.servable.name
        response.model_spec.version.value = version or 0
        response.model_spec.signature_name = key

    async def _call(self, key, arrays, version):
        outputs, served = await self.app.submit(key, arrays)
        if version is not None and (served or 0) != version:
            raise ServingError("NOT_FOUND", f"Servable not found for request: Specific({self.servable.name}, "
                                            f"{version})")
        return outputs, served

    async def Predict(self, request, context):
        try:
            name, version, label = _spec(request)
            self.servable.check_spec(name, version, label)
            key = self.servable.signature(request.model_spec.signature_name)
            inputs = self.servable.inputs[key]
            sent = set(request.inputs)
            if sent != inputs.keys():
                raise invalid(f"Request inputs do not match required inputs for model `{name}`. Send extra: "
                              f"{{{','.join(sorted(sent - inputs.keys()))}}}. Missing but required: "
                              f"{{{','.join(sorted(inputs.keys() - sent))}}}.")
            wanted = list(request.output_filter) or None
            outs = self.servable.outputs[key]
            for n in wanted or ():
                if n not in outs:
                    raise invalid(f"output tensor alias not found in signature: {n} Outputs expected to be in the "
                                  f"set {{{','.join(sorted(outs))}}}.")
            arrays = {n: tensor_to_array(n, request.inputs[n], inputs[n]) for n in inputs}
            outputs, served = await self._call(key, arrays, version)
            response = predict_pb2.PredictResponse()
            self._fill_spec(response, key, served)
            for n in wanted or outputs:
                array_to_tensor(outputs[n], response.outputs[n])
            return response
        except Exception as e:  # noqa: BLE001 - answered with its status
            await _abort(context, e)

    async def _examples(self, request, method):
        name, version, label = _spec(request)
        self.servable.check_spec(name, version, label)
        key = self.servable.signature(request.model_spec.signature_name, method)
        kind = request.input.WhichOneof("kind")
        if kind == "example_list":
            examples = examples_with_context(request.input.example_list.examples, None)
        elif kind == "example_list_with_context":
            lst = request.input.example_list_with_context
            examples = examples_with_context(lst.examples, lst.context)
        else:
            examples = []
        if not examples:
            raise invalid("Input is empty.")
        (input_name,) = self.servable.inputs[key]
        outputs, served = await self._call(key, {input_name: np.array(examples, dtype=object)}, version)
        return key, outputs, served

    async def Classify(self, request, context):
        try:
            key, outputs, served = await self._examples(request, CLASSIFY_METHOD)
            scores, classes = outputs.get("scores"), outputs.get("classes")
            if scores is None and classes is None:
                raise invalid("classification signature has neither 'classes' nor 'scores'")
            ref = scores if scores is not None else classes
            ref = ref.reshape(ref.shape[0], -1)
            scores = None if scores is None else scores.reshape(ref.shape)
            classes = None if classes is None else classes.reshape(ref.shape)
            response = classification_pb2.ClassificationResponse()
            self._fill_spec(response, key, served)
            for i in range(ref.shape[0]):
                c = response.result.classifications.add()
                for j in range(ref.shape[1]):
                    cls = c.classes.add()
                    if classes is not None:
                        cls.label = classes[i, j].decode("utf-8", "replace")
                    if scores is not None:
                        cls.score = float(scores[i, j])
            return response
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def Regress(self, request, context):
        try:
            key, outputs, served = await self._examples(request, REGRESS_METHOD)
            if "outputs" not in outputs:
                raise invalid("regression signature has no 'outputs'")
            response = regression_pb2.RegressionResponse()
            self._fill_spec(response, key, served)
            for v in outputs["outputs"].ravel().tolist():
                response.result.regressions.add().value = v
            return response
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def GetModelMetadata(self, request, context):
        try:
            name, version, label = _spec(request)
            self.servable.check_spec(name, version, label)
            if not request.metadata_field:
                raise invalid("GetModelMetadataRequest must specify at least one metadata_field")
            for f in request.metadata_field:
                if f != "signature_def":
                    raise invalid(f"Metadata field {f} is not supported")
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            response.model_spec.name = self.servable.name
            response.model_spec.version.value = self.servable.version
            sigs = get_model_metadata_pb2.SignatureDefMap()
            for k, v in self.servable.signature_defs.items():
                sigs.signature_def[k].CopyFrom(v)
            response.metadata["signature_def"].Pack(sigs)
            return response
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, app):
        self.servable = app.servable

    async def GetModelStatus(self, request, context):
        try:
            name, version, label = _spec(request)
            self.servable.check_status_spec(name, label)
            response = get_model_status_pb2.GetModelStatusResponse()
            states = get_model_status_pb2.ModelVersionStatus.State
            for v, state in self.servable.versions(version):
                s = response.model_version_status.add()
                s.version = v
                s.state = states.Value(state)
                s.status.error_code = 0
            return response
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)


async def start_grpc(app, host, port):
    """Starts the gRPC server of `app` on host:port (0: any free port) on the
    running event loop; returns (server, bound port). Stop it with
    `await server.stop(grace_s)`."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", app.max_request_bytes),
                                      ("grpc.so_reuseport", 0)])
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(app), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(app), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot bind the gRPC port {address}")
    await server.start()
    return server, bound
