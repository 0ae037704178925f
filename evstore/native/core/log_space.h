// LogSpace: where a tiered store's rows sit in its record file (row_file.h),
// laid out as a log. No TensorFlow, no I/O, no locking: the store's mutex
// guards every call (tiered_store.h).
//
// Layout
//   The file is cut into extents of kExtent records. Writes take runs of
//   adjacent records from the open extent (AllocRun), so a batch of evicted
//   rows is one contiguous write; when the open extent is full the next one
//   is a free extent (reused first) or a new one at the end of the file.
//   Per extent, in DRAM: how many records were handed out (`used`), how many
//   still hold their row's current disk copy (`live`), and per record the row
//   id it was written for (4 bytes per record on disk: compaction needs to
//   know whose record it moves).
//   A record dies (Kill) when its row is written again elsewhere, is freed,
//   or drops its disk copy. An extent that is not open and has no live record
//   returns to the free list at once and is reused before the file grows.
//   While a reader streams the file without the store's locks (a full
//   export: Hold), a freed extent waits on a held list instead and is
//   reused only after the last Unhold, so a record written before the hold
//   is never overwritten under the reader.
// Compaction
//   Rows rewritten at every eviction leave dead records behind in extents
//   that still hold a few live ones. Once dead records outnumber live ones
//   (and a few extents' worth exist), PickSparse names the sparsest closed
//   extent of a bounded window past a cursor; the store moves its live
//   records into its next write batch (each under its owner's segment lock),
//   which frees the extent. The work per batch is one extent, so compaction
//   never holds anything for long.
// Capacity
//   At most max_extents extents (the format's limit, kMaxExtents: 2^32
//   records, or a smaller cap from the tier's config). When every extent is
//   taken and none is free, AllocRun throws std::length_error and hands out
//   nothing more; the store refuses that write-back as it would a full disk.
// Invariants
//   live <= used <= kExtent per extent; the sum of live = rows with a disk copy;
//   free and held extents have used == live == 0; the open extent is never free;
//   ext_.size() <= max_extents_.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace evstore {

class LogSpace {
 public:
  static constexpr uint32_t kExtentShift = 8;
  static constexpr uint32_t kExtent = 1u << kExtentShift;  // records per extent
  static constexpr uint32_t kNone = 0xFFFFFFFFu;
  static constexpr uint32_t kMaxExtents = 1u << (32 - kExtentShift);
  static_assert(kExtent <= 0xFFFF, "per-extent counts are 16 bits");
  static_assert(uint64_t{kMaxExtents} << kExtentShift == uint64_t{1} << 32, "locations are 32-bit record numbers");

  // max_records: the cap on the file's records, rounded up to whole extents
  // (0 or anything beyond the format's limit: the limit).
  explicit LogSpace(uint64_t max_records = 0)
      : max_extents_(max_records == 0 || max_records >= (uint64_t{kMaxExtents} << kExtentShift)
                         ? kMaxExtents
                         : static_cast<uint32_t>((max_records + kExtent - 1) >> kExtentShift)) {}

  // Up to `want` adjacent records from the open extent, for row ids
  // rows[0..n): *first is the first location, the return value n >= 1.
  // Records handed out are live (Kill those a failed write leaves unwritten).
  uint32_t AllocRun(const uint32_t* rows, uint32_t want, uint32_t* first) {
    if (open_ == kNone || ext_[open_].used == kExtent) OpenNext();
    Extent& e = ext_[open_];
    const uint32_t n = std::min<uint32_t>(want, kExtent - e.used);
    *first = (open_ << kExtentShift) + e.used;
    for (uint32_t i = 0; i < n; ++i) e.rows[e.used + i] = rows[i];
    e.used = static_cast<uint16_t>(e.used + n);
    e.live = static_cast<uint16_t>(e.live + n);
    live_ += n;
    return n;
  }

  // The record at `loc` no longer holds a current row copy.
  void Kill(uint32_t loc) {
    const uint32_t x = loc >> kExtentShift;
    Extent& e = ext_[x];
    --e.live;
    --live_;
    if (e.live == 0 && x != open_) Release(x);
  }

