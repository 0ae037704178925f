// Kernels of shard_ops.cc: routing keys, and the counted training lookup.
#include "../core/shard.h"
#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

template <typename K>
class EvShardIndexOp : public OpKernel {
 public:
  explicit EvShardIndexOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("num_shards", &num_shards_));
  }
  void Compute(OpKernelContext* ctx) override {
    EV_KEYS_INPUT(ctx, keys, kin);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &out));
    const CoreKey<K>* k = kin.data();
    int32_t* o = out->flat<int32_t>().data();
    const int64_t n = keys.NumElements();
    for (int64_t i = 0; i < n; ++i) o[i] = ShardOf(k[i], num_shards_);
  }

 private:
  int32_t num_shards_;
};

template <typename K>
class EvFindOrInsertCountedOp : public EvDimTableOp<K> {
 public:
  using EvDimTableOp<K>::EvDimTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    if (!this->DimMatches(ctx, t.dim())) return;
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, counts, "counts");
    OP_REQUIRES(ctx, keys.dims() == 1 && counts.dims() == 1 && counts.dim_size(0) == keys.dim_size(0),
                errors::InvalidArgument("keys and counts must be vectors of one length, got ",
                                        keys.shape().DebugString(), " and ", counts.shape().DebugString()));
    const int64_t n = keys.NumElements();
    const int64_t* c = counts.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i)
      OP_REQUIRES(ctx, c[i] >= 1, errors::InvalidArgument("counts must be >= 1, got ", c[i], " at ", i));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out));
    if (n == 0) return;
    EV_TRY(ctx, t.FindOrInsert(kin.data(), n, out->flat<float>().data(), IntraOp(ctx), c));
  }

 private:
  using EvDimTableOp<K>::dim_;
};

EV_REGISTER_KEYED("EvShardIndex", EvShardIndexOp);
EV_REGISTER_KEYED("EvFindOrInsertCounted", EvFindOrInsertCountedOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
