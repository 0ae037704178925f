// CPU kernels: convert tensors, validate shapes, call evstore::Table (core).
// No table logic lives here.
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include "ev_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace evstore {
namespace tf {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
namespace errors = tensorflow::errors;

// Runs the core's batch work on TensorFlow's intra-op thread pool.
ParallelFor IntraOp(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    pool->ParallelFor(total, cost, fn);
  };
}

template <typename K>
absl::Status GetTable(OpKernelContext* ctx, tensorflow::core::RefCountPtr<EvResource<K>>* out) {
  const tensorflow::ResourceHandle& h = tensorflow::HandleFromInput(ctx, 0);
  absl::Status s = tensorflow::LookupResource(ctx, h, out);
  if (absl::IsNotFound(s)) {
    return errors::FailedPrecondition(
        "EmbeddingVariable '", h.name(),
        "' is not initialized (in graph mode run tf.compat.v1.tables_initializer() first): ", s.message());
  }
  if (!s.ok()) {
    return errors::InvalidArgument("EmbeddingVariable '", h.name(), "': the op's key dtype does not match the ",
                                   "table's (cast keys to the EV's key_dtype): ", s.message());
  }
  return absl::OkStatus();
}

#define EV_TRY(ctx, expr)                                               \
  try {                                                                 \
    expr;                                                               \
  } catch (const std::bad_alloc&) {                                     \
    (ctx)->CtxFailure(errors::ResourceExhausted("EmbeddingVariable: out of memory")); \
    return;                                                             \
  } catch (const std::exception& e) {                                   \
    (ctx)->CtxFailure(errors::FailedPrecondition(e.what()));            \
    return;                                                             \
  }

// Base of every kernel that works on an existing table: looks the resource up
// (clear error when it is missing or has another key type) and hands the
// table to ComputeOn.
template <typename K>
class EvTableOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final {
    tensorflow::core::RefCountPtr<EvResource<K>> res;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &res));
    ComputeOn(ctx, res->table());
  }

 protected:
  virtual void ComputeOn(OpKernelContext* ctx, Table<K>& t) = 0;
};

// ---------------------------------------------------------------- create

template <typename K>
class EvCreateOp : public OpKernel {
 public:
  explicit EvCreateOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("segments_log2", &segments_log2_));
    OP_REQUIRES_OK(c, c->GetAttr("min_freq", &min_freq_));
    OP_REQUIRES(c, segments_log2_ >= 0 && segments_log2_ <= 12,
                errors::InvalidArgument("segments_log2 must be in [0, 12]"));
    OP_REQUIRES(c, min_freq_ >= 1, errors::InvalidArgument("min_freq must be >= 1, got ", min_freq_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& bank = ctx->input(1);
    const Tensor& dflt = ctx->input(2);
    OP_REQUIRES(ctx, bank.dims() == 2 && bank.dim_size(1) == dim_ && bank.dim_size(0) >= 1,
                errors::InvalidArgument("bank must be [rows >= 1, ", dim_, "], got ", bank.shape().DebugString()));
    OP_REQUIRES(ctx, dflt.NumElements() == dim_,
                errors::InvalidArgument("default_value must have ", dim_, " elements, got ",
                                        dflt.shape().DebugString()));
    TableConfig cfg;
    cfg.dim = static_cast<int>(dim_);
    cfg.segments_log2 = static_cast<int>(segments_log2_);
    cfg.min_freq = static_cast<uint32_t>(min_freq_);
    auto b = bank.flat<float>();
    cfg.bank.assign(b.data(), b.data() + b.size());
    auto d = dflt.flat<float>();
    cfg.default_value.assign(d.data(), d.data() + d.size());
    EvResource<K>* res = nullptr;
    absl::Status st;
    try {
      st = tensorflow::LookupOrCreateResource<EvResource<K>>(
          ctx, tensorflow::HandleFromInput(ctx, 0), &res, [&cfg](EvResource<K>** r) {
            *r = new EvResource<K>(cfg);
            return absl::OkStatus();
          });
    } catch (const std::exception& e) {
      ctx->CtxFailure(errors::InvalidArgument(e.what()));
      return;
    }
    OP_REQUIRES_OK(ctx, st);
    tensorflow::core::ScopedUnref unref(res);
    OP_REQUIRES(ctx, res->table().dim() == dim_,
                errors::FailedPrecondition("EmbeddingVariable '", tensorflow::HandleFromInput(ctx, 0).name(),
                                           "' already exists with dim ", res->table().dim(), ", not ", dim_));
  }

 private:
  int64_t dim_, segments_log2_, min_freq_;
};

template <typename K>
class EvIsInitializedOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<EvResource<K>> res;
    bool ok = tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &res).ok();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = ok;
  }
};

