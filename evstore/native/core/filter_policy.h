// Admission policies: which keys earn a row. No TensorFlow.
//
// One class per policy behind the AdmissionPolicy interface (end of file); the
// table asks it two questions: where are keys not yet admitted counted, and
// does a count admit. Python mirror: evstore/filters.py (one class each too).
//
// CounterAdmission (CounterFilter; also "no filter" with min_freq 1): the
// table counts exact frequencies in the index entry (segment.h) and admits a
// key when its count reaches min_freq.
//
// BloomAdmission (BloomFilter, CountingBloom below): keys that are not admitted
// get no index entry at all; their sightings are counted in a counting Bloom
// filter and a key is admitted when its estimate reaches min_freq.
//
// Layout: `counters_` holds nseg regions of `per_seg_` 8-bit saturating
// counters (255 max). A key only touches the region of its index segment, so
// every access happens under that segment's lock and needs no atomics (the
// segment-parallel FindOrInsert stays lock-free between segments).
// Positions: k = round(m/n * ln 2) probes by double hashing of an independent
// mix of the key hash; m = -n ln(p) / ln(2)^2 counters for capacity n and
// false-positive rate p (one byte each).
//
// Counting uses conservative update: adding c sightings raises each of the
// key's k counters to max(counter, min + c). The estimate (min over the k
// counters) is therefore never below the key's true count: a key is never
// admitted late. Another key sharing all k counters can push it over the
// threshold early; with up to `capacity` distinct keys counted, the chance that
// a given key's estimate is inflated at all is about fp_rate. Counters never
// decrease (no deletion), so past `capacity` distinct keys the rate of early
// admissions grows; DistinctEstimate() tells how full the filter is.
//
// Checkpoints: the counters decide future admissions, so they are saved. Each
// segment's region is cut into blocks of kBlock counters (the last one of a
// region is short); Add marks the blocks it raises dirty (a flag per block,
// under the segment lock, like the index's dirty list). A full checkpoint
// carries every non-zero block, a delta the blocks raised since the last
// committed export (SealDirty / MarkBlocksDirty follow the table's two-phase
// export). Geometry() (segments, counters per segment, hashes) is saved with
// them: counters are only meaningful in a filter of the same geometry.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hash.h"

namespace evstore {

struct BloomConfig {
  int64_t capacity = 0;   // expected distinct keys; 0 = no Bloom filter
  double fp_rate = 0.01;  // in (0, 1)
};

class CountingBloom {
 public:
  static constexpr uint32_t kMaxCount = 255;
  static constexpr int64_t kBlock = 4096;  // counters per checkpoint block

  CountingBloom(const BloomConfig& cfg, int nseg) : nseg_(nseg) {
    if (cfg.capacity < 1) throw std::invalid_argument("bloom capacity must be >= 1");
    if (!(cfg.fp_rate > 0.0 && cfg.fp_rate < 1.0))
      throw std::invalid_argument("bloom fp_rate must be in (0, 1), got " + std::to_string(cfg.fp_rate));
    const double ln2 = std::log(2.0);
    double m = std::ceil(-static_cast<double>(cfg.capacity) * std::log(cfg.fp_rate) / (ln2 * ln2));
    int k = static_cast<int>(std::lround(m / cfg.capacity * ln2));
    hashes_ = std::min(30, std::max(1, k));
    per_seg_ = std::max<uint64_t>(64, static_cast<uint64_t>(std::ceil(m / nseg)));
    counters_.assign(per_seg_ * nseg, 0);
    blocks_per_seg_ = static_cast<int64_t>((per_seg_ + kBlock - 1) / kBlock);
    block_dirty_.assign(blocks_per_seg_ * nseg, 0);
  }

  int hashes() const { return hashes_; }
  int64_t counters() const { return static_cast<int64_t>(counters_.size()); }
  int64_t bytes() const { return counters(); }

  // Adds `n` sightings of the key with hash h in segment s (conservative
  // update). Caller holds segment s's lock exclusively.
  void Add(int s, uint64_t h, uint32_t n) {
    uint8_t* c = &counters_[s * per_seg_];
    uint64_t pos[32];
    Positions(h, pos);
    uint32_t lo = kMaxCount;
    for (int i = 0; i < hashes_; ++i) lo = std::min<uint32_t>(lo, c[pos[i]]);
    uint32_t want = std::min<uint32_t>(kMaxCount, lo + n);
    for (int i = 0; i < hashes_; ++i)
      if (c[pos[i]] < want) {
        c[pos[i]] = static_cast<uint8_t>(want);
        block_dirty_[s * blocks_per_seg_ + static_cast<int64_t>(pos[i]) / kBlock] = 1;
      }
  }

