// Row read / write by key, with named optimizer slots: what the generic
// optimizer path (evstore/generic.py) needs to run any Keras optimizer's own
// update rule on the touched rows. EvUniqueSum deduplicates a gradient;
// EvReadRows gathers [w | slots] of unique keys; EvWriteRows writes them back
// like a fused apply does (version = step, dirty mark, absent / filtered /
// evicted-meanwhile keys skipped). Slots are the table's ordinary slots
// (Table::EnsureSlots), so they are exported, checkpointed, delta-saved and
// evicted with the row like the fused ones. Slot tensors are slot-major
// [S, n, dim], so each slot is a contiguous [n, dim] slice.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../core/unique_sum.h"
#include "kernel_util.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace evstore {
namespace tf {

namespace {

// (name, initial value) of each slot input, checked against each other.
absl::Status SlotSpecsOf(OpKernelContext* ctx, SlotSpecs* out) {
  const Tensor* names_in = nullptr;
  const Tensor* inits_in = nullptr;
  TF_RETURN_IF_ERROR(ctx->input("slot_names", &names_in));
  TF_RETURN_IF_ERROR(ctx->input("slot_inits", &inits_in));
  const Tensor& names = *names_in;
  const Tensor& inits = *inits_in;
  if (names.dims() != 1 || inits.dims() != 1 || names.dim_size(0) != inits.dim_size(0))
    return errors::InvalidArgument("slot_names and slot_inits must be vectors of one length, got ",
                                   names.shape().DebugString(), " and ", inits.shape().DebugString());
  for (int64_t i = 0; i < names.dim_size(0); ++i) {
    const std::string& n = names.flat<tensorflow::tstring>()(i);
    if (n.empty() || n.find(schema::kSlotSeparator) != std::string::npos)
      return errors::InvalidArgument("slot name '", n, "' must be non-empty and hold no '", schema::kSlotSeparator,
                                     "'");
    out->emplace_back(n, inits.flat<float>()(i));
  }
  return absl::OkStatus();
}

template <typename K>
class EvReadRowsOp : public EvDimTableOp<K> {
 public:
  using EvDimTableOp<K>::EvDimTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    if (!this->DimMatches(ctx, t.dim())) return;
    EV_KEYS_INPUT(ctx, keys, kin);
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector"));
    SlotSpecs specs;
    OP_REQUIRES_OK(ctx, SlotSpecsOf(ctx, &specs));
    std::vector<int> offs;
    EV_TRY(ctx, offs = t.EnsureSlots(specs));
    const int64_t n = keys.dim_size(0);
    const int64_t ns = static_cast<int64_t>(specs.size());
    Tensor *values, *slots, *admitted;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({ns, n, dim_}), &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &admitted));
    if (n == 0) return;
    // Slots are only ever appended, so the offsets stay valid even if another
    // optimizer widens the rows meanwhile; rows are read at this stride.
    int stride = 0;
    for (int o : offs) stride = std::max(stride, o + static_cast<int>(dim_));
    stride = std::max(stride, static_cast<int>(dim_));
    float* v = values->flat<float>().data();
    float* s = slots->flat<float>().data();
    bool* a = admitted->flat<bool>().data();
    const CoreKey<K>* k = kin.data();
    const size_t row_bytes = dim_ * sizeof(float);
    // Chunks of keys read in parallel (Table::Read takes a shared lock per key).
    IntraOp(ctx)(n, 400, [&](int64_t lo, int64_t hi) {
      const int64_t m = hi - lo;
      std::vector<uint8_t> present(m), adm(m);
      std::vector<int64_t> versions(m), freqs(m);
      std::vector<float> rows(static_cast<size_t>(m) * stride);
      t.Read(k + lo, m, stride, present.data(), adm.data(), versions.data(), freqs.data(), rows.data());
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = lo + j;
        const float* r = rows.data() + j * stride;
        a[i] = adm[j] != 0;
        std::memcpy(v + i * dim_, r, row_bytes);
        for (int64_t c = 0; c < ns; ++c) std::memcpy(s + (c * n + i) * dim_, r + offs[c], row_bytes);
      }
    });
  }

 private:
  using EvDimTableOp<K>::dim_;
};