// ---------------------------------------------------------------- lookups

template <typename K, bool kTrain>
class EvLookupOp : public EvTableOp<K> {
 public:
  explicit EvLookupOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_)); }
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    OP_REQUIRES(ctx, t.dim() == dim_,
                errors::InvalidArgument("lookup expects dim ", dim_, " but the table has dim ", t.dim()));
    const Tensor& keys = ctx->input(1);
    TensorShape shape = keys.shape();
    shape.AddDim(dim_);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    const int64_t n = keys.NumElements();
    if (n == 0) return;
    const K* k = keys.flat<K>().data();
    float* o = out->flat<float>().data();
    if (kTrain) {
      EV_TRY(ctx, t.FindOrInsert(k, n, o, IntraOp(ctx)));
    } else {
      EV_TRY(ctx, t.Find(k, n, o, IntraOp(ctx)));
    }
  }

 private:
  int64_t dim_;
};

// ---------------------------------------------------------------- apply

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

template <typename K>
class EvApplySgdOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  void Run(OpKernelContext* ctx, Table<K>& t, const K* k, const float* g, int64_t n, int64_t step) override {
    t.Apply(k, g, n, step, SgdUpdate{this->Scalar(ctx, 4), t.dim()}, IntraOp(ctx));
  }
};

template <typename K>
class EvApplyMomentumOp : public EvApplyBase<K> {
 public:
  explicit EvApplyMomentumOp(OpKernelConstruction* c) : EvApplyBase<K>(c) {
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
  }
  void Run(OpKernelContext* ctx, Table<K>& t, const K* k, const float* g, int64_t n, int64_t step) override {
    auto off = t.EnsureSlots({{"momentum", 0.f}});
    t.Apply(k, g, n, step,
            MomentumUpdate{this->Scalar(ctx, 4), this->Scalar(ctx, 5), nesterov_, t.dim(), off[0]},
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
  void Run(OpKernelContext* ctx, Table<K>& t, const K* k, const float* g, int64_t n, int64_t step) override {
    auto off = t.EnsureSlots({{"accumulator", init_}});
    t.Apply(k, g, n, step, AdagradUpdate{this->Scalar(ctx, 4), this->Scalar(ctx, 5), t.dim(), off[0]},
            IntraOp(ctx));
  }

 private:
  float init_;
};

template <typename K>
class EvApplyAdamOp : public EvApplyBase<K> {
 public:
  using EvApplyBase<K>::EvApplyBase;
  void Run(OpKernelContext* ctx, Table<K>& t, const K* k, const float* g, int64_t n, int64_t step) override {
    auto off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    AdamUpdate u{this->Scalar(ctx, 4), this->Scalar(ctx, 5), this->Scalar(ctx, 6), this->Scalar(ctx, 7),
                 t.dim(), off[0], off[1]};
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
    const Tensor& keys = ctx->input(0);
    const Tensor& grads = ctx->input(1);
    const int64_t n = keys.NumElements();
    const int64_t total = grads.NumElements();
    const int64_t dim = n > 0 ? total / n : 0;
    const float* g = grads.flat<float>().data();
    const K* k = keys.flat<K>().data();
    for (int64_t i = 0; i < total; ++i) {
      if (!std::isfinite(g[i])) {
        int64_t row = dim > 0 ? i / dim : 0;
        ctx->CtxFailure(errors::InvalidArgument(
            "non-finite gradient (", g[i], ") for key ", row < n ? static_cast<int64_t>(k[row]) : -1,
            " of EmbeddingVariable '", name_, "' at batch position ", row,
            "; nothing was applied. Check the loss for NaN/Inf or clip gradients."));
        return;
      }
    }
    ctx->set_output(0, grads);
  }

 private:
  std::string name_;
};

// ---------------------------------------------------------------- introspection

template <typename K>
class EvSizeOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = t.size();
  }
};

template <typename K>
class EvStatsOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    TableStats s = t.Stats();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({9}), &out));
    auto o = out->flat<int64_t>();
    int64_t v[9] = {s.size, s.admitted, s.filtered, s.free_rows, s.index_bytes,
                    s.meta_bytes, s.row_bytes, s.dirty, s.deleted};
    for (int i = 0; i < 9; ++i) o(i) = v[i];
  }
};

template <typename K>
class EvKeyInfoOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const Tensor& keys = ctx->input(1);
    Tensor *freqs, *versions, *admitted;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &freqs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &versions));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, keys.shape(), &admitted));
    const int64_t n = keys.NumElements();
    std::vector<uint8_t> present(n), adm(n);
    std::vector<float> rows(n * t.stride());
    t.Read(keys.flat<K>().data(), n, t.stride(), present.data(), adm.data(), versions->flat<int64_t>().data(),
           freqs->flat<int64_t>().data(), rows.data());
    auto a = admitted->flat<bool>();
    for (int64_t i = 0; i < n; ++i) a(i) = adm[i] != 0;
  }
};

