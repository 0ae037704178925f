// How the core splits work across threads without knowing who owns them.
// The TensorFlow kernels pass TF's intra-op thread pool; tests pass SerialFor
// or a std::thread pool. `work(begin, end)` is called on disjoint ranges that
// cover [0, total); `cost_per_unit` is a rough cost (ns) used to size shards.
#pragma once
#include <cstdint>
#include <functional>

namespace evstore {

using ParallelFor = std::function<void(int64_t total, int64_t cost_per_unit,
                                       const std::function<void(int64_t, int64_t)>& work)>;

inline void SerialFor(int64_t total, int64_t /*cost*/,
                      const std::function<void(int64_t, int64_t)>& work) {
  if (total > 0) work(0, total);
}

}  // namespace evstore