  // Prefetches the key's counters (k cache lines at most): batch callers
  // prefetch a few keys ahead of Add/Estimate so the misses overlap.
  void Prefetch(int s, uint64_t h) const {
    const uint8_t* c = &counters_[s * per_seg_];
    uint64_t pos[32];
    Positions(h, pos);
    for (int i = 0; i < hashes_; ++i) __builtin_prefetch(c + pos[i]);
  }

  // The key's count estimate (>= its true count, saturating at 255). Caller
  // holds segment s's lock (shared is enough).
  uint32_t Estimate(int s, uint64_t h) const {
    const uint8_t* c = &counters_[s * per_seg_];
    uint64_t pos[32];
    Positions(h, pos);
    uint32_t lo = kMaxCount;
    for (int i = 0; i < hashes_; ++i) lo = std::min<uint32_t>(lo, c[pos[i]]);
    return lo;
  }

  // Estimated number of distinct keys counted in segment s (from the share of
  // non-zero counters: -m/k ln(1 - X/m)). Caller holds segment s's lock.
  double DistinctEstimate(int s) const {
    const uint8_t* c = &counters_[s * per_seg_];
    uint64_t nonzero = 0;
    for (uint64_t i = 0; i < per_seg_; ++i) nonzero += c[i] != 0;
    if (nonzero >= per_seg_) nonzero = per_seg_ - 1;
    double m = static_cast<double>(per_seg_);
    return -m / hashes_ * std::log(1.0 - nonzero / m);
  }

  // Zeroes segment s's counters and dirty flags (Table::Clear). Caller holds its lock.
  void ClearSegment(int s) {
    std::fill_n(&counters_[s * per_seg_], per_seg_, 0);
    std::fill_n(&block_dirty_[s * blocks_per_seg_], blocks_per_seg_, 0);
  }

  // ---- checkpoint blocks (ids are global: segment * blocks_per_seg + block) ----
  // (segments, counters per segment, hashes): what positions depend on.
  std::vector<int64_t> Geometry() const {
    return {nseg_, static_cast<int64_t>(per_seg_), hashes_};
  }
  int64_t blocks_per_segment() const { return blocks_per_seg_; }
  int64_t num_blocks() const { return static_cast<int64_t>(block_dirty_.size()); }
  int SegmentOfBlock(int64_t id) const { return static_cast<int>(id / blocks_per_seg_); }
  // Appends segment s's dirty block ids to `out` and clears their flags.
  // Caller holds segment s's lock exclusively.
  void SealDirty(int s, std::vector<int64_t>* out) {
    for (int64_t b = 0; b < blocks_per_seg_; ++b) {
      uint8_t& d = block_dirty_[s * blocks_per_seg_ + b];
      if (d) {
        out->push_back(s * blocks_per_seg_ + b);
        d = 0;
      }
    }
  }
  // Re-marks a block dirty (a failed export's blocks). Caller holds its segment's lock.
  void MarkBlockDirty(int64_t id) { block_dirty_[id] = 1; }
  // Copies block `id` to out[0, kBlock) (zero-padded past the region's end);
  // returns whether any counter is non-zero. Caller holds its segment's lock.
  bool ReadBlock(int64_t id, uint8_t* out) const {
    const int64_t n = BlockLength(id);
    const uint8_t* src = BlockStart(id);
    std::memcpy(out, src, n);
    std::memset(out + n, 0, kBlock - n);
    for (int64_t i = 0; i < n; ++i)
      if (src[i]) return true;
    return false;
  }
  // Overwrites block `id` from in[0, kBlock) (a restore). Caller holds its
  // segment's lock exclusively.
  void WriteBlock(int64_t id, const uint8_t* in) {
    if (id < 0 || id >= num_blocks()) throw std::out_of_range("bloom block id out of range");
    std::memcpy(const_cast<uint8_t*>(BlockStart(id)), in, BlockLength(id));
  }

