// LogSpace: where a tiered store's rows sit in its record file (row_file.h),
// laid out as a log. No TensorFlow, no I/O, no locking: the store's mutex
// guards every call (tiered_store.h).
//
// Layout
//   The file is cut into extents of kExtent records. Writes take runs of
//   adjacent records from an open extent (AllocRun), so a batch of evicted
//   rows is a few contiguous writes. Per extent, in DRAM: how many records
//   were handed out (`used`), how many still hold their row's current disk
//   copy (`live`), and per record the row id it was written for (4 bytes per
//   record: compaction needs to know whose record it moves).
//   A record dies (Kill) when its row is written again elsewhere, is freed,
//   or drops its disk copy. An extent that is not open and has no live record
//   returns to the free list at once. While a reader streams the file without
//   the store's locks (a full export: Hold), a freed extent waits on a held
//   list instead and is reused only after the last Unhold, so a record
//   written before the hold is never overwritten under the reader.
// Streams
//   Three kinds of write, each with its own open extent, so rows that die at
//   different rates do not share extents:
//     kNew   first writes (a row with no disk copy: a load, a restore, a new
//            key): the table grows, so the file grows: a new extent at the end
//            unless more free extents exist than the reserve (below);
//     kHot   rewrites of a row evicted again (its old record dies): a free
//            extent first; the file grows only when none is free;
//     kCold  live records moved by compaction (rows that outlived their
//            extent's others): a free extent first, likewise.
// The reserve
//   A rewrite kills one record and writes one: the table does not grow, and
//   neither should the file. Growing it takes a new page-cache page per 4 KiB
//   written, which costs the writer far more system time than overwriting a
//   cached page (docs/guides/tiered-storage.md, "What a growing log costs").
//   Right after a load every extent is full, so the file keeps free room for
//   rewrites: while live records grow, the store appends free extents written
//   with zeros (in the page cache, on disk) until the extents appended so far
//   hold one record in kReserveShift-th powers of two of the live ones
//   (ReserveGrowth: in chunks of kReserveChunk extents, one large sequential
//   write each). The load pays for those pages (1/8 more than its rows), once.
// Compaction
//   Once free extents fall below half the reserve (CleanMark: at least one
//   per stream), each write batch cleans the sparsest closed extents
//   (PickToClean: a bucket per live count, so the choice is global and
//   O(1)), moving their live records into
//   the kCold stream, which frees them. An extent is cleaned only when at most
//   kMaxCleanLive of its records are live (at most 3 records moved per record
//   freed); when none is that sparse, rewrites grow the file instead, which
//   adds dead room until some extent is. So the file settles where cleaning
//   is cheap, and never holds a lookup for long (a batch moves at most
//   kMaxMoves records).
// Capacity
//   At most max_extents extents (the format's limit, kMaxExtents: 2^32
//   records, or a smaller cap from the tier's config). When every extent is
//   taken and none is free, AllocRun throws std::length_error and hands out
//   nothing more; the store refuses that write-back as it would a full disk.
//   The reserve never takes the last free room: first writes use free
//   extents once the file cannot grow.
// Invariants
//   live <= used <= kExtent per extent; the sum of live = rows with a disk copy;
//   free, held and pending extents have used == live == 0; an open extent is
//   never free; an extent is in by_live_[live] exactly when it is closed
//   (state kClosed) with live >= 1; ext_.size() <= max_extents_.
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
  enum Stream : int { kNew = 0, kHot = 1, kCold = 2 };
  static constexpr int kStreams = 3;
  // The reserve: extents appended free hold up to live >> kReserveShift
  // records, appended kReserveChunk extents at a time (or half the reserve,
  // for a table whose whole reserve is smaller).
  static constexpr uint32_t kReserveShift = 3;
  static constexpr uint32_t kReserveChunk = 16;
  // Compaction: extents with at most this many live records are cleaned; a
  // batch moves at most kMaxMoves records.
  static constexpr uint32_t kMaxCleanLive = kExtent * 3 / 4;
  static constexpr uint32_t kMaxMoves = 2 * kExtent;

  // max_records: the cap on the file's records, rounded up to whole extents
  // (0 or anything beyond the format's limit: the limit).
  explicit LogSpace(uint64_t max_records = 0)
      : max_extents_(max_records == 0 || max_records >= (uint64_t{kMaxExtents} << kExtentShift)
                         ? kMaxExtents
                         : static_cast<uint32_t>((max_records + kExtent - 1) >> kExtentShift)) {}

  // Up to `want` adjacent records from stream s's open extent, for row ids
  // rows[0..n): *first is the first location, the return value n >= 1.
  // Records handed out are live (Kill those a failed write leaves unwritten).
  uint32_t AllocRun(Stream s, const uint32_t* rows, uint32_t want, uint32_t* first) {
    if (open_[s] == kNone || ext_[open_[s]].used == kExtent) OpenNext(s);
    const uint32_t x = open_[s];
    Extent& e = ext_[x];
    const uint32_t n = std::min<uint32_t>(want, kExtent - e.used);
    *first = (x << kExtentShift) + e.used;
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
    const bool bucketed = e.state == kClosed;
    if (bucketed) Unbucket(x);
    --e.live;
    --live_;
    if (e.live == 0 && e.state != kOpen) {
      Release(x);
    } else if (bucketed) {
      Bucket(x);
    }
  }

  uint32_t row_of(uint32_t loc) const { return ext_[loc >> kExtentShift].rows[loc & (kExtent - 1)]; }
  static uint32_t ExtentOf(uint32_t loc) { return loc >> kExtentShift; }
  static uint32_t FirstOf(uint32_t extent) { return extent << kExtentShift; }
  uint32_t used(uint32_t extent) const { return ext_[extent].used; }
  uint32_t live_in(uint32_t extent) const { return ext_[extent].live; }

  // An extent to clean now (the sparsest closed one, at most kMaxCleanLive
  // live), or kNone when free extents are not short (CleanMark) or none is
  // that sparse. It is taken out of the candidates until DoneCleaning.
  uint32_t PickToClean() {
    if (static_cast<int64_t>(free_.size()) >= CleanMark()) return kNone;
    for (uint32_t l = 1; l <= kMaxCleanLive; ++l) {
      if (by_live_[l].empty()) continue;
      const uint32_t x = by_live_[l].back();
      Unbucket(x);
      ext_[x].state = kCleaning;
      return x;
    }
    return kNone;
  }
  // The batch that cleaned extent x has ended: the records it could not
  // move (their owner segments were busy) keep it a candidate.
  void DoneCleaning(uint32_t x) {
    Extent& e = ext_[x];
    if (e.state != kCleaning) return;  // emptied: already free
    e.state = kClosed;
    Bucket(x);
  }
  // Free extents below which write batches clean: half the reserve's
  // extents, and at least one per stream, since one batch may open an extent
  // in each stream: with a mark of one, cleaning started only once no free
  // extent was left, so the opens of the batch that started it grew the file.
  int64_t CleanMark() const { return std::max<int64_t>(kStreams, ReserveTarget() / 2); }

  // Extents to append to the reserve now (0, or a chunk), for ReserveGrowth's
  // caller to write with zeros and then hand over with AddReserve. *first:
  // the first of them. They are neither free nor open meanwhile.
  uint32_t ReserveGrowth(uint32_t* first) {
    const int64_t target = ReserveTarget();
    const int64_t deficit = target - reserved_;
    // A chunk, or for a small reserve half of it at a time (at least one extent).
    if (deficit <= 0 || deficit < std::min<int64_t>(kReserveChunk, (target + 1) / 2)) return 0;
    const uint32_t k = static_cast<uint32_t>(std::min<int64_t>(kReserveChunk, deficit));
    if (ext_.size() + k > max_extents_) return 0;  // the room left is for rows
    *first = static_cast<uint32_t>(ext_.size());
    for (uint32_t i = 0; i < k; ++i) {
      ext_.emplace_back();
      ext_.back().rows.reset(new uint32_t[kExtent]);
      ext_.back().state = kPending;
    }
    reserved_ += k;
    return k;
  }
  // Extents [first, first + k) (from ReserveGrowth, now written) are free.
  void AddReserve(uint32_t first, uint32_t k) {
    for (uint32_t x = first; x < first + k; ++x) Release(x);
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
  // holding a current row copy, free records (free extents), records the
  // file grew by for rewrites and moves (no free extent was left), and the
  // DRAM this bookkeeping takes.
  int64_t records() const { return static_cast<int64_t>(ext_.size()) * kExtent; }
  int64_t live() const { return live_; }
  int64_t free_records() const { return static_cast<int64_t>(free_.size()) * kExtent; }
  int64_t reserve_records() const { return reserved_ * kExtent; }
  int64_t grown_by_rewrites() const { return grown_by_rewrites_ * kExtent; }
  int64_t bytes() const {
    int64_t b = static_cast<int64_t>(ext_.capacity()) * sizeof(Extent) +
                static_cast<int64_t>(free_.capacity() + held_.capacity()) * sizeof(uint32_t);
    for (const auto& v : by_live_) b += static_cast<int64_t>(v.capacity()) * sizeof(uint32_t);
    for (const Extent& e : ext_) b += e.rows ? kExtent * sizeof(uint32_t) : 0;
    return b;
  }

  // Starts over with records [0, n) live, record i holding row_of(i) (the
  // file was rewritten in that order: a widening). The reserve starts over
  // too (the new file has none).
  template <typename RowOf>
  void Rebuild(uint32_t n, const RowOf& row_of) {
    ext_.clear();
    free_.clear();
    held_.clear();
    for (auto& v : by_live_) v.clear();
    for (uint32_t& o : open_) o = kNone;
    live_ = 0;
    reserved_ = 0;
    grown_by_rewrites_ = 0;
    std::vector<uint32_t> rows(kExtent);
    for (uint32_t lo = 0; lo < n;) {
      const uint32_t m = std::min(kExtent, n - lo);
      for (uint32_t i = 0; i < m; ++i) rows[i] = row_of(lo + i);
      uint32_t first;
      const uint32_t got = AllocRun(kNew, rows.data(), m, &first);
      lo += got;
    }
  }

 private:
  enum State : uint8_t { kFree = 0, kOpen, kClosed, kCleaning, kPending };
  struct Extent {
    uint16_t used = 0, live = 0;
    State state = kFree;
    uint32_t pos = kNone;  // its index in by_live_[live] while closed
    std::unique_ptr<uint32_t[]> rows;
  };

  int64_t ReserveTarget() const { return (live_ >> kReserveShift) >> kExtentShift; }

  void OpenNext(Stream s) {
    if (open_[s] != kNone) Close(open_[s]);
    open_[s] = kNone;
    const bool can_grow = ext_.size() < max_extents_;
    // First writes leave the reserve to rewrites while the file can grow.
    const bool take_free = !free_.empty() && (s != kNew || !can_grow ||
                                              static_cast<int64_t>(free_.size()) > ReserveTarget());
    uint32_t x;
    if (take_free) {
      x = free_.back();
      free_.pop_back();
    } else {
      if (!can_grow)
        throw std::length_error("tiered storage: the tier file is full (" +
                                std::to_string(uint64_t{max_extents_} << kExtentShift) + " records)");
      ext_.emplace_back();
      ext_.back().rows.reset(new uint32_t[kExtent]);
      x = static_cast<uint32_t>(ext_.size() - 1);
      if (s != kNew) ++grown_by_rewrites_;
    }
    ext_[x].state = kOpen;
    open_[s] = x;
  }
  // A full (or replaced) open extent becomes a compaction candidate, or free.
  void Close(uint32_t x) {
    Extent& e = ext_[x];
    if (e.live == 0) {
      Release(x);
      return;
    }
    e.state = kClosed;
    Bucket(x);
  }
  void Release(uint32_t x) {
    ext_[x].used = 0;
    ext_[x].state = kFree;
    (holds_ > 0 ? held_ : free_).push_back(x);
  }
  void Bucket(uint32_t x) {
    std::vector<uint32_t>& b = by_live_[ext_[x].live];
    ext_[x].pos = static_cast<uint32_t>(b.size());
    b.push_back(x);
  }
  void Unbucket(uint32_t x) {
    std::vector<uint32_t>& b = by_live_[ext_[x].live];
    const uint32_t last = b.back();
    b[ext_[x].pos] = last;
    ext_[last].pos = ext_[x].pos;
    b.pop_back();
    ext_[x].pos = kNone;
  }

  uint32_t max_extents_;
  std::vector<Extent> ext_;
  std::vector<uint32_t> free_;  // extents with nothing live, reused first
  std::vector<uint32_t> held_;  // extents freed while held: free at the last Unhold
  std::vector<uint32_t> by_live_[kExtent + 1];  // closed extents by live count (index 0 unused)
  int holds_ = 0;
  uint32_t open_[kStreams] = {kNone, kNone, kNone};  // the extent each stream writes to
  int64_t live_ = 0;
  int64_t reserved_ = 0;           // extents appended to the reserve since the last Rebuild
  int64_t grown_by_rewrites_ = 0;  // extents the file grew by for kHot or kCold (none was free)
};

}  // namespace evstore