  uint32_t row_of(uint32_t loc) const { return ext_[loc >> kExtentShift].rows[loc & (kExtent - 1)]; }
  static uint32_t ExtentOf(uint32_t loc) { return loc >> kExtentShift; }
  static uint32_t FirstOf(uint32_t extent) { return extent << kExtentShift; }
  uint32_t used(uint32_t extent) const { return ext_[extent].used; }

  // A closed extent worth compacting (the sparsest of a window of
  // kWindow extents past the cursor, at most half live), or kNone when dead
  // records do not yet outnumber live ones.
  uint32_t PickSparse() {
    const int64_t records = static_cast<int64_t>(ext_.size() - free_.size() - held_.size()) * kExtent;
    const int64_t dead = records - live_;
    if (dead <= live_ || dead < 4 * static_cast<int64_t>(kExtent)) return kNone;
    static constexpr uint32_t kWindow = 64;
    uint32_t best = kNone, best_live = kExtent / 2 + 1;
    const uint32_t n = static_cast<uint32_t>(ext_.size());
    for (uint32_t k = 0; k < kWindow && k < n; ++k) {
      const uint32_t x = cursor_;
      cursor_ = cursor_ + 1 >= n ? 0 : cursor_ + 1;
      const Extent& e = ext_[x];
      if (x == open_ || e.used == 0 || e.live >= best_live) continue;
      best = x;
      best_live = e.live;
    }
    return best;
  }

  // While held (Hold calls not yet matched by Unhold), no extent is reused:
  // freed ones wait on the held list and the file grows instead.
  void Hold() { ++holds_; }
  void Unhold() {
    if (--holds_ > 0) return;
    free_.insert(free_.end(), held_.begin(), held_.end());
    held_.clear();
  }

  // Records written so far that the file spans (its apparent size), records
  // holding a current row copy, and the DRAM this bookkeeping takes.
  int64_t records() const { return static_cast<int64_t>(ext_.size()) * kExtent; }
  int64_t live() const { return live_; }
  int64_t bytes() const {
    int64_t b = static_cast<int64_t>(ext_.capacity()) * sizeof(Extent) +
                static_cast<int64_t>(free_.capacity() + held_.capacity()) * sizeof(uint32_t);
    for (const Extent& e : ext_) b += e.rows ? kExtent * sizeof(uint32_t) : 0;
    return b;
  }

  // Starts over with records [0, n) live, record i holding row_of(i) (the
  // file was rewritten in that order: a widening).
  template <typename RowOf>
  void Rebuild(uint32_t n, const RowOf& row_of) {
    ext_.clear();
    free_.clear();
    held_.clear();
    open_ = kNone;
    live_ = 0;
    cursor_ = 0;
    std::vector<uint32_t> rows(kExtent);
    for (uint32_t lo = 0; lo < n;) {
      const uint32_t m = std::min(kExtent, n - lo);
      for (uint32_t i = 0; i < m; ++i) rows[i] = row_of(lo + i);
      uint32_t first;
      const uint32_t got = AllocRun(rows.data(), m, &first);
      lo += got;
    }
  }

 private:
  struct Extent {
    uint16_t used = 0, live = 0;
    std::unique_ptr<uint32_t[]> rows;
  };

  void OpenNext() {
    if (open_ != kNone && ext_[open_].live == 0) Release(open_);
    if (!free_.empty()) {
      open_ = free_.back();
      free_.pop_back();
      return;
    }
    if (ext_.size() >= max_extents_)
      throw std::length_error("tiered storage: the tier file is full (" +
                              std::to_string(uint64_t{max_extents_} << kExtentShift) + " records)");
    ext_.emplace_back();
    ext_.back().rows.reset(new uint32_t[kExtent]);
    open_ = static_cast<uint32_t>(ext_.size() - 1);
  }
  void Release(uint32_t x) {
    ext_[x].used = 0;
    (holds_ > 0 ? held_ : free_).push_back(x);
  }

  uint32_t max_extents_;
  std::vector<Extent> ext_;
  std::vector<uint32_t> free_;  // extents with nothing live, reused first
  std::vector<uint32_t> held_;  // extents freed while held: free at the last Unhold
  int holds_ = 0;
  uint32_t open_ = kNone;       // the extent writes go to
  int64_t live_ = 0;
  uint32_t cursor_ = 0;         // where PickSparse's window starts
};

}  // namespace evstore
