// Kernels of the CTR optimizers: Ftrl, AdamW, GroupAdam, GroupAdagrad (fused
// row updates in core/optimizers.h), and the zero-row readout. Hyper-parameters
// arrive as scalar tensors (learning-rate schedules and Adam's bias correction
// are evaluated by the caller); each is range-checked before the table is
// touched, so a bad value changes nothing.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../core/zero_rows.h"
#include "apply_base.h"
#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

// Fails (InvalidArgument naming the parameter) unless lo <= v (lo < v when
// !lo_inclusive) and v < hi; returns whether the value is acceptable.
bool CheckRange(OpKernelContext* ctx, const char* name, float v, float lo, bool lo_inclusive,
                float hi = INFINITY) {
  const bool ok = std::isfinite(v) && (lo_inclusive ? v >= lo : v > lo) && v < hi;
  if (!ok) {
    if (std::isfinite(hi)) {
      ctx->CtxFailure(errors::InvalidArgument(name, " must be in ", lo_inclusive ? "[" : "(", lo, ", ", hi,
                                              "), got ", v));
    } else {
      ctx->CtxFailure(errors::InvalidArgument(name, " must be ", lo_inclusive ? ">= " : "> ", lo, ", got ", v));
    }
  }
  return ok;
}
// Fails unless v <= hi.
bool CheckAtMost(OpKernelContext* ctx, const char* name, float v, float hi) {
  const bool ok = std::isfinite(v) && v <= hi;
  if (!ok) ctx->CtxFailure(errors::InvalidArgument(name, " must be <= ", hi, ", got ", v));
  return ok;
}
#define EV_CHECK_RANGE(...) \
  if (!CheckRange(ctx, __VA_ARGS__)) return

template <typename K>
class EvApplyFtrlOp : public EvApplyBase<K> {
 public:
  explicit EvApplyFtrlOp(OpKernelConstruction* c) : EvApplyBase<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("initial_accumulator_value", &init_));
    OP_REQUIRES(c, init_ >= 0, errors::InvalidArgument("initial_accumulator_value must be >= 0, got ", init_));
  }
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    const float lr = this->Scalar(ctx, "lr"), l1 = this->Scalar(ctx, "l1"), l2 = this->Scalar(ctx, "l2"),
                shrink = this->Scalar(ctx, "l2_shrinkage"), power = this->Scalar(ctx, "lr_power");
    EV_CHECK_RANGE("learning_rate", lr, 0.f, false);
    EV_CHECK_RANGE("l1", l1, 0.f, true);
    EV_CHECK_RANGE("l2", l2, 0.f, true);
    EV_CHECK_RANGE("l2_shrinkage", shrink, 0.f, true);
    if (!CheckAtMost(ctx, "learning_rate_power", power, 0.f)) return;
    auto off = t.EnsureSlots({{"accumulator", init_}, {"linear", 0.f}});
    t.Apply(k, g, n, step, FtrlUpdate{lr, power, l1, l2, shrink, t.dim(), off[0], off[1]}, IntraOp(ctx));
  }

 private:
  float init_;
};

template <typename K>
class EvApplyAdamWOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    const float alpha = this->Scalar(ctx, "alpha"), b1 = this->Scalar(ctx, "beta1"), b2 = this->Scalar(ctx, "beta2"),
                eps = this->Scalar(ctx, "epsilon"), lr = this->Scalar(ctx, "lr"), wd = this->Scalar(ctx, "weight_decay");
    EV_CHECK_RANGE("beta_1", b1, 0.f, true, 1.f);
    EV_CHECK_RANGE("beta_2", b2, 0.f, true, 1.f);
    EV_CHECK_RANGE("epsilon", eps, 0.f, true);
    EV_CHECK_RANGE("alpha (bias-corrected learning rate)", alpha, 0.f, false);
    EV_CHECK_RANGE("learning_rate", lr, 0.f, false);
    EV_CHECK_RANGE("weight_decay", wd, 0.f, true);
    auto off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    AdamWUpdate u{AdamUpdate{alpha, b1, b2, eps, t.dim(), off[0], off[1]}, wd, lr};
    t.Apply(k, g, n, step, u, IntraOp(ctx));
  }
};

