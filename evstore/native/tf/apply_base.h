// EvApplyBase: the shared front half of every fused sparse-apply kernel
// (training_kernels.cc, optimizer_kernels.cc): validates keys, gradients, the
// global step and scalar hyper-parameter inputs, refuses NaN/Inf gradients
// before anything changes, sums duplicate keys, then calls Run().
// Inputs are read by name: schema::kApplyInputs first, then the op's
// hyper-parameters (every input its registration lists after those), which
// Run() reads with Scalar(ctx, "name").
#pragma once
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../core/finite.h"
#include "../core/unique_sum.h"
#include "kernel_util.h"
#include "tensorflow/core/framework/op.h"

namespace evstore {
namespace tf {

// Shared validation, NaN/Inf refusal and dedup for the fused sparse applies.
// Subclasses supply Run(ctx, table, unique keys, summed grads, n, step).
template <typename K>
class EvApplyBase : public EvTableOp<K> {
 public:
  explicit EvApplyBase(OpKernelConstruction* c) : EvTableOp<K>(c) {
    const tensorflow::OpDef* def = nullptr;
    OP_REQUIRES_OK(c, tensorflow::OpRegistry::Global()->LookUpOpDef(c->def().op(), &def));
    for (int i = 0; i < def->input_arg_size(); ++i) {
      const std::string& name = def->input_arg(i).name();
      if (i < schema::kNumApplyInputs) {
        OP_REQUIRES(c, name == schema::kApplyInputs[i],
                    errors::Internal(c->def().op(), " input ", i, " is '", name, "', expected '",
                                     schema::kApplyInputs[i], "' (core/schema.h)"));
      } else {
        hparams_.push_back(name);
      }
    }
  }
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, grads, schema::kGradsInput);
    EV_INPUT(ctx, step, schema::kGlobalStepInput);
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector, got ", keys.shape().DebugString()));
    OP_REQUIRES(ctx, grads.dims() == 2 && grads.dim_size(0) == keys.dim_size(0) && grads.dim_size(1) == t.dim(),
                errors::InvalidArgument("gradient shape ", grads.shape().DebugString(), " does not match keys [",
                                        keys.dim_size(0), "] and the table's dim ", t.dim(),
                                        " (expected [", keys.dim_size(0), ", ", t.dim(), "])"));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("global_step must be a scalar"));
    for (const std::string& name : hparams_) {
      EV_INPUT(ctx, hp, name);
      OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(hp.shape()),
                  errors::InvalidArgument("hyper-parameter input '", name, "' must be a scalar"));
    }
    const int64_t n = keys.dim_size(0);
    const int dim = t.dim();
    const CoreKey<K>* k = kin.data();
    const float* g = grads.flat<float>().data();
    // NaN/Inf policy (core/finite.h): refuse the whole batch, change nothing.
    const int64_t bad = FirstNonFinite(g, n * dim);
    if (bad >= 0) {
      ctx->CtxFailure(errors::InvalidArgument(
          NonFiniteMessage(g[bad], KeyDtype<K>::Text(k[bad / dim]), bad / dim, "")));
      return;
    }
    if (n == 0) return;
    std::vector<CoreKey<K>> ukeys;
    std::vector<float> ugrads;
    int64_t un = UniqueSum(k, g, n, dim, &ukeys, &ugrads);
    EV_TRY(ctx, Run(ctx, t, ukeys.data(), ugrads.data(), un, step.scalar<int64_t>()()));
  }

 protected:
  // The scalar hyper-parameter input `name` (checked scalar in ComputeOn).
  float Scalar(OpKernelContext* ctx, absl::string_view name) {
    const Tensor* t = nullptr;
    const absl::Status s = ctx->input(name, &t);
    if (!s.ok()) {  // a kernel asking for a name its op does not have
      ctx->CtxFailure(s);
      return std::numeric_limits<float>::quiet_NaN();
    }
    return t->scalar<float>()();
  }
  virtual void Run(OpKernelContext* ctx, TableT<K>& t, const CoreKey<K>* k, const float* g, int64_t n, int64_t step) = 0;
  virtual void Run(OpKernelContext* ctx, TieredTableT<K>& t, const CoreKey<K>* k, const float* g, int64_t n,
                   int64_t step) = 0;

 private:
  std::vector<std::string> hparams_;  // input names after schema::kApplyInputs
};

// An apply body written once for both table types:
//   EV_APPLY_RUN(ctx, t, k, g, n, step) { ... }
#define EV_APPLY_RUN(ctx_, t_, k_, g_, n_, step_)                                                         \
  void Run(OpKernelContext* c_, TableT<K>& x_, const CoreKey<K>* a_, const float* b_, int64_t m_,          \
           int64_t s_) override {                                                                         \
    RunT(c_, x_, a_, b_, m_, s_);                                                                          \
  }                                                                                                        \
  void Run(OpKernelContext* c_, TieredTableT<K>& x_, const CoreKey<K>* a_, const float* b_, int64_t m_,    \
           int64_t s_) override {                                                                         \
    RunT(c_, x_, a_, b_, m_, s_);                                                                          \
  }                                                                                                        \
  template <typename TableType>                                                                            \
  void RunT(OpKernelContext* ctx_, TableType& t_, const CoreKey<K>* k_, const float* g_, int64_t n_, int64_t step_)

}  // namespace tf
}  // namespace evstore
