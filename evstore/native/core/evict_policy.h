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
// Eviction (Table::Evict(step, policies)) removes a key when ANY policy of
// the set says so (EvictionPolicies below). Each policy is one class behind
// the EvictionPolicy interface, deciding for one key at a time:
//   GlobalStepEviction  step - reference > steps_to_live, reference = last
//                    update, else admission step (admitted), else last
//                    sighting (filtered). A key whose reference is unknown is
//                    not evicted; it is stamped with `step` instead (it counts
//                    from this eviction pass on).
//   L2WeightEviction admitted key whose embedding's L2 norm < threshold
//                    (filtered keys have no row: never evicted by L2).
// Combining: kEvict from any policy wins; else kStamp from any; else kKeep.
// Several policies of one kind are merged by the kind itself (Merge: the
// shortest steps_to_live, the highest threshold), never by the set.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "row_store.h"

namespace evstore {

inline constexpr uint32_t kRowLimit = kMaxRowIds;        // row ids are < 2^31
inline constexpr uint32_t kNoRowMark = kNoRowId;         // filtered, last sighting unknown
inline constexpr int64_t kMaxSeenStep = 0x7FFFFFFDll;    // last-seen steps saturate here
// The marks above a row id: kRowLimit + kMaxSeenStep is the highest last-seen
// mark, kNoRowMark - 1 stays free for the table's transient "admitting" mark.
static_assert(kRowLimit + static_cast<uint32_t>(kMaxSeenStep) == kNoRowMark - 2, "step marks end below admitting");

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
enum class EvictDecision { kKeep, kEvict, kStamp };

// One eviction rule. Decide() sees one key: its age `reference` (-1 unknown)
// and its embedding `row` (dim floats), or null for a filtered key. Called
// under the key's segment lock; must not block.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual EvictDecision Decide(int64_t step, int64_t reference, const float* row, int dim) const = 0;
  // Whether Decide reads `row` (else the table passes null and never reads it).
  virtual bool NeedsRow() const = 0;
  virtual std::string DebugString() const = 0;
};

class GlobalStepEviction final : public EvictionPolicy {
 public:
  explicit GlobalStepEviction(int64_t steps_to_live) : steps_to_live_(steps_to_live) {}
  int64_t steps_to_live() const { return steps_to_live_; }
  // Two step limits: the stricter one.
  static GlobalStepEviction Merge(const GlobalStepEviction& a, const GlobalStepEviction& b) {
    return GlobalStepEviction(a.steps_to_live_ < b.steps_to_live_ ? a.steps_to_live_ : b.steps_to_live_);
  }
  EvictDecision Decide(int64_t step, int64_t reference, const float*, int) const override {
    if (reference < 0) return EvictDecision::kStamp;
    return step - reference > steps_to_live_ ? EvictDecision::kEvict : EvictDecision::kKeep;
  }
  bool NeedsRow() const override { return false; }
  std::string DebugString() const override { return "GlobalStepEviction(" + std::to_string(steps_to_live_) + ")"; }

 private:
  int64_t steps_to_live_;
};

class L2WeightEviction final : public EvictionPolicy {
 public:
  explicit L2WeightEviction(float threshold) : threshold_(threshold) {}
  float threshold() const { return threshold_; }
  // Two thresholds: the higher one.
  static L2WeightEviction Merge(const L2WeightEviction& a, const L2WeightEviction& b) {
    return L2WeightEviction(a.threshold_ > b.threshold_ ? a.threshold_ : b.threshold_);
  }
  EvictDecision Decide(int64_t, int64_t, const float* row, int dim) const override {
    if (!row) return EvictDecision::kKeep;
    double ss = 0;
    for (int d = 0; d < dim; ++d) ss += static_cast<double>(row[d]) * row[d];
    return std::sqrt(ss) < threshold_ ? EvictDecision::kEvict : EvictDecision::kKeep;
  }
  bool NeedsRow() const override { return true; }
  std::string DebugString() const override { return "L2WeightEviction(" + std::to_string(threshold_) + ")"; }

 private:
  float threshold_;
};

// The policies of one Evict call: a key goes when any policy evicts it.
class EvictionPolicies {
 public:
  EvictionPolicies() = default;
  template <typename P>
  EvictionPolicies& Add(P policy) {
    policies_.push_back(std::make_unique<P>(std::move(policy)));
    return *this;
  }
  bool empty() const { return policies_.empty(); }
  bool NeedsRow() const {
    for (const auto& p : policies_)
      if (p->NeedsRow()) return true;
    return false;
  }
  EvictDecision Decide(int64_t step, int64_t reference, const float* row, int dim) const {
    EvictDecision d = EvictDecision::kKeep;
    for (const auto& p : policies_) {
      switch (p->Decide(step, reference, row, dim)) {
        case EvictDecision::kEvict:
          return EvictDecision::kEvict;
        case EvictDecision::kStamp:
          d = EvictDecision::kStamp;
          break;
        case EvictDecision::kKeep:
          break;
      }
    }
    return d;
  }

 private:
  std::vector<std::unique_ptr<EvictionPolicy>> policies_;
};

}  // namespace evstore
