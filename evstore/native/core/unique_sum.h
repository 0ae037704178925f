// Gradient deduplication before a fused apply: the rows of duplicate keys
// in one batch are summed, so each key is updated once per step.
#pragma once
#include <cstdint>
#include <vector>

#include "key_traits.h"

namespace evstore {

// Sums the gradients of duplicate keys: writes unique keys (first-occurrence
// order) to ukeys and their summed rows to ugrads; returns the unique count.
template <typename K, typename Traits = KeyTraits<K>>
int64_t UniqueSum(const K* keys, const float* grads, int64_t n, int dim, std::vector<K>* ukeys,
                  std::vector<float>* ugrads) {
  size_t cap = 16;
  while (cap < static_cast<size_t>(n) * 2) cap <<= 1;
  std::vector<int64_t> slot(cap, -1);
  ukeys->clear();
  ugrads->clear();
  ukeys->reserve(n);
  ugrads->reserve(static_cast<size_t>(n) * dim);
  for (int64_t i = 0; i < n; ++i) {
    size_t p = Traits::Hash(keys[i]) & (cap - 1);
    while (slot[p] >= 0 && !((*ukeys)[slot[p]] == keys[i])) p = (p + 1) & (cap - 1);
    const float* g = grads + i * dim;
    if (slot[p] < 0) {
      slot[p] = static_cast<int64_t>(ukeys->size());
      ukeys->push_back(keys[i]);
      ugrads->insert(ugrads->end(), g, g + dim);
    } else {
      float* u = ugrads->data() + slot[p] * dim;
      for (int d = 0; d < dim; ++d) u[d] += g[d];
    }
  }
  return static_cast<int64_t>(ukeys->size());
}

}  // namespace evstore
