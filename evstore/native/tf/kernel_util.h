// Shared by the kernel files: tensor-side helpers and the base class of
// kernels that work on an existing table. Kernels only convert and validate
// tensors and call evstore::Table (native/core); no table logic lives here.
#pragma once
#include <exception>
#include <functional>

#include "../core/schema.h"
#include "ev_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace evstore {
namespace tf {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
namespace errors = tensorflow::errors;

// Runs the core's batch work on TensorFlow's intra-op thread pool.
inline ParallelFor IntraOp(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    pool->ParallelFor(total, cost, fn);
  };
}

// Inputs are read by the names the op registration gives them (*_ops.cc;
// names shared by many ops: core/schema.h), never by position:
//   EV_INPUT(ctx, keys, schema::kKeysInput);   // const Tensor& keys
#define EV_INPUT(ctx, var, name)                            \
  const Tensor* var##_input_ = nullptr;                     \
  OP_REQUIRES_OK(ctx, (ctx)->input((name), &var##_input_)); \
  const Tensor& var = *var##_input_

template <typename K>
inline absl::Status GetTable(OpKernelContext* ctx, tensorflow::core::RefCountPtr<EvResource<K>>* out) {
  tensorflow::ResourceHandle h;
  TF_RETURN_IF_ERROR(tensorflow::HandleFromInput(ctx, schema::kHandle, &h));
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
    ComputeOn(ctx, res->table());
  }

 protected:
  virtual void ComputeOn(OpKernelContext* ctx, Table<K>& t) = 0;
};


// Registers `cls<K>` for op `name` with both key types.
#define EV_REGISTER_KEYED(name, cls)                                                          \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int32_t>("key_dtype"), \
                          cls<int32_t>);                                                      \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<int64_t>("key_dtype"), cls<int64_t>)

}  // namespace tf
}  // namespace evstore
