// Op registrations for feature eviction (kernels: evict_kernels.cc).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"

REGISTER_OP("EvEvict")
    .Input("handle: resource")
    .Input("global_step: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("steps_to_live: int = -1")
    .Attr("l2_threshold: float = 0")
    .Attr("return_rows: bool = false")
    .Output("evicted: int64")
    .Output("evicted_keys: key_dtype")
    .Output("evicted_values: float")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      return evstore::tf::SetOutputs(c, {c->Scalar(), c->Vector(c->UnknownDim()),
                                         c->Matrix(c->UnknownDim(), c->UnknownDim())});
    })
    .Doc("Evicts keys with global_step - version > steps_to_live (steps_to_live >= 0) or whose "
         "embedding's L2 norm < l2_threshold (> 0). global_step < 0: the table's clock (highest step "
         "seen). Evicted keys join the deleted set; their rows the free list. Returns how many, and "
         "with return_rows the evicted keys and their embeddings [n, dim] (empty otherwise).");
