// Op registrations (interfaces and shape functions only; kernels are in
// table_kernels.cc and training_kernels.cc). Every op takes the EV resource handle first.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"
#include "../core/schema.h"

namespace {

using tensorflow::shape_inference::InferenceContext;
using evstore::tf::RowsShape;
using evstore::tf::SetOutputs;

}  // namespace

REGISTER_OP("EvHandleOp")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("handle: resource")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Handle to an EmbeddingVariable table (created by EvCreate).");

REGISTER_OP("EvCreate")
    .Input("handle: resource")
    .Input("bank: float")
    .Input("default_value: float")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Attr("segments_log2: int = 6")
    .Attr("min_freq: int = 1")
    .Attr("bloom_capacity: int = 0")
    .Attr("bloom_fp_rate: float = 0.01")
    .Attr("tier_dram_bytes: int = 0")
    .Attr("tier_path: string = ''")
    .Attr("serving_rows: string = ''")
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Creates the table behind `handle` if absent (idempotent for the same dim). tier_dram_bytes > 0: rows "
         "live in a DRAM cache of that many bytes over a private directory under tier_path (TieredStore). "
         "serving_rows ('float32', 'bfloat16', 'float16' or 'int8'; '' a training table): a serving table "
         "keeping its rows in that precision (core/serving_rows.h): written by EvServeUpsert and EvLoadBundle, "
         "read by EvFind, which decodes and counts each lookup in the key's frequency.");

REGISTER_OP("EvFind")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Output("values: float")
    .SetShapeFn(RowsShape)
    .Doc("Read-only lookup: stored rows or the default value; never inserts. On a serving table (EvCreate's "
         "serving_rows) rows are decoded to float32 and each lookup adds to the key's frequency.");

REGISTER_OP("EvServeWarm")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Before a serving table's publish: a tiered table evicts rows to make room for one row per key, "
         "then reads the rows of `keys` it holds into its DRAM cache (not counted as lookups), so the "
         "upserts that follow read and write no disk. Nothing for a table in DRAM.");

REGISTER_OP("EvSetDramBytes")
    .Input("handle: resource")
    .Input("dram_bytes: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Sets a tiered table's DRAM budget (a smaller one is reached over the faults that follow). Nothing "
         "for a table in DRAM.");

REGISTER_OP("EvServeUpsert")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("values: T")
    .Input("scales: float")
    .Input("freqs: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("T: {float, bfloat16, half, int8}")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Upserts rows of a serving table (EvCreate's serving_rows): `values` [n, dim] float32 rows, encoded "
         "into the table's precision as the serving view encodes them (core/view_codec.h), or rows already in "
         "that precision (its view's tensors; `scales` [n] for int8, else empty), stored as they are. `freqs` "
         "[n]: the keys' frequencies. Nothing is marked dirty.");

REGISTER_OP("EvFindOrInsert")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("proxy: float")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Output("values: float")
    .SetIsStateful()
    .SetShapeFn(RowsShape)
    .Doc("Training lookup: counts, admits, inserts. `proxy` carries the gradient path.");

REGISTER_OP("EvApplySgd").EV_APPLY_COMMON.Input("lr: float");
REGISTER_OP("EvApplyMomentum")
    .EV_APPLY_COMMON.Input("lr: float")
    .Input("momentum: float")
    .Attr("nesterov: bool = false");
REGISTER_OP("EvApplyAdagrad")
    .EV_APPLY_COMMON.Input("lr: float")
    .Input("epsilon: float")
    .Attr("initial_accumulator_value: float = 0.1");
REGISTER_OP("EvApplyAdam")
    .EV_APPLY_COMMON.Input("alpha: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float");

REGISTER_OP("EvSize")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("size: int64")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

REGISTER_OP("EvSlots")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("slot_names: string")
    .Output("slot_initial_values: float")
    .SetShapeFn([](InferenceContext* c) {
      auto s = c->UnknownDim();
      return SetOutputs(c, {c->Vector(s), c->Vector(s)});
    })
    .Doc("The table's optimizer slots and the value each starts at in rows admitted later.");

REGISTER_OP("EvStats")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("stats: int64")
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->Vector(evstore::schema::kNumStatsFields)});
    })
    .Doc("[size, admitted, filtered, free_rows, index_bytes, meta_bytes, row_bytes, dirty, deleted, "
         "evicted, filter_bytes, zero_rows]");

REGISTER_OP("EvKeyInfo")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("freqs: int64")
    .Output("versions: int64")
    .Output("admitted: bool")
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->input(1), c->input(1), c->input(1)});
    });

REGISTER_OP("EvKeepRows")
    .Input("handle: resource")
    .Input("source: resource")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("kept: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Copy-on-write: for each key (any shape) `handle` holds no row of, imports the embedding an "
         "inference lookup of `source` reads now (never-updated, frequency 0, not dirty). Returns how many.");

REGISTER_OP("EvRemove")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Output("removed: int64")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

REGISTER_OP("EvExport")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Output("keys: key_dtype")
    .Output("values: float")
    .Output("slots: float")
    .Output("versions: int64")
    .Output("freqs: int64")
    .Output("filtered_keys: key_dtype")
    .Output("filtered_freqs: int64")
    .Output("slot_names: string")
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      auto n = c->UnknownDim();
      return SetOutputs(c, {c->Vector(n), c->Matrix(n, dim), c->MakeShape({n, c->UnknownDim(), c->MakeDim(dim)}),
                            c->Vector(n), c->Vector(n), c->Vector(c->UnknownDim()), c->Vector(c->UnknownDim()),
                            c->Vector(c->UnknownDim())});
    })
    .Doc("Materialises the whole table (small tables, debugging, tf.train.Checkpoint).");

REGISTER_OP("EvImport")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("values: float")
    .Input("slots: float")
    .Input("slot_names: string")
    .Input("versions: int64")
    .Input("freqs: int64")
    .Input("filtered_keys: key_dtype")
    .Input("filtered_freqs: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("clear: bool = true")
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Upserts rows, slots and filtered counts (clear=true: replaces the table).");

REGISTER_OP("EvSwapTables")
    .Input("handle: resource")
    .Input("other: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("Exchanges the tables behind two handles of the same key dtype and dim (rows, index, tier and all). "
         "The caller keeps every other op off both tables while it runs (serving_loader: its write lock).");

// Two-phase export (the checkpoint manager's commit protocol: docs/ARCHITECTURE.md,
// "Checkpoints"):
// seal the dirty and deleted sets, write them out, then commit or abort.
REGISTER_OP("EvBeginExport")
    .Input("handle: resource")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("return_keys: bool = true")  // false: seal only (a checkpoint writer streams the snapshot)
    .Output("snapshot_id: int64")
    .Output("dirty_keys: key_dtype")
    .Output("deleted_keys: key_dtype")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->Scalar(), c->Vector(c->UnknownDim()), c->Vector(c->UnknownDim())});
    })
    .Doc("Seals keys changed / deleted since the last sealed export into a snapshot.");

REGISTER_OP("EvEndExport")
    .Input("handle: resource")
    .Input("snapshot_id: int64")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("commit: bool")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs)
    .Doc("commit=true drops the snapshot (its checkpoint is durable); false merges it back.");

REGISTER_OP("EvCheckFinite")
    .Input("keys: Tkeys")
    .Input("grads: float")
    .Attr("Tkeys: " EV_KEY_DTYPES)
    .Attr("ev_name: string = ''")
    .Output("checked: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc("Forwards grads; fails naming the first key whose gradient row is NaN/Inf.");
