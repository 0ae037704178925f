// Shared by the kernel files: tensor-side helpers and the base class of
// kernels that work on an existing table. Kernels only convert and validate
// tensors and call evstore::Table (native/core); no table logic lives here.
#pragma once
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "../core/schema.h"
#include "../core/write_back_report.h"
#include "ev_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/tstring.h"

namespace evstore {
namespace tf {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
namespace errors = tensorflow::errors;

// Runs the core's batch work on TensorFlow's intra-op thread pool, the
// calling thread included (core/parallel.h: SharedFor never waits for a pool
// thread that has not started). A pool thread joins the calling op's
// write-back report for the chunks it runs, so a refused write-back of an
// eviction there is the op's (core/write_back_report.h).
inline ParallelFor IntraOp(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    WriteBackReport* report = WriteBackReport::Current();
    const std::function<void(int64_t, int64_t)> joined = [report, &fn](int64_t b, int64_t e) {
      WriteBackReport::Join join(report);
      fn(b, e);
    };
    SharedFor(total, cost, pool->NumThreads() - 1, [pool](std::function<void()> task) { pool->Schedule(std::move(task)); },
              report ? joined : fn);
  };
}

// Reads each attr named into the variable after its name, in order, at a
// kernel's construction; the first missing or mistyped one is the error:
//   OP_REQUIRES_OK(c, ReadAttrs(c, "clear", &clear_, "chunk_rows", &chunk_rows_));
inline absl::Status ReadAttrs(OpKernelConstruction*) { return absl::OkStatus(); }
template <typename T, typename... Rest>
absl::Status ReadAttrs(OpKernelConstruction* c, const char* name, T* value, Rest... rest) {
  TF_RETURN_IF_ERROR(c->GetAttr(name, value));
  return ReadAttrs(c, rest...);
}

// The `chunk_rows` attr of the checkpoint ops (keys a bundle streams at a time), checked >= 1.
inline absl::Status ReadChunkRows(OpKernelConstruction* c, int64_t* chunk_rows) {
  TF_RETURN_IF_ERROR(c->GetAttr("chunk_rows", chunk_rows));
  if (*chunk_rows < 1) return errors::InvalidArgument("chunk_rows must be >= 1");
  return absl::OkStatus();
}

// Inputs are read by the names the op registration gives them (*_ops.cc;
// names shared by many ops: core/schema.h), never by position:
//   EV_INPUT(ctx, keys, schema::kKeysInput);   // const Tensor& keys
#define EV_INPUT(ctx, var, name)                            \
  const Tensor* var##_input_ = nullptr;                     \
  OP_REQUIRES_OK(ctx, (ctx)->input((name), &var##_input_)); \
  const Tensor& var = *var##_input_

// (KeyDtype, CoreKey, TableT: ev_resource.h)
template <typename T>
using OwnedKey = typename TableT<T>::Owned;

// A keys tensor seen as core keys, checked before anything changes (a string
// key longer than StringKeyTraits::kMaxKeyBytes is an InvalidArgument).
template <typename T>
class KeysIn {
 public:
  absl::Status Init(const Tensor& t) {
    p_ = t.flat<T>().data();
    return absl::OkStatus();
  }
  const T* data() const { return p_; }

 private:
  const T* p_ = nullptr;
};
template <>
class KeysIn<tensorflow::tstring> {
 public:
  absl::Status Init(const Tensor& t) {
    auto f = t.flat<tensorflow::tstring>();
    v_.resize(f.size());
    for (int64_t i = 0; i < f.size(); ++i) {
      v_[i] = KeyDtype<tensorflow::tstring>::View(f(i));
      if (v_[i].size() > StringKeyTraits::kMaxKeyBytes)
        return errors::InvalidArgument("string key at position ", i, " is ", v_[i].size(),
                                       " bytes; string keys are at most ", StringKeyTraits::kMaxKeyBytes,
                                       " bytes (nothing was changed)");
    }
    return absl::OkStatus();
  }
  const std::string_view* data() const { return v_.data(); }

 private:
  std::vector<std::string_view> v_;
};

// The keys input (schema::kKeysInput) of a kernel templated on K, as the
// tensor and as core keys; a kernel reads it before it changes anything, so a
// key KeysIn refuses leaves the table as it was:
//   EV_KEYS_INPUT(ctx, keys, kin);   // const Tensor& keys; KeysIn<K> kin
#define EV_KEYS_INPUT(ctx, var, kin)         \
  EV_INPUT(ctx, var, schema::kKeysInput);    \
  KeysIn<K> kin;                             \
  OP_REQUIRES_OK(ctx, kin.Init(var))

// Writes core keys (Key or Owned values) [begin, end) to a keys tensor.
template <typename T, typename It>
void CopyKeysOut(It begin, It end, Tensor* out) {
  auto f = out->flat<T>();
  int64_t i = 0;
  for (It it = begin; it != end; ++it) f(i++) = KeyDtype<T>::ToTensor(CoreKey<T>(*it));
}

// The table of resource input `input` (default: the op's own, schema::kHandle).
template <typename K>
inline absl::Status GetTable(OpKernelContext* ctx, tensorflow::core::RefCountPtr<EvResource<K>>* out,
                             const char* input = schema::kHandle) {
  tensorflow::ResourceHandle h;
  TF_RETURN_IF_ERROR(tensorflow::HandleFromInput(ctx, input, &h));
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

#define EV_TRY(ctx, ...)                                                \
  try {                                                                 \
    __VA_ARGS__;                                                        \
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
    if (TieredTableT<K>* t = res->tiered()) {
      // A write-back the disk refused kept its rows in DRAM (nothing lost).
      // The store hands each refusal to the op whose eviction it was (and one
      // of its cleaner thread to the next op that faults a row in): this op
      // reports those, never another op's. An op that only reads evicts
      // nothing, so its answer is never an error for the disk.
      WriteBackReport report;
      ComputeOn(ctx, *res, *t);
      if (report.failures() > 0 && ctx->status().ok())
        ctx->CtxFailure(errors::ResourceExhausted("EmbeddingVariable: ", report.message(),
                                                  "; free disk space or raise dram_bytes"));
      return;
    }
    ComputeOn(ctx, *res, *res->dram());
  }

 protected:
  virtual void ComputeOn(OpKernelContext* ctx, EvResource<K>& res, TableT<K>& t) = 0;
  virtual void ComputeOn(OpKernelContext* ctx, EvResource<K>& res, TieredTableT<K>& t) = 0;
};

// Base of the kernels whose outputs are shaped by a `dim` attr (lookups, row
// reads): the attr is read once at construction, and DimMatches fails the op
// with one clear error when the table's dim differs, before any output exists.
template <typename K>
class EvDimTableOp : public EvTableOp<K> {
 public:
  explicit EvDimTableOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_)); }

