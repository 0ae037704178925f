// Ops of the generic optimizer path (kernels: row_kernels.cc; Python:
// evstore/generic.py): gradient dedup, row + slot read and write by key.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"

namespace evstore {
namespace tf {

using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("EvUniqueSum")
    .Input("keys: Tkeys")
    .Input("grads: float")
    .Attr("Tkeys: " EV_KEY_DTYPES)
    .Output("unique_keys: Tkeys")
    .Output("summed: float")
    .SetShapeFn([](InferenceContext* c) {
      return evstore::tf::SetOutputs(c, {c->Vector(InferenceContext::kUnknownDim),
                                         c->Matrix(InferenceContext::kUnknownDim, c->Dim(c->input(1), 1))});
    })
    .Doc("Unique keys (first-occurrence order) and the sums of their gradient rows.");

REGISTER_OP("EvReadRows")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("slot_names: string")
    .Input("slot_inits: float")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Output("values: float")
    .Output("slots: float")
    .Output("admitted: bool")
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      auto n = c->Dim(c->input(1), 0);
      auto s = c->Dim(c->input(2), 0);
      return evstore::tf::SetOutputs(c, {c->MakeShape({n, dim}), c->MakeShape({s, n, dim}), c->MakeShape({n})});
    })
    .Doc("Reads the rows and the named slots (created with their initial values if missing) of keys. "
         "Never inserts or counts; rows of keys without a row read as zeros with admitted = false.");

REGISTER_OP("EvWriteRows")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("values: float")
    .Input("slots: float")
    .Input("slot_names: string")
    .Input("slot_inits: float")
    .Input("global_step: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("written: int64")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Writes rows and named slots of unique keys that own a row: version = global_step, key marked dirty. "
         "Keys without a row are skipped.");

}  // namespace tf
}  // namespace evstore
