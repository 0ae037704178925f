// Op registrations for streaming checkpoints (kernels: checkpoint_kernels.cc).
// The tensor names inside a bundle are defined once in core/schema.h and
// tabled in docs/reference/checkpoint-format.md; the dense tensors keep the
// names they are given.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"

using tensorflow::shape_inference::InferenceContext;
using evstore::tf::SetOutputs;

REGISTER_OP("EvSaveBundle")
    .Input("prefix: string")
    .Input("handles: N * resource")
    .Input("names: string")
    .Input("snapshot_ids: int64")
    .Input("dense_names: string")
    .Input("dense: Tdense")
    .Attr("N: int >= 0")
    .Attr("key_dtypes: list(" EV_KEY_DTYPES ") >= 0")
    .Attr("Tdense: list(type) >= 0")
    .Attr("full: bool")
    .Attr("chunk_rows: int = 65536")
    .Attr("view: string = ''")
    .Attr("view_prefix: string = 'serving'")
    .Output("files: string")
    .Output("file_sizes: int64")
    .Output("file_crc32c: int64")
    .Output("counts: int64")
    .Output("slot_names: string")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      auto vec = [c] { return c->Vector(c->UnknownDim()); };  // each output its own unknown length
      return SetOutputs(c, {vec(), vec(), vec(), c->Matrix(c->UnknownDim(), 3), vec()});
    })
    .Doc(R"doc(
Writes one tensor bundle at `prefix` holding every EV in `handles` (each under
its name in `names`) and the dense tensors. Each EV must have an open export
snapshot (`snapshot_ids`, from EvBeginExport): a full writes every key, a delta
the snapshot's dirty keys and deleted keys. Rows stream in chunks of
`chunk_rows` keys. Outputs the files written (basenames, sizes, crc32c), per EV
[rows, filtered, deleted] counts, and "<name>/<slot>" for every slot written.
With `view` ("bfloat16", "float16" or "int8"; "" none) the rows are also
encoded as they stream into a second bundle, `<dir of prefix>/<view_prefix>`:
per EV `<name>-values` in that dtype (int8 with `<name>-values_scale`, per row
max |value| / 127), row-aligned with `<name>-keys` (core/view_codec.h); its
files are among the outputs.
)doc");

REGISTER_OP("EvLoadBundle")
    .Input("handle: resource")
    .Input("prefix: string")
    .Input("ev_name: string")
    .Input("slot_names: string")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("clear: bool")
    .Attr("chunk_rows: int = 65536")
    .Attr("shard_index: int = 0")
    .Attr("num_shards: int = 1")
    .Attr("view: string = ''")
    .Attr("view_prefix: string = 'serving'")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->Vector(3)});
    })
    .Doc(R"doc(
Applies EV `ev_name` of the bundle at `prefix` to the table: with `clear` the
table is emptied first (a full), then the deleted keys are erased, the rows
(values, the named slots, versions, freqs) upserted and the filtered keys set,
streaming in chunks. Nothing becomes dirty or deleted. Outputs [rows, filtered,
deleted]. Each tensor's crc32c is checked (DataLoss naming the file).
With `num_shards` > 1 only keys routed to `shard_index` (core/shard.h) are
applied (rows, filtered and deleted keys alike), and the outputs count those:
how a chain saved with some number of shards restores into another.
A serving table (EvCreate's serving_rows) stores rows in its precision: with
`view` (its precision's name) the rows are the serving view's codes, read from
the view bundle `<dir of prefix>/<view_prefix>`; without, the float32 values
encoded as the view encodes them (core/serving_rows.h).
)doc");

REGISTER_OP("EvLoadBundleRouted")
    .Input("handles: N * resource")
    .Input("prefix: string")
    .Input("ev_name: string")
    .Input("slot_names: string")
    .Attr("N: int >= 1")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("clear: bool")
    .Attr("chunk_rows: int = 65536")
    .Attr("shard_indices: list(int) >= 1")
    .Attr("num_shards: int >= 2")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->Matrix(c->num_inputs() - 3, 3)});
    })
    .Doc(R"doc(
EvLoadBundle into the tables of several shards of one EV at once (all on this
device, all in DRAM or all tiered, none a serving table): each key of EV
`ev_name` of the bundle goes to handles[i] when it routes to shard
shard_indices[i] of `num_shards` (core/shard.h), keys of other shards are
skipped, and each tensor is read and checked once for all of them (a part of
another shard count restored into the shards one process holds). Outputs
[rows, filtered, deleted] per handle.
)doc");

REGISTER_OP("EvDiskFree")
    .Input("path: string")
    .Output("free_bytes: int64")
    .Output("filesystem: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->Scalar(), c->Scalar()});
    })
    .Doc(R"doc(
The bytes this process may still write on the file system of `path` (absolute; or of its
nearest existing parent), on the host of the device the op runs on: statvfs's
available blocks (also the blocks reserved for root when the process runs as
root) times the fragment size; and the file system's device number (st_dev), to
tell file systems apart. A tiered staging table's disk room is checked with it
on the task that holds the table (evstore/staging.py).
)doc");

REGISTER_OP("EvTierRecordBytes")
    .Attr("dim: int >= 1")
    .Attr("slots: int >= 0 = 0")
    .Attr("precision: string = 'float32'")
    .Output("record_bytes: int64")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
The bytes of one tier record (one row on disk) of a table of width `dim`: a
training table's row with `slots` optimizer slots (precision 'float32'), or a
serving table's row in `precision` ('float32', 'bfloat16', 'float16' or 'int8';
slots 0), as the core lays them out (core/row_store.h RowFloats and
RecordBytes, core/serving_rows.h PackedFloats). What a load into a new tiered
table writes to its tier is counted with it (evstore/storage.py record_bytes).
)doc");

REGISTER_OP("EvCrc32cExtend")
    .Input("crc: int64")
    .Input("data: string")
    .Output("out: int64")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("crc32c (Castagnoli, unmasked) of `data` continued from `crc`.");

REGISTER_OP("EvFileCrc32c")
    .Input("path: string")
    .Output("crc: int64")
    .Output("size: int64")
    .SetShapeFn([](InferenceContext* c) {
      return SetOutputs(c, {c->input(0), c->input(0)});
    })
    .Doc("crc32c (Castagnoli, unmasked) and size of each local file of `path` (any shape; the "
         "outputs have its shape): one call checks a whole checkpoint.");
