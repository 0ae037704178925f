// The schema: names the C++ and Python sides share, defined once here and
// mirrored by evstore/schema.py (tests/native/test_schema.py reads this file
// and checks the mirror, and the registered ops, against it).
//
//   Checkpoint tensors   per EmbeddingVariable `<ev>`:
//       <ev>-keys [N]            admitted keys (key dtype)
//       <ev>-values [N, dim]     their embeddings
//       <ev>-versions [N]        raw version slots (evict_policy.h encodings)
//       <ev>-freqs [N]           frequencies
//       <ev>/<slot>-values [N, dim]   one per optimizer slot
//       <ev>/<slot>-initial_value [1]  the value the slot starts at in rows
//                                admitted later (Adagrad's initial_accumulator_value);
//                                absent in checkpoints written before it existed
//       <ev>-keys_filtered [M]   counted, not admitted keys
//       <ev>-freqs_filtered [M]  their counts
//       <ev>-seen_filtered [M]   their last-seen steps (-1 unknown)
//       <ev>-clock [1]           the table's clock (evict_policy.h)
//       <ev>-bloom_geometry [3], <ev>-bloom_blocks [B], <ev>-bloom_counters
//                                [B, 4096]: a BloomFilter's counters (filter_policy.h)
//       <ev>-deleted_keys [D]    deltas only: keys erased since the parent
//     and, in a tf.train.Checkpoint (not our bundles), the slots packed as
//       <ev>-slots [N, S, dim] and <ev>-slot_names [S], with the slots'
//       initial values as <ev>-slot_initial_values [S] (beside its own
//       <ev>-slot_names) in the table's optional child object
//   Stats fields         EvStats' output vector, in this order (TableStats).
//   Op inputs            names the kernels read inputs by (ctx->input(name)).
//   Shard route          the name of the key -> shard route (shard.h) in manifests.
// No TensorFlow here: plain strings.
#pragma once
#include <string>

namespace evstore {
namespace schema {

// ---- checkpoint tensor names ----------------------------------------------------
inline constexpr const char* kKeys = "-keys";
inline constexpr const char* kValues = "-values";
inline constexpr const char* kVersions = "-versions";
inline constexpr const char* kFreqs = "-freqs";
inline constexpr const char* kKeysFiltered = "-keys_filtered";
inline constexpr const char* kFreqsFiltered = "-freqs_filtered";
inline constexpr const char* kSeenFiltered = "-seen_filtered";  // their last-seen steps (-1 unknown)
inline constexpr const char* kClock = "-clock";                  // [1]: the table's clock
inline constexpr const char* kBloomGeometry = "-bloom_geometry";  // BloomFilter only: [3]
inline constexpr const char* kBloomBlocks = "-bloom_blocks";      // BloomFilter only: block ids
inline constexpr const char* kBloomCounters = "-bloom_counters";  // BloomFilter only: [n, kBlock]
inline constexpr const char* kDeletedKeys = "-deleted_keys";
inline constexpr const char* kSlots = "-slots";            // tf.train.Checkpoint only
inline constexpr const char* kSlotNames = "-slot_names";  // tf.train.Checkpoint only
inline constexpr const char* kSlotSeparator = "/";
inline constexpr const char* kSlotValues = "-values";
inline constexpr const char* kSlotInitialValue = "-initial_value";         // [1]: after SlotPrefix
inline constexpr const char* kSlotInitialValues = "-slot_initial_values";  // tf.train.Checkpoint only

// ---- key limits ------------------------------------------------------------------
// The longest string key (bytes): StringKeyTraits (key_traits.h) stores a key's
// length in 16 bits; a longer key fails its op before anything changes.
inline constexpr int kMaxStringKeyBytes = 65535;

// ---- shard routing ---------------------------------------------------------------
// The name of ShardOf's route (shard.h), recorded with every shard of a sharded
// EV in checkpoint manifests: a chain restores shard i into shard i only when
// its route is this one, so a new route needs a new name.
inline constexpr const char* kShardRoute = "mix64-v1";

// "<ev><suffix>", e.g. TensorName("user", kKeys) == "user-keys".
inline std::string TensorName(const std::string& ev, const char* suffix) { return ev + suffix; }
// "<ev>/<slot>-values": the slot's prefix (what a checkpoint lists as the
// slot's name) plus kSlotValues.
inline std::string SlotPrefix(const std::string& ev, const std::string& slot) { return ev + kSlotSeparator + slot; }
inline std::string SlotTensor(const std::string& ev, const std::string& slot) {
  return SlotPrefix(ev, slot) + kSlotValues;
}
// "<ev>/<slot>-initial_value": the slot's initial value for rows admitted later.
inline std::string SlotInitialValueTensor(const std::string& ev, const std::string& slot) {
  return SlotPrefix(ev, slot) + kSlotInitialValue;
}

// ---- stats fields ---------------------------------------------------------------
// X(name, meaning): TableStats (table.h) has one int64 member per entry, and
// EvStats writes them in this order.
#define EVSTORE_STATS_FIELDS(X)                                                       \
  X(size, "keys in the index (admitted + filtered)")                                  \
  X(admitted, "keys with a row")                                                      \
  X(filtered, "counted, not admitted (with a Bloom filter: plus an estimate)")        \
  X(free_rows, "rows in the row store's free list")                                   \
  X(index_bytes, "segments: control bytes, entries, dirty lists, deleted sets")       \
  X(meta_bytes, "per-row metadata (versions)")                                        \
  X(row_bytes, "rows (embedding + slots)")                                            \
  X(dirty, "entries in the open dirty lists (upper bound of dirty keys)")             \
  X(deleted, "keys in the open deleted sets")                                         \
  X(evicted, "keys erased by Evict since the table was created")                      \
  X(filter_bytes, "admission filter counters (0 without a Bloom filter)")             \
  X(zero_rows, "admitted keys whose embedding is all zero (zero_rows.h)")           \
  X(cache_hits, "tiered storage: row accesses served from DRAM (0 without a tier)")  \
  X(cache_misses, "tiered storage: rows read back from disk into DRAM")              \
  X(cache_rows, "tiered storage: rows in DRAM now")                                  \
  X(disk_bytes, "tiered storage: bytes of rows on disk")                             \
  X(cache_capacity, "tiered storage: rows the DRAM budget holds (at the rows' width)")

#define EVSTORE_STATS_NAME_(name, doc) #name,
inline constexpr const char* kStatsFields[] = {EVSTORE_STATS_FIELDS(EVSTORE_STATS_NAME_)};
#undef EVSTORE_STATS_NAME_
inline constexpr int kNumStatsFields = sizeof(kStatsFields) / sizeof(kStatsFields[0]);

// ---- op inputs ------------------------------------------------------------------
// Every op on a table takes it as input kHandle. Every fused apply (EvApply*)
// takes kApplyInputs first, then its scalar hyper-parameters, by name.
inline constexpr const char* kHandle = "handle";
inline constexpr const char* kKeysInput = "keys";
inline constexpr const char* kGradsInput = "grads";
inline constexpr const char* kGlobalStepInput = "global_step";
inline constexpr const char* kApplyInputs[] = {kHandle, kKeysInput, kGradsInput, kGlobalStepInput};
inline constexpr int kNumApplyInputs = sizeof(kApplyInputs) / sizeof(kApplyInputs[0]);

}  // namespace schema
}  // namespace evstore