template <typename K>
class EvApplyGroupAdamOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    const float alpha = this->Scalar(ctx, "alpha"), b1 = this->Scalar(ctx, "beta1"), b2 = this->Scalar(ctx, "beta2"),
                eps = this->Scalar(ctx, "epsilon"), l1 = this->Scalar(ctx, "l1"), l2 = this->Scalar(ctx, "l2"),
                l21 = this->Scalar(ctx, "l21");
    EV_CHECK_RANGE("beta_1", b1, 0.f, true, 1.f);
    EV_CHECK_RANGE("beta_2", b2, 0.f, true, 1.f);
    EV_CHECK_RANGE("epsilon", eps, 0.f, true);
    EV_CHECK_RANGE("alpha (bias-corrected learning rate)", alpha, 0.f, false);
    EV_CHECK_RANGE("l1", l1, 0.f, true);
    EV_CHECK_RANGE("l2", l2, 0.f, true);
    EV_CHECK_RANGE("l21", l21, 0.f, true);
    auto off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}, {"linear", 0.f}});
    GroupAdamUpdate u{alpha, b1, b2, eps, l1, l2, l21, t.dim(), off[0], off[1], off[2]};
    t.Apply(k, g, n, step, u, IntraOp(ctx));
  }
};

template <typename K>
class EvApplyGroupAdagradOp : public EvApplyBase<K> {
 public:
  explicit EvApplyGroupAdagradOp(OpKernelConstruction* c) : EvApplyBase<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("initial_accumulator_value", &init_));
    OP_REQUIRES(c, init_ >= 0, errors::InvalidArgument("initial_accumulator_value must be >= 0, got ", init_));
  }
  EV_APPLY_RUN(ctx, t, k, g, n, step) {
    const float lr = this->Scalar(ctx, "lr"), eps = this->Scalar(ctx, "epsilon"), l1 = this->Scalar(ctx, "l1"),
                l2 = this->Scalar(ctx, "l2"), l21 = this->Scalar(ctx, "l21");
    EV_CHECK_RANGE("learning_rate", lr, 0.f, false);
    EV_CHECK_RANGE("epsilon", eps, 0.f, true);
    EV_CHECK_RANGE("l1", l1, 0.f, true);
    EV_CHECK_RANGE("l2", l2, 0.f, true);
    EV_CHECK_RANGE("l21", l21, 0.f, true);
    auto off = t.EnsureSlots({{"accumulator", init_}, {"linear", 0.f}});
    t.Apply(k, g, n, step, GroupAdagradUpdate{lr, eps, l1, l2, l21, t.dim(), off[0], off[1]}, IntraOp(ctx));
  }

 private:
  float init_;
};

template <typename K>
class EvZeroRowKeysOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    std::vector<OwnedKey<K>> keys;
    const ZeroRowPredicate zero{t.dim()};
    for (int s = 0; s < t.num_segments(); ++s)
      t.ForEachInSegment(s, [&](const ExportedKey<CoreKey<K>>& x, const float* row) {
        if (zero(x.key, x.admitted, x.version, x.freq, row)) keys.emplace_back(x.key);
      });
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(keys.size())}), &out));
    CopyKeysOut<K>(keys.begin(), keys.end(), out);
  }
};

EV_REGISTER_KEYED("EvApplyFtrl", EvApplyFtrlOp);
EV_REGISTER_KEYED("EvApplyAdamW", EvApplyAdamWOp);
EV_REGISTER_KEYED("EvApplyGroupAdam", EvApplyGroupAdamOp);
EV_REGISTER_KEYED("EvApplyGroupAdagrad", EvApplyGroupAdagradOp);
EV_REGISTER_KEYED("EvZeroRowKeys", EvZeroRowKeysOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
