// Row store: where admitted keys' rows live, as the table sees it.
//
// The table (table.h) never touches row memory except through a row store
// `S`, a template parameter (Table<K, Traits, S>; default RowArena, arena.h,
// the in-memory arena; TieredStore, tiered_store.h, a DRAM cache over a disk
// tier). Every store implements this contract:
//
//   Row ids      uint32 < kMaxRowIds (2^31). Ids at and above 2^31 are not
//                rows: index entries use them for "not admitted" marks
//                (kNoRowId, filtered keys' last-seen steps: evict_policy.h).
//   Row layout   `stride()` floats: [embedding (dim) | slot 0 (dim) | ...]
//                plus one int64 version beside it (evict_policy.h).
//
//   uint32_t Allocate();                       fresh or recycled id, contents
//   void AllocateMany(size_t n, uint32_t* out);  unspecified; throws
//                                              std::length_error when full
//   void Free(uint32_t r);                     id back to the store
//   float* Row(uint32_t r) const;              the row, resident and writable
//   const float* ReadRow(uint32_t r) const;    the same, for reading only (a
//                                              tier need not write it back)
//   void FaultMany(const uint32_t* rows, size_t n) const;  makes rows of one
//                                              segment resident together (a
//                                              tier reads its misses at once;
//                                              a no-op when all are resident)
//   void PeekMany(const uint32_t* rows, size_t n, float* out) const;  rows of
//                                              one segment copied out (stride
//                                              floats each), not cached
//   const float* PeekRow(uint32_t r, float* scratch) const;  the row to read
//                                              now, maybe copied to scratch
//                                              (stride floats) and not cached
//   static constexpr bool kAllResident;        every row always in DRAM
//   int64_t& Version(uint32_t r) const;        its version slot
//   static void PrefetchRow(const float*, int floats);  a hint, may be a no-op
//   int stride() const;
//   int64_t free_rows() const, bytes() const, version_bytes() const;
//   void Bind(uint32_t r, int segment);        r now belongs to a key of that
//                                              segment (before its first Row)
//   void Hint(uint32_t r, uint32_t freq) const;  the key's lookup count (a
//                                              cache hint; may be a no-op)
//   bool RowIsZero(uint32_t r, int dim) const; first dim floats all zero
//                                              (a tier answers without I/O)
//   void AttachLocks(SegmentLocks);            how to reach segment locks
//   TierStats tier_stats() const;              cache figures (zeros: no tier)
//   std::unique_ptr<Widened> PrepareWiden(int new_stride) const;
//                                              (Widened::WaitPrepared(): waits
//                                              for what it prepares before the
//                                              table takes its locks)
//   void Relayout(int new_stride, const std::vector<float>& tail, Widened*);
//                                              widen every row (new slots)
//
// Invariants the table relies on (a tier must keep them):
//  * Row(r) and Version(r) are called only by a caller holding the segment
//    lock of the key that owns r; the pointer stays valid, and the row
//    resident, until that lock is released (a tier pins or faults the row in
//    under the lock, and may write it back or evict it only when no segment
//    lock covers it: e.g. at Free, or from a background pass that takes the
//    owning segment's lock).
//  * Rows never move while any segment lock is held, except in Relayout(),
//    which the table calls with every segment lock held.
//  * Allocate/AllocateMany/Free are thread-safe on their own (callers hold
//    different segment locks at once).
//  * A thread touching rows (Row, ReadRow, Version, Free) holds exactly one
//    segment lock, the owner's (Relayout excepted), so a tier may try-lock
//    any other segment to evict its rows.
//  * Rows are built by MakeRowStore(stride, TierConfig): a store that takes
//    a TierConfig gets it, the others only the stride.
// A store with kAllResident false also has the batch calls the table makes
// only under `if constexpr (!Store::kAllResident)` (tiered_store.h):
// PeekRows (a read-only lookup's rows, not cached), AccessMany (a training
// kernel's rows of one segment, faulted and accessed together) and
// PrefetchMeta.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace evstore {

inline constexpr uint32_t kNoRowId = 0xFFFFFFFFu;   // an entry without a row
inline constexpr uint32_t kMaxRowIds = 0x80000000u;  // row ids are < 2^31
static_assert(kNoRowId >= kMaxRowIds, "the no-row mark is not a row id");

// A row's width, defined once: RowFloats(dim, slots) floats (the Row layout
// above: the table's stride, table.h), and its tier record RecordBytes(floats)
// bytes (tiered_store.h, row_file.h: one record per row, the row's floats as
// they are in DRAM). A serving table's row is ServingRows::PackedFloats
// (serving_rows.h) floats instead. Python asks these (EvTierRecordBytes,
// evstore/storage.py record_bytes) for what a load writes to a tier.
constexpr int RowFloats(int dim, int slots) { return dim * (1 + slots); }
constexpr int64_t RecordBytes(int floats) { return static_cast<int64_t>(floats) * static_cast<int64_t>(sizeof(float)); }
static_assert(RecordBytes(RowFloats(8, 2)) == 96, "an Adam row of dim 8 (embedding, m, v) is a 96-byte record");

