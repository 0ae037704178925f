// Kernel of EvEvict: converts attrs to an evstore::EvictPolicy and calls the
// core (evict_policy.h, Table::Evict).
#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

template <typename K>
class EvEvictOp : public EvTableOp<K> {
 public:
  explicit EvEvictOp(OpKernelConstruction* c) : EvTableOp<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("steps_to_live", &policy_.steps_to_live));
    OP_REQUIRES_OK(c, c->GetAttr("l2_threshold", &policy_.l2_threshold));
    OP_REQUIRES(c, std::isfinite(policy_.l2_threshold),
                errors::InvalidArgument("l2_threshold must be finite, got ", policy_.l2_threshold));
  }
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const Tensor& step = ctx->input(1);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("global_step must be a scalar, got ", step.shape().DebugString()));
    int64_t gs = step.scalar<int64_t>()();
    if (gs < 0) gs = t.clock();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    int64_t n = 0;
    if (gs >= 0) EV_TRY(ctx, n = t.Evict(gs, policy_));
    out->scalar<int64_t>()() = n;
  }

 private:
  EvictPolicy policy_;
};

EV_REGISTER_KEYED("EvEvict", EvEvictOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