template <typename K>
class EvRemoveOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const Tensor& keys = ctx->input(1);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = t.Erase(keys.flat<K>().data(), keys.NumElements());
  }
};

// ---------------------------------------------------------------- export / import

template <typename K>
class EvExportOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const int dim = t.dim();
    SlotSpecs slots = t.slots();
    const int ns = static_cast<int>(slots.size());
    // Collected per segment; the stride is re-read under each segment lock via
    // the row pointer's table stride at the time (slots only grow).
    std::vector<K> keys, fkeys;
    std::vector<float> vals, slotv;
    std::vector<int64_t> vers, freqs, ffreqs;
    for (int s = 0; s < t.num_segments(); ++s) {
      t.ForEachInSegment(s, [&](const ExportedKey<K>& x, const float* row) {
        if (!x.admitted) {
          fkeys.push_back(x.key);
          ffreqs.push_back(x.freq);
          return;
        }
        keys.push_back(x.key);
        vers.push_back(x.version);
        freqs.push_back(x.freq);
        vals.insert(vals.end(), row, row + dim);
        slotv.insert(slotv.end(), row + dim, row + dim * (1 + ns));
      });
    }
    const int64_t n = keys.size(), m = fkeys.size();
    Tensor* o[8];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &o[0]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim}), &o[1]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, ns, dim}), &o[2]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &o[3]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &o[4]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({m}), &o[5]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({m}), &o[6]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({ns}), &o[7]));
    std::copy(keys.begin(), keys.end(), o[0]->flat<K>().data());
    std::copy(vals.begin(), vals.end(), o[1]->flat<float>().data());
    std::copy(slotv.begin(), slotv.end(), o[2]->flat<float>().data());
    std::copy(vers.begin(), vers.end(), o[3]->flat<int64_t>().data());
    std::copy(freqs.begin(), freqs.end(), o[4]->flat<int64_t>().data());
    std::copy(fkeys.begin(), fkeys.end(), o[5]->flat<K>().data());
    std::copy(ffreqs.begin(), ffreqs.end(), o[6]->flat<int64_t>().data());
    auto names = o[7]->flat<tensorflow::tstring>();
    for (int i = 0; i < ns; ++i) names(i) = slots[i].first;
  }
};

template <typename K>
class EvImportOp : public EvTableOp<K> {
 public:
  explicit EvImportOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, c->GetAttr("clear", &clear_)); }
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    const int dim = t.dim();
    const Tensor &keys = ctx->input(1), &vals = ctx->input(2), &slots = ctx->input(3), &names = ctx->input(4),
                 &vers = ctx->input(5), &freqs = ctx->input(6), &fkeys = ctx->input(7), &ffreqs = ctx->input(8);
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector"));
    const int64_t n = keys.dim_size(0);
    const int64_t ns = names.NumElements();
    OP_REQUIRES(ctx, vals.dims() == 2 && vals.dim_size(0) == n && vals.dim_size(1) == dim,
                errors::InvalidArgument("values must be [", n, ", ", dim, "], got ", vals.shape().DebugString()));
    OP_REQUIRES(ctx, slots.dims() == 3 && slots.dim_size(0) == n && slots.dim_size(1) == ns && slots.dim_size(2) == dim,
                errors::InvalidArgument("slots must be [", n, ", ", ns, ", ", dim, "], got ",
                                        slots.shape().DebugString()));
    OP_REQUIRES(ctx, vers.NumElements() == n && freqs.NumElements() == n,
                errors::InvalidArgument("versions and freqs must have one entry per key"));
    OP_REQUIRES(ctx, fkeys.NumElements() == ffreqs.NumElements(),
                errors::InvalidArgument("filtered_keys and filtered_freqs must have the same length"));
    SlotSpecs want;
    auto nm = names.flat<tensorflow::tstring>();
    SlotSpecs have = t.slots();
    for (int64_t i = 0; i < ns; ++i) {
      float init = 0.f;
      for (const auto& h : have)
        if (h.first == std::string(nm(i))) init = h.second;
      want.emplace_back(std::string(nm(i)), init);
    }
    // Rows arrive as [embedding | slot 0 | slot 1 ...] per key.
    std::vector<float> rows(n * dim * (1 + ns));
    auto v = vals.flat<float>();
    auto sl = slots.flat<float>();
    for (int64_t i = 0; i < n; ++i) {
      std::copy(v.data() + i * dim, v.data() + (i + 1) * dim, rows.data() + i * dim * (1 + ns));
      std::copy(sl.data() + i * ns * dim, sl.data() + (i + 1) * ns * dim, rows.data() + i * dim * (1 + ns) + dim);
    }
    EV_TRY(ctx, {
      std::vector<int> offs = t.EnsureSlots(want);
      if (clear_) t.Clear();
      t.ImportRows(keys.flat<K>().data(), n, rows.data(), dim * (1 + ns), offs, vers.flat<int64_t>().data(),
                   freqs.flat<int64_t>().data(), /*mark_dirty=*/!clear_);
      t.ImportFiltered(fkeys.flat<K>().data(), fkeys.NumElements(), ffreqs.flat<int64_t>().data(), !clear_);
    });
  }

 private:
  bool clear_;
};

