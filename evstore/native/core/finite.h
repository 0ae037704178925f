// The NaN/Inf policy, in one place: a gradient batch holding any non-finite
// value is refused whole, naming the first offending key, and nothing of it is
// applied. Both the fused applies (tf/apply_base.h) and the optimizers' pre-
// check of every EV gradient (EvCheckFinite, tf/training_kernels.cc) call
// these two functions, so the rule and its message cannot drift apart.
#pragma once
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

namespace evstore {

// Index of the first non-finite value of g[0, n), or -1 when all are finite.
inline int64_t FirstNonFinite(const float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(g[i])) return i;
  return -1;
}

// The refusal message for value `v` of key `key` at batch position `pos`
// (ev_name empty: not named).
// `key` is the key as text (KeyText in the kernels: an integer, or a quoted string key).
inline std::string NonFiniteMessage(float v, const std::string& key, int64_t pos, const std::string& ev_name) {
  std::ostringstream m;
  m << "non-finite gradient (" << v << ") for key " << key;
  if (!ev_name.empty()) m << " of EmbeddingVariable '" << ev_name << "'";
  m << " at batch position " << pos << "; nothing was applied. Check the loss for NaN/Inf or clip gradients.";
  return m.str();
}

}  // namespace evstore
