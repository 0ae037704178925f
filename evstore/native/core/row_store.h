// Row store: where admitted keys' rows live, as the table sees it.
//
// The table (table.h) never touches row memory except through a row store
// `S`, a template parameter (Table<K, Traits, S>; default RowArena, arena.h,
// the in-memory arena). A DRAM+SSD tier is another class with this contract:
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
//   int64_t& Version(uint32_t r) const;        its version slot
//   static void PrefetchRow(const float*, int floats);  a hint, may be a no-op
//   int stride() const;
//   int64_t free_rows() const, bytes() const, version_bytes() const;
//   std::unique_ptr<Widened> PrepareWiden(int new_stride) const;
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
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace evstore {

inline constexpr uint32_t kNoRowId = 0xFFFFFFFFu;   // an entry without a row
inline constexpr uint32_t kMaxRowIds = 0x80000000u;  // row ids are < 2^31
static_assert(kNoRowId >= kMaxRowIds, "the no-row mark is not a row id");

// Compile-time check of the contract above (the signatures the table calls).
template <typename S>
constexpr bool IsRowStore() {
  using W = typename S::Widened;
  return std::is_same<decltype(std::declval<const S&>().Row(uint32_t{})), float*>::value &&
         std::is_same<decltype(std::declval<const S&>().Version(uint32_t{})), int64_t&>::value &&
         std::is_same<decltype(std::declval<S&>().Allocate()), uint32_t>::value &&
         std::is_same<decltype(std::declval<S&>().AllocateMany(size_t{}, std::declval<uint32_t*>())), void>::value &&
         std::is_same<decltype(std::declval<S&>().Free(uint32_t{})), void>::value &&
         std::is_same<decltype(S::PrefetchRow(std::declval<const float*>(), int{})), void>::value &&
         std::is_same<decltype(std::declval<const S&>().free_rows()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().bytes()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().version_bytes()), int64_t>::value &&
         std::is_same<decltype(std::declval<const S&>().PrepareWiden(int{})), std::unique_ptr<W>>::value &&
         std::is_same<decltype(std::declval<S&>().Relayout(int{}, std::declval<const std::vector<float>&>(),
                                                           std::declval<W*>())),
                      void>::value &&
         std::is_constructible<S, int>::value;
}

}  // namespace evstore
