// Kernel of EvEvict: builds the core's eviction policies from the op's attrs
// (one policy object per enabled attr, evict_policy.h) and calls Table::Evict,
// handing out the evicted keys and embeddings when asked (return_rows).
#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

template <typename K>
class EvEvictOp : public EvTableOp<K> {
 public:
  explicit EvEvictOp(OpKernelConstruction* c) : EvTableOp<K>(c) {
    int64_t steps_to_live;
    float l2_threshold;
    OP_REQUIRES_OK(c, c->GetAttr("steps_to_live", &steps_to_live));
    OP_REQUIRES_OK(c, c->GetAttr("l2_threshold", &l2_threshold));
    OP_REQUIRES_OK(c, c->GetAttr("return_rows", &return_rows_));
    OP_REQUIRES(c, std::isfinite(l2_threshold),
                errors::InvalidArgument("l2_threshold must be finite, got ", l2_threshold));
    if (steps_to_live >= 0) policies_.Add(GlobalStepEviction(steps_to_live));
    if (l2_threshold > 0.f) policies_.Add(L2WeightEviction(l2_threshold));
  }
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_INPUT(ctx, step, schema::kGlobalStepInput);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("global_step must be a scalar, got ", step.shape().DebugString()));
    int64_t gs = step.scalar<int64_t>()();
    if (gs < 0) gs = t.clock();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    int64_t n = 0;
    EvictedRows<OwnedKey<K>> kept;
    if (gs >= 0) EV_TRY(ctx, n = t.Evict(gs, policies_, return_rows_ ? &kept : nullptr));
    out->scalar<int64_t>()() = n;
    const int64_t nk = static_cast<int64_t>(kept.keys.size());
    Tensor *keys, *values;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nk}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nk, t.dim()}), &values));
    CopyKeysOut<K>(kept.keys.begin(), kept.keys.end(), keys);
    std::copy(kept.values.begin(), kept.values.end(), values->flat<float>().data());
  }

 private:
  EvictionPolicies policies_;
  bool return_rows_;
};

EV_REGISTER_KEYED("EvEvict", EvEvictOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