// Copies key i's new [w | slots] into its row (called by Table::Apply, which
// hands the i-th "gradient" row: values + i * dim).
struct CopyRow {
  const float* values;
  const float* slots;  // [S, n, dim]
  const std::vector<int>* offs;
  int64_t n;
  int dim;
  void operator()(float* row, const float* g) const {
    const int64_t i = (g - values) / dim;
    std::memcpy(row, g, dim * sizeof(float));
    const int64_t ns = static_cast<int64_t>(offs->size());
    for (int64_t c = 0; c < ns; ++c) std::memcpy(row + (*offs)[c], slots + (c * n + i) * dim, dim * sizeof(float));
  }
};

template <typename K>
class EvWriteRowsOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, values, "values");
    EV_INPUT(ctx, slots, "slots");
    EV_INPUT(ctx, step, schema::kGlobalStepInput);
    SlotSpecs specs;
    OP_REQUIRES_OK(ctx, SlotSpecsOf(ctx, &specs));
    const int64_t n = keys.NumElements();
    const int64_t ns = static_cast<int64_t>(specs.size());
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector"));
    OP_REQUIRES(ctx, values.dims() == 2 && values.dim_size(0) == n && values.dim_size(1) == t.dim(),
                errors::InvalidArgument("values must be [", n, ", ", t.dim(), "], got ", values.shape().DebugString()));
    OP_REQUIRES(ctx, slots.dims() == 3 && slots.dim_size(0) == ns && slots.dim_size(1) == n &&
                         slots.dim_size(2) == t.dim(),
                errors::InvalidArgument("slots must be [", ns, ", ", n, ", ", t.dim(), "], got ",
                                        slots.shape().DebugString()));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("global_step must be a scalar"));
    std::vector<int> offs;
    EV_TRY(ctx, offs = t.EnsureSlots(specs));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = 0;
    if (n == 0) return;
    const float* v = values.flat<float>().data();
    CopyRow copy{v, slots.flat<float>().data(), &offs, n, t.dim()};
    EV_TRY(ctx, out->scalar<int64_t>()() = t.Apply(kin.data(), v, n, step.scalar<int64_t>()(), copy,
                                                   IntraOp(ctx)));
  }
};

template <typename K>
class EvUniqueSumOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, grads, schema::kGradsInput);
    OP_REQUIRES(ctx, keys.dims() == 1 && grads.dims() == 2 && grads.dim_size(0) == keys.dim_size(0),
                errors::InvalidArgument("keys [n] and grads [n, dim] expected, got ", keys.shape().DebugString(),
                                        " and ", grads.shape().DebugString()));
    const int dim = static_cast<int>(grads.dim_size(1));
    std::vector<CoreKey<K>> ukeys;
    std::vector<float> ugrads;
    const int64_t un = UniqueSum(kin.data(), grads.flat<float>().data(), keys.dim_size(0), dim, &ukeys,
                                 &ugrads);
    Tensor *ko, *go;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({un}), &ko));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({un, dim}), &go));
    if (un == 0) return;
    CopyKeysOut<K>(ukeys.begin(), ukeys.end(), ko);
    std::memcpy(go->flat<float>().data(), ugrads.data(), static_cast<size_t>(un) * dim * sizeof(float));
  }
};

}  // namespace

EV_REGISTER_KEYED_ATTR("EvUniqueSum", EvUniqueSumOp, "Tkeys");
EV_REGISTER_KEYED("EvReadRows", EvReadRowsOp);
EV_REGISTER_KEYED("EvWriteRows", EvWriteRowsOp);

}  // namespace tf
}  // namespace evstore
