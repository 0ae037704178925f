// What every op registration (*_ops.cc) shares, defined once:
//  - EV_KEY_DTYPES: the key types a table takes. A new key type is this line
//    plus one line in kernel_util.h's EV_REGISTER_KEYED_ATTR; the op strings
//    are built from it at compile time, so each op's signature (the pinned op
//    ABI the Python side loads) is the same string as when it was spelt out.
//  - EV_APPLY_COMMON: the inputs every optimizer apply op starts with.
//  - SetOutputs: a shape function's body when it only sets each output's shape.
// Registrations only: nothing here knows a kernel or a table.
#pragma once

#include <initializer_list>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

#define EV_KEY_DTYPES "{int32, int64, string}"
// The `key_dtype` attr of every op that takes one table handle.
#define EV_KEY_DTYPE_ATTR "key_dtype: " EV_KEY_DTYPES
// What every optimizer apply (ev_ops.cc, optimizer_ops.cc) takes first: the
// table, the keys, their gradient rows and the step; no outputs. Its scalar
// hyper-parameters follow: REGISTER_OP("EvApplySgd").EV_APPLY_COMMON.Input("lr: float");
#define EV_APPLY_COMMON              \
  Input("handle: resource")          \
      .Input("keys: key_dtype")      \
      .Input("grads: float")         \
      .Input("global_step: int64")   \
      .Attr(EV_KEY_DTYPE_ATTR)       \
      .SetShapeFn(tensorflow::shape_inference::NoOutputs)

namespace evstore {
namespace tf {

// Output i gets shapes[i]; e.g. `return SetOutputs(c, {c->Scalar(), c->Vector(3)});`.
inline absl::Status SetOutputs(tensorflow::shape_inference::InferenceContext* c,
                               std::initializer_list<tensorflow::shape_inference::ShapeHandle> shapes) {
  int i = 0;
  for (const auto& s : shapes) c->set_output(i++, s);
  return absl::OkStatus();
}

// A lookup's output: keys.shape + [dim] (input 1 is the keys, `dim` an attr).
inline absl::Status RowsShape(tensorflow::shape_inference::InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  tensorflow::shape_inference::ShapeHandle out;
  TF_RETURN_IF_ERROR(c->Concatenate(c->input(1), c->Vector(dim), &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

}  // namespace tf
}  // namespace evstore