// ---------------------------------------------------------------- two-phase export

template <typename K>
class EvBeginExportOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    std::shared_ptr<const typename Table<K>::Snapshot> snap;
    EV_TRY(ctx, snap = t.BeginExport());
    Tensor *id, *dirty, *deleted;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &id));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({static_cast<int64_t>(snap->dirty.size())}), &dirty));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({static_cast<int64_t>(snap->deleted.size())}), &deleted));
    id->scalar<int64_t>()() = static_cast<int64_t>(snap->id);
    std::copy(snap->dirty.begin(), snap->dirty.end(), dirty->flat<K>().data());
    std::copy(snap->deleted.begin(), snap->deleted.end(), deleted->flat<K>().data());
  }
};

template <typename K>
class EvEndExportOp : public EvTableOp<K> {
 public:
  explicit EvEndExportOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, c->GetAttr("commit", &commit_)); }
  void ComputeOn(OpKernelContext* ctx, Table<K>& t) override {
    uint64_t id = static_cast<uint64_t>(ctx->input(1).scalar<int64_t>()());
    if (commit_) {
      EV_TRY(ctx, t.Commit(id));
    } else {
      EV_TRY(ctx, t.Abort(id));
    }
  }

 private:
  bool commit_;
};

// ---------------------------------------------------------------- registration

#define EV_REGISTER(K)                                                                                      \
  REGISTER_KERNEL_BUILDER(Name("EvHandleOp").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),              \
                          tensorflow::ResourceHandleOp<EvResource<K>>);                                     \
  REGISTER_KERNEL_BUILDER(Name("EvCreate").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvCreateOp<K>); \
  REGISTER_KERNEL_BUILDER(Name("EvIsInitialized").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),         \
                          EvIsInitializedOp<K>);                                                            \
  REGISTER_KERNEL_BUILDER(Name("EvFind").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),                  \
                          EvLookupOp<K, false>);                                                            \
  REGISTER_KERNEL_BUILDER(Name("EvFindOrInsert").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),          \
                          EvLookupOp<K, true>);                                                             \
  REGISTER_KERNEL_BUILDER(Name("EvApplySgd").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),              \
                          EvApplySgdOp<K>);                                                                 \
  REGISTER_KERNEL_BUILDER(Name("EvApplyMomentum").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),         \
                          EvApplyMomentumOp<K>);                                                            \
  REGISTER_KERNEL_BUILDER(Name("EvApplyAdagrad").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),          \
                          EvApplyAdagradOp<K>);                                                             \
  REGISTER_KERNEL_BUILDER(Name("EvApplyAdam").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),             \
                          EvApplyAdamOp<K>);                                                                \
  REGISTER_KERNEL_BUILDER(Name("EvSize").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvSizeOp<K>);    \
  REGISTER_KERNEL_BUILDER(Name("EvStats").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvStatsOp<K>);  \
  REGISTER_KERNEL_BUILDER(Name("EvKeyInfo").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvKeyInfoOp<K>); \
  REGISTER_KERNEL_BUILDER(Name("EvRemove").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvRemoveOp<K>); \
  REGISTER_KERNEL_BUILDER(Name("EvExport").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvExportOp<K>); \
  REGISTER_KERNEL_BUILDER(Name("EvImport").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvImportOp<K>); \
  REGISTER_KERNEL_BUILDER(Name("EvBeginExport").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"),          \
                          EvBeginExportOp<K>);                                                              \
  REGISTER_KERNEL_BUILDER(Name("EvEndExport").Device(DEVICE_CPU).TypeConstraint<K>("key_dtype"), EvEndExportOp<K>);

REGISTER_KERNEL_BUILDER(Name("EvCheckFinite").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tkeys"),
                        EvCheckFiniteOp<int32_t>);
REGISTER_KERNEL_BUILDER(Name("EvCheckFinite").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tkeys"),
                        EvCheckFiniteOp<int64_t>);

EV_REGISTER(int32_t)
EV_REGISTER(int64_t)

}  // namespace
}  // namespace tf
}  // namespace evstore
