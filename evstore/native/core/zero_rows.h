// Zero rows: admitted keys whose embedding is exactly all zero (+0 or -0).
//
// The group-lasso optimizers (GroupAdam, GroupAdagrad) set a whole row to zero
// when its feature is dropped; such a row contributes nothing to the model, so
// it is a natural eviction candidate. The table counts zero rows per segment
// (Table::Stats().zero_rows), kept exact on every path that writes or frees a
// row: admission (a zero initializer row counts), optimizer apply, import,
// erase and clear.
//
// ZeroRowPredicate(key, admitted, version, freq, row) selects exactly the rows
// the counter counts, from a Table::ForEachInSegment visit (EvZeroRowKeys;
// Python erases them with ev.remove). An L2-norm threshold > 0 selects them too.
#pragma once
#include <cstdint>

namespace evstore {

// True when all `dim` weights are zero. Exits at the first non-zero weight, so
// on a live row it usually costs one compare.
inline bool IsZeroRow(const float* w, int dim) {
  for (int i = 0; i < dim; ++i)
    if (w[i] != 0.0f) return false;
  return true;
}

struct ZeroRowPredicate {
  int dim;
  template <typename K>
  bool operator()(K /*key*/, bool admitted, int64_t /*version*/, int64_t /*freq*/, const float* row) const {
    return admitted && row != nullptr && IsZeroRow(row, dim);
  }
};

}  // namespace evstore
