// Routing of keys to the shards of a sharded EmbeddingVariable.
//
// A sharded EV is N ordinary tables (one per shard, each a resource on its
// own device: a parameter-server task or the local CPU). Key k lives in shard
// ShardOf(k, N) and nowhere else. The route is a hash of the key, not
// `k % N`: recommendation ids are often patterned (multiples of 1000, a
// field id in the high bits), and `% N` would pile them onto one shard.
//
// Invariants:
//  - ShardOf is part of the checkpoint format: a chain saved with N shards
//    restores shard i straight into shard i of an N-shard EV only because the
//    route never changes. Its name in manifests is schema::kShardRoute
//    (schema.h); a new route needs a new name.
//  - It must not correlate with the table's own hash (HashKey picks the
//    segment from the top bits of Mix64(k)): a different seed feeds the mix,
//    so the keys of one shard still spread over every segment of its table.
#pragma once
#include <cstdint>
#include <string_view>

#include "hash.h"
#include "string_hash.h"

namespace evstore {

template <typename K>
inline int32_t ShardOf(K key, int32_t num_shards) {
  if (num_shards <= 1) return 0;
  const uint64_t h = Mix64(static_cast<uint64_t>(static_cast<int64_t>(key)) ^ 0xd6e8feb86659fd93ULL);
  return static_cast<int32_t>(h % static_cast<uint64_t>(num_shards));
}

// A string key routes as the int64 key whose bits are its FarmHash
// Fingerprint64 (string_hash.h; = tf.fingerprint of the bytes), so the route
// is reproducible with stock TensorFlow: shard = ShardOf(int64(fp), N).
inline int32_t ShardOf(std::string_view key, int32_t num_shards) {
  return ShardOf<int64_t>(static_cast<int64_t>(StringFingerprint64(key)), num_shards);
}

}  // namespace evstore