 protected:
  bool DimMatches(OpKernelContext* ctx, int64_t table_dim) const {
    if (table_dim == dim_) return true;
    ctx->CtxFailure(errors::InvalidArgument(this->type_string(), " expects dim ", dim_, " but the table has dim ", table_dim));
    return false;
  }
  int64_t dim_;
};

// A kernel body written once for both table types (ev_resource.h), with the
// resource beside the table (for a kernel that reads it, e.g. a serving
// table's row format, res.serving(); ev_resource.h):
//   EV_TABLE_KERNEL(ctx, res, t) { ... t is a TableType& ... }
#define EV_TABLE_KERNEL(ctx_, res_, t_)                                                                     \
  void ComputeOn(OpKernelContext* c_, EvResource<K>& r_, TableT<K>& x_) override { ComputeOnT(c_, r_, x_); } \
  void ComputeOn(OpKernelContext* c_, EvResource<K>& r_, TieredTableT<K>& x_) override {                  \
    ComputeOnT(c_, r_, x_);                                                                                \
  }                                                                                                        \
  template <typename TableType>                                                                            \
  void ComputeOnT(OpKernelContext* ctx_, [[maybe_unused]] EvResource<K>& res_, TableType& t_)


// Registers `cls<K>` for op `name` with the integer key types only (ops whose
// key_dtype attr does not list string).
#define EV_REGISTER_INT_KEYED(name, cls)                                                        \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int32_t>("key_dtype"),   \
                          cls<int32_t>);                                                        \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int64_t>("key_dtype"), cls<int64_t>)
// Registers `cls<K>` for op `name` with every key type (int32, int64, string).
#define EV_REGISTER_KEYED(name, cls) EV_REGISTER_KEYED_ATTR(name, cls, "key_dtype")
#define EV_REGISTER_KEYED_ATTR(name, cls, attr)                                                   \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int32_t>(attr), cls<int32_t>); \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int64_t>(attr), cls<int64_t>); \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<tensorflow::tstring>(attr),   \
                          cls<tensorflow::tstring>)

}  // namespace tf
}  // namespace evstore
