// Op registrations for sharded EmbeddingVariables (kernels: shard_kernels.cc).
// A sharded EV is N ordinary EV resources; these ops route keys to them
// (core/shard.h) and let a shard take deduplicated keys with their counts.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "op_util.h"

using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("EvShardIndex")
    .Input("keys: key_dtype")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("num_shards: int >= 1")
    .Output("shard: int32")
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
The shard of each key in an EV of `num_shards` shards (core/shard.h, route
"mix64-v1"): a mixing hash of the key modulo `num_shards`.
)doc");

REGISTER_OP("EvFindOrInsertCounted")
    .Input("handle: resource")
    .Input("keys: key_dtype")
    .Input("counts: int64")
    .Input("proxy: float")
    .Attr(EV_KEY_DTYPE_ATTR)
    .Attr("dim: int >= 1")
    .Output("values: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      return evstore::tf::RowsShape(c);
    })
    .Doc(R"doc(
Training lookup of distinct `keys` [n] where key i stands for `counts[i]`
(>= 1) occurrences. Frequencies, admission and insertion are exactly those of
EvFindOrInsert on the batch with every occurrence. `proxy` carries the
gradient path. A sharded EV's lookup deduplicates on the worker and sends each
shard its distinct keys and counts.
)doc");