 private:
  void Positions(uint64_t h, uint64_t* pos) const {
    uint64_t g = Mix64(h ^ 0xb492b66fbe98f273ULL);
    uint32_t a = static_cast<uint32_t>(g), b = static_cast<uint32_t>(g >> 32) | 1u;
    for (int i = 0; i < hashes_; ++i) {
      uint32_t x = a + static_cast<uint32_t>(i) * b;
      pos[i] = (static_cast<uint64_t>(x) * per_seg_) >> 32;
    }
  }

  const uint8_t* BlockStart(int64_t id) const {
    return &counters_[SegmentOfBlock(id) * per_seg_ + (id % blocks_per_seg_) * kBlock];
  }
  int64_t BlockLength(int64_t id) const {
    return std::min<int64_t>(kBlock, static_cast<int64_t>(per_seg_) - (id % blocks_per_seg_) * kBlock);
  }

  int nseg_;
  int hashes_ = 1;
  uint64_t per_seg_ = 0;
  int64_t blocks_per_seg_ = 1;
  std::vector<uint8_t> counters_;
  std::vector<uint8_t> block_dirty_;  // [nseg * blocks_per_seg]: raised since the last seal
};

// ---- admission policies -------------------------------------------------------

// The interface the table uses. Counting outside the index (Bloom) happens in
// segment s's region under segment s's lock, exclusive for Add/ClearSegment.
class AdmissionPolicy {
 public:
  explicit AdmissionPolicy(uint32_t min_freq) : min_freq_(min_freq < 1 ? 1 : min_freq) {}
  virtual ~AdmissionPolicy() = default;
  uint32_t min_freq() const { return min_freq_; }
  bool Admits(uint64_t count) const { return count >= min_freq_; }

  // True: a key not yet admitted has an index entry holding its exact count.
  // False: it has none; Add/Estimate count it outside the index.
  virtual bool CountsInIndex() const = 0;
  virtual void Prefetch(int /*s*/, uint64_t /*h*/) const {}
  virtual void Add(int /*s*/, uint64_t /*h*/, uint32_t /*n*/) {}
  virtual uint32_t Estimate(int /*s*/, uint64_t /*h*/) const { return 0; }
  // Distinct keys counted outside the index in segment s (an estimate).
  virtual double DistinctEstimate(int /*s*/) const { return 0; }
  virtual void ClearSegment(int /*s*/) {}
  virtual int64_t bytes() const { return 0; }
  // Counters kept outside the index that a checkpoint must carry (saved and
  // restored in blocks: CountingBloom's checkpoint API), or null.
  virtual const CountingBloom* bloom() const { return nullptr; }
  virtual CountingBloom* mutable_bloom() { return nullptr; }

 private:
  uint32_t min_freq_;
};

class CounterAdmission final : public AdmissionPolicy {
 public:
  using AdmissionPolicy::AdmissionPolicy;
  bool CountsInIndex() const override { return true; }
};

class BloomAdmission final : public AdmissionPolicy {
 public:
  BloomAdmission(uint32_t min_freq, const BloomConfig& cfg, int nseg)
      : AdmissionPolicy(CheckMinFreq(min_freq)), bloom_(cfg, nseg) {}
  bool CountsInIndex() const override { return false; }
  void Prefetch(int s, uint64_t h) const override { bloom_.Prefetch(s, h); }
  void Add(int s, uint64_t h, uint32_t n) override { bloom_.Add(s, h, n); }
  uint32_t Estimate(int s, uint64_t h) const override { return bloom_.Estimate(s, h); }
  double DistinctEstimate(int s) const override { return bloom_.DistinctEstimate(s); }
  void ClearSegment(int s) override { bloom_.ClearSegment(s); }
  int64_t bytes() const override { return bloom_.bytes(); }
  const CountingBloom* bloom() const override { return &bloom_; }
  CountingBloom* mutable_bloom() override { return &bloom_; }

 private:
  static uint32_t CheckMinFreq(uint32_t f) {
    if (f > CountingBloom::kMaxCount)
      throw std::invalid_argument("a Bloom filter counts up to 255: min_freq must be <= 255, got " +
                                  std::to_string(f));
    return f;
  }
  CountingBloom bloom_;
};

// The policy a table config asks for: a Bloom filter when bloom.capacity > 0,
// else exact counters.
inline std::unique_ptr<AdmissionPolicy> MakeAdmissionPolicy(uint32_t min_freq, const BloomConfig& bloom, int nseg) {
  if (bloom.capacity > 0) return std::make_unique<BloomAdmission>(min_freq, bloom, nseg);
  return std::make_unique<CounterAdmission>(min_freq);
}

}  // namespace evstore
