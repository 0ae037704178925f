// Key age and eviction policies (GlobalStepEvict, L2WeightEvict). No TensorFlow.
//
// How a key's age is stored (index + metadata stay within 32 bytes per key):
//
//   Admitted key: the arena's int64 version slot beside its row.
//     v >= 0   last optimizer update was at global step v
//     v == -1  never updated, admission step unknown (a row loaded without a
//              version, or admitted before the table saw any global step)
//     v <= -2  never updated, admitted at step -2 - v
//   The public version (ev.version(), Table::Read's callers that decode) is
//   PublicVersion(v): v if v >= 0, else -1. Checkpoints and ev.export() carry
//   the raw slot, so the admission step survives a save and a restore.
//
//   Filtered key (counted, not admitted): it owns no row, so its entry's
//   32-bit `row` field holds the step it was last looked up at:
//     row <  kRowLimit (2^31)           a real row id (admitted)
//     row == kNoRow                     filtered, last-seen step unknown
//     kRowLimit <= row < kNoRow - 1     filtered, last seen at row - kRowLimit
//   (steps saturate at 2^31 - 3; kNoRow - 1 is the table's transient
//   "admitting" mark). Checkpoints carry filtered keys' counts and last-seen
//   steps (-keys_filtered / -freqs_filtered / -seen_filtered) and the clock
//   (-clock), so a restored table ages keys exactly as the saved one would.
//
// "Now" for a lookup is the table's clock: the highest global step it has
// seen (optimizer applies, evict calls, versions of restored rows). A key
// admitted by a training lookup records the clock as its admission step; a
// filtered key records it as its last sighting.
//
// Eviction (Table::Evict(step, policy)) removes a key when ANY enabled policy
// says so:
//   GlobalStepEvict  step - reference > steps_to_live, reference = last update,
//                    else admission step (admitted), else last sighting
//                    (filtered). A key whose reference is unknown is not
//                    evicted; it is stamped with `step` instead (it counts
//                    from this eviction pass on).
//   L2WeightEvict    admitted key whose embedding's L2 norm < threshold
//                    (filtered keys have no row: never evicted by L2).
#pragma once
#include <cmath>
#include <cstdint>

namespace evstore {

inline constexpr uint32_t kRowLimit = 0x80000000u;       // row ids are < 2^31
inline constexpr uint32_t kNoRowMark = 0xFFFFFFFFu;      // == RowArena::kNoRow
inline constexpr int64_t kMaxSeenStep = 0x7FFFFFFDll;    // last-seen steps saturate here

// ---- admitted keys: the version slot -----------------------------------------
inline int64_t EncodeAdmission(int64_t clock) { return clock < 0 ? -1 : -2 - clock; }
inline int64_t PublicVersion(int64_t v) { return v < 0 ? -1 : v; }
// The step a key's age counts from, or -1 if unknown.
inline int64_t VersionReference(int64_t v) { return v >= 0 ? v : (v == -1 ? -1 : -2 - v); }

// ---- filtered keys: the entry's row field --------------------------------------
inline bool RowIsReal(uint32_t row) { return row < kRowLimit; }
inline uint32_t FilteredMark(int64_t clock) {
  if (clock < 0) return kNoRowMark;
  return kRowLimit + static_cast<uint32_t>(clock > kMaxSeenStep ? kMaxSeenStep : clock);
}
inline int64_t FilteredReference(uint32_t row) {
  return (row >= kRowLimit && row < kNoRowMark - 1) ? static_cast<int64_t>(row - kRowLimit) : -1;
}

// ---- policies -------------------------------------------------------------------
struct EvictPolicy {
  int64_t steps_to_live = -1;  // GlobalStepEvict; < 0: off
  float l2_threshold = 0.f;    // L2WeightEvict; <= 0: off
  bool any() const { return steps_to_live >= 0 || l2_threshold > 0.f; }
};

enum class EvictDecision { kKeep, kEvict, kStamp };

// Decision for one key. `reference` is its age reference (-1 unknown); `row`
// its embedding (dim floats) or null for a filtered key.
inline EvictDecision Decide(const EvictPolicy& p, int64_t step, int64_t reference, const float* row, int dim) {
  if (p.l2_threshold > 0.f && row) {
    double ss = 0;
    for (int d = 0; d < dim; ++d) ss += static_cast<double>(row[d]) * row[d];
    if (std::sqrt(ss) < p.l2_threshold) return EvictDecision::kEvict;
  }
  if (p.steps_to_live >= 0) {
    if (reference < 0) return EvictDecision::kStamp;
    if (step - reference > p.steps_to_live) return EvictDecision::kEvict;
  }
  return EvictDecision::kKeep;
}

}  // namespace evstore