// Where a tiered store keeps rows (tiered_store.h); unused by RowArena.
struct TierConfig {
  int64_t dram_bytes = 0;  // cache budget for rows (embedding + slots)
  std::string path;        // parent of the store's private directory
  // Reads through a mapping of the tier file (row_file.h); false: one preadv
  // per run of records, where a disk read error must be an exception.
  bool mapped_reads = true;
  // Records the tier file may span (0: the format's limit, 2^32). A write-back
  // that finds the file full is refused as on a full disk: its rows stay in
  // DRAM and the failure is reported (TierStats::write_failures).
  int64_t max_disk_records = 0;
};
// A tier's cache figures (all zero for an all-DRAM store).
struct TierStats {
  int64_t hits = 0, misses = 0;  // row accesses served from DRAM / faulted in
  int64_t writebacks = 0;        // rows written to disk on eviction
  int64_t write_batches = 0;     // eviction batches written (each runs of adjacent records)
  int64_t compacted = 0;         // cold records moved by compaction
  int64_t read_calls = 0;        // reads of misses (one per run of adjacent records)
  int64_t write_failures = 0;    // write-backs the disk refused (row kept in DRAM)
  int64_t resident = 0;          // rows in DRAM now
  int64_t budget_rows = 0;       // rows the DRAM budget holds
  int64_t disk_bytes = 0;        // bytes the tier's file occupies on disk
  int64_t disk_records = 0;      // records the file spans (live + dead + unused)
  int64_t live_records = 0;      // records holding a row's current copy
  int64_t free_records = 0;      // records of free extents (reused before the file grows)
  int64_t reserve_records = 0;   // records appended free for rewrites (log_space.h: the reserve)
  int64_t grown_by_rewrites = 0; // records the file grew by for rewrites and moves (no free extent left)
};
// Segment s's lock, for a store that evicts rows of other segments.
using SegmentLocks = std::function<std::shared_mutex&(int)>;

// Builds a store: with the tier config if the store takes one.
template <typename S>
S MakeRowStore(int stride, const TierConfig& tier) {
  if constexpr (std::is_constructible<S, int, const TierConfig&>::value) {
    return S(stride, tier);
  } else {
    (void)tier;
    return S(stride);
  }
}

// Compile-time check of the contract above (the signatures the table calls).
template <typename S>
constexpr bool IsRowStore() {
  using W = typename S::Widened;
  return std::is_same<decltype(std::declval<const S&>().Row(uint32_t{})), float*>::value &&
         std::is_same<decltype(std::declval<const S&>().ReadRow(uint32_t{})), const float*>::value &&
         std::is_same<decltype(std::declval<const S&>().FaultMany(std::declval<const uint32_t*>(), size_t{})),
                      void>::value &&
         std::is_same<decltype(std::declval<const S&>().PeekMany(std::declval<const uint32_t*>(), size_t{},
                                                                 std::declval<float*>())),
                      void>::value &&
         std::is_same<decltype(std::declval<const S&>().PeekRow(uint32_t{}, std::declval<float*>())),
                      const float*>::value &&
         std::is_same<decltype(S::kAllResident), const bool>::value &&
         std::is_same<decltype(std::declval<const S&>().Version(uint32_t{})), int64_t&>::value &&
         std::is_same<decltype(std::declval<S&>().Bind(uint32_t{}, int{})), void>::value &&
         std::is_same<decltype(std::declval<const S&>().Hint(uint32_t{}, uint32_t{})), void>::value &&
         std::is_same<decltype(std::declval<const S&>().RowIsZero(uint32_t{}, int{})), bool>::value &&
         std::is_same<decltype(std::declval<S&>().AttachLocks(std::declval<SegmentLocks>())), void>::value &&
         std::is_same<decltype(std::declval<const S&>().tier_stats()), TierStats>::value &&
         std::is_same<decltype(std::declval<S&>().Allocate()), uint32_t>::value &&
         std::is_same<decltype(std::declval<S&>().AllocateMany(size_t{}, std::declval<uint32_t*>())), void>::value &&
         std::is_same<decltype(std::declval<S&>().Free(uint32_t{})), void>::value &&
         std::is_same<decltype(S::PrefetchRow(std::declval<const float*>(), int{})), void>::value &&
         std::is_same<decltype(std::declval<const S&>().free_rows()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().bytes()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().version_bytes()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().PrepareWiden(int{})), std::unique_ptr<W>>::value &&
         std::is_same<decltype(std::declval<W&>().WaitPrepared()), uint32_t>::value &&
         std::is_same<decltype(std::declval<S&>().Relayout(int{}, std::declval<const std::vector<float>&>(),
                                                           std::declval<W*>())),
                      void>::value &&
         std::is_constructible<S, int>::value;
}

}  // namespace evstore
