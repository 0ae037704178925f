// Kernels of a training step: lookups and fused sparse optimizer applies.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../core/finite.h"
#include "apply_base.h"
#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

// ---------------------------------------------------------------- lookups

template <typename K, bool kTrain>
class EvLookupOp : public EvDimTableOp<K> {
 public:
  using EvDimTableOp<K>::EvDimTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    if (!this->DimMatches(ctx, res.dim())) return;
    const ServingRows* serving = res.serving();
    OP_REQUIRES(ctx, !(kTrain && serving),
                errors::FailedPrecondition("a serving table takes no training lookups (EvFindOrInsert)"));
    EV_KEYS_INPUT(ctx, keys, kin);
    TensorShape shape = keys.shape();
    shape.AddDim(dim_);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    const int64_t n = keys.NumElements();
    if (n == 0) return;
    const CoreKey<K>* k = kin.data();
    float* o = out->flat<float>().data();
    if (kTrain) {
      EV_TRY(ctx, t.FindOrInsert(k, n, o, IntraOp(ctx)));
    } else if (serving) {
      // Rows decoded from the serving table's precision; each lookup counts
      // in the key's frequency (the tier's cache weight).
      const float* dflt = serving->default_value().data();
      const int64_t dim = dim_;
      EV_TRY(ctx, t.FindEach(k, n, /*count=*/true, IntraOp(ctx), [&](int64_t i, const float* row) {
        if (row)
          serving->Decode(row, o + i * dim);
        else
          std::memcpy(o + i * dim, dflt, dim * sizeof(float));
      }));
    } else {
      EV_TRY(ctx, t.Find(k, n, o, IntraOp(ctx)));
    }
  }

 private:
  using EvDimTableOp<K>::dim_;
};

// ---------------------------------------------------------------- apply

template <typename K>
class EvApplySgdOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    t.Apply(k, g, n, step, SgdUpdate{this->Scalar(ctx, "lr"), t.dim()}, IntraOp(ctx));
  }
};

template <typename K>
class EvApplyMomentumOp : public EvApplyBase<K> {
 public:
  explicit EvApplyMomentumOp(OpKernelConstruction* c) : EvApplyBase<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
  }
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    auto off = t.EnsureSlots({{"momentum", 0.f}});
    t.Apply(k, g, n, step,
            MomentumUpdate{this->Scalar(ctx, "lr"), this->Scalar(ctx, "momentum"), nesterov_, t.dim(), off[0]},
            IntraOp(ctx));
  }

 private:
  bool nesterov_;
};

template <typename K>
class EvApplyAdagradOp : public EvApplyBase<K> {
 public:
  explicit EvApplyAdagradOp(OpKernelConstruction* c) : EvApplyBase<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("initial_accumulator_value", &init_));
  }
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    auto off = t.EnsureSlots({{"accumulator", init_}});
    t.Apply(k, g, n, step, AdagradUpdate{this->Scalar(ctx, "lr"), this->Scalar(ctx, "epsilon"), t.dim(), off[0]},
            IntraOp(ctx));
  }

 private:
  float init_;
};

template <typename K>
class EvApplyAdamOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    auto off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    AdamUpdate u{this->Scalar(ctx, "alpha"), this->Scalar(ctx, "beta1"), this->Scalar(ctx, "beta2"),
                 this->Scalar(ctx, "epsilon"), t.dim(), off[0], off[1]};
    t.Apply(k, g, n, step, u, IntraOp(ctx));
  }
};

// Forwards a gradient batch or fails naming the first non-finite key; the
// optimizers run it on every EV gradient before updating any variable.
template <typename K>
class EvCheckFiniteOp : public OpKernel {
 public:
  explicit EvCheckFiniteOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("ev_name", &name_)); }
  void Compute(OpKernelContext* ctx) override {
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, grads, "grads");
    const int64_t n = keys.NumElements();
    const int64_t total = grads.NumElements();
    const int64_t dim = n > 0 ? total / n : 0;
    const float* g = grads.flat<float>().data();
    const CoreKey<K>* k = kin.data();
    // NaN/Inf policy (core/finite.h), checked before any variable changes.
    const int64_t bad = FirstNonFinite(g, total);
    if (bad >= 0) {
      const int64_t row = dim > 0 ? bad / dim : 0;
      ctx->CtxFailure(errors::InvalidArgument(
          NonFiniteMessage(g[bad], row < n ? KeyDtype<K>::Text(k[row]) : std::string("?"), row, name_)));
      return;
    }
    ctx->set_output(0, grads);
  }

 private:
  std::string name_;
};

template <typename K>
using EvFindKernel = EvLookupOp<K, false>;
template <typename K>
using EvFindOrInsertKernel = EvLookupOp<K, true>;

EV_REGISTER_KEYED("EvFind", EvFindKernel);
EV_REGISTER_KEYED("EvFindOrInsert", EvFindOrInsertKernel);
EV_REGISTER_KEYED("EvApplySgd", EvApplySgdOp);
EV_REGISTER_KEYED("EvApplyMomentum", EvApplyMomentumOp);
EV_REGISTER_KEYED("EvApplyAdagrad", EvApplyAdagradOp);
EV_REGISTER_KEYED("EvApplyAdam", EvApplyAdamOp);
EV_REGISTER_KEYED_ATTR("EvCheckFinite", EvCheckFiniteOp, "Tkeys");

}  // namespace
}  // namespace tf
}  // namespace evstore
