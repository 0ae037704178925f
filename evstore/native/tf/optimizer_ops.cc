// Op registrations of the CTR optimizers (Ftrl, AdamW, GroupAdam,
// GroupAdagrad) and of the zero-row readout; kernels in optimizer_kernels.cc.
// Every apply takes (handle, keys, grads, global_step) then scalar
// hyper-parameters, like the applies in ev_ops.cc (EV_APPLY_COMMON, op_util.h).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"

REGISTER_OP("EvApplyFtrl")
    .EV_APPLY_COMMON.Input("lr: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l2_shrinkage: float")
    .Input("lr_power: float")
    .Attr("initial_accumulator_value: float = 0.1")
    .Doc("Keras/TF FTRL-proximal (ApplyFtrlV2 semantics); slots accumulator, linear.");

REGISTER_OP("EvApplyAdamW")
    .EV_APPLY_COMMON.Input("alpha: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Input("lr: float")
    .Input("weight_decay: float")
    .Doc("w -= w*weight_decay*lr on the batch's rows, then Adam; slots m, v.");

REGISTER_OP("EvApplyGroupAdam")
    .EV_APPLY_COMMON.Input("alpha: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l21: float")
    .Doc("Adam with sparse group lasso per row; slots m, v, linear.");

REGISTER_OP("EvApplyGroupAdagrad")
    .EV_APPLY_COMMON.Input("lr: float")
    .Input("epsilon: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("l21: float")
    .Attr("initial_accumulator_value: float = 0.1")
    .Doc("Adagrad with sparse group lasso per row (sparse group FTRL); slots accumulator, linear.");

REGISTER_OP("EvZeroRowKeys")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("keys: key_dtype")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("Keys of admitted rows whose embedding is all zero (e.g. dropped by the group lasso).");
