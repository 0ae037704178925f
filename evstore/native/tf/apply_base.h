// EvApplyBase: the shared front half of every fused sparse-apply kernel
// (training_kernels.cc, optimizer_kernels.cc): validates keys, gradients, the
// global step and scalar hyper-parameter inputs, refuses NaN/Inf gradients
// before anything changes, sums duplicate keys, then calls Run().
#pragma once
#include <cmath>
#include <vector>

#include "../core/unique_sum.h"
#include "kernel_util.h"

namespace evstore {
namespace tf {

// Shared validation, NaN/Inf refusal and dedup for the fused sparse applies.
// Subclasses supply Run(ctx, table, unique keys, summed grads, n, step).
template <typename K>
class EvApplyBase : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const Tensor& keys = ctx->input(1);
    const Tensor& grads = ctx->input(2);
    const Tensor& step = ctx->input(3);
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector, got ", keys.shape().DebugString()));
    OP_REQUIRES(ctx, grads.dims() == 2 && grads.dim_size(0) == keys.dim_size(0) && grads.dim_size(1) == t.dim(),
                errors::InvalidArgument("gradient shape ", grads.shape().DebugString(), " does not match keys [",
                                        keys.dim_size(0), "] and the table's dim ", t.dim(),
                                        " (expected [", keys.dim_size(0), ", ", t.dim(), "])"));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("global_step must be a scalar"));
    for (int i = 4; i < ctx->num_inputs(); ++i)
      OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(ctx->input(i).shape()),
                  errors::InvalidArgument("hyper-parameter input ", i, " must be a scalar"));
    const int64_t n = keys.dim_size(0);
    const int dim = t.dim();
    const K* k = keys.flat<K>().data();
    const float* g = grads.flat<float>().data();
    // NaN/Inf policy: refuse the whole batch, change nothing.
    for (int64_t i = 0; i < n * dim; ++i) {
      if (!std::isfinite(g[i])) {
        ctx->CtxFailure(errors::InvalidArgument(
            "non-finite gradient (", g[i], ") for key ", static_cast<int64_t>(k[i / dim]), " at batch position ",
            i / dim, "; nothing was applied. Check the loss for NaN/Inf or clip gradients."));
        return;
      }
    }
    if (n == 0) return;
    std::vector<K> ukeys;
    std::vector<float> ugrads;
    int64_t un = UniqueSum(k, g, n, dim, &ukeys, &ugrads);
    EV_TRY(ctx, Run(ctx, t, ukeys.data(), ugrads.data(), un, step.scalar<int64_t>()()));
  }

 protected:
  float Scalar(OpKernelContext* ctx, int i) { return ctx->input(i).scalar<float>()(); }
  virtual void Run(OpKernelContext* ctx, Table<K>& t, const K* k, const float* g, int64_t n, int64_t step) = 0;
};

}  // namespace tf
}  // namespace evstore
