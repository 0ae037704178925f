// Key traits: everything the core knows about a key type, in one class.
//
// The index (segment.h, index.h), the table (table.h) and the export path are
// templated on a traits class, not on the raw key type. A new key type (a
// string id, a (field, id) pair) is a new traits class plus the kernels'
// tensor conversion; nothing in the index or the table changes.
//
// A traits class `T` provides:
//   T::Key        what callers pass in a batch (`const Key* keys`) and get back
//                 in exports; cheap to copy (an integer, a string_view).
//   T::Stored     what an index entry holds (segment.h: Entry<Stored>).
//                 Trivially copyable: the index moves entries with memcpy-like
//                 assignment when it rehashes.
//   T::Owned      a value that owns the key beyond the entry's life: dirty
//                 lists, deleted sets and export snapshots hold Owned keys.
//   Hash(Key)      64-bit hash with full avalanche; its bits are split between
//                  segment (top), home group (7..38) and H2 tag (low 7):
//                  see hash.h. Must equal Hash(Load(Store(k))).
//   BankHash(Key)  an independent hash picking the initializer-bank row.
//   Equal(Stored, Key)   key equality as seen by a probe.
//   Store(Key) -> Stored, Load(Stored) -> Key, Own(Key) -> Owned,
//   View(Owned) -> Key   conversions; Release(Stored&) frees what Store took
//                        (called when an entry is erased or the index cleared).
//   OwnedHash      a std::hash-like functor over Owned (deleted sets).
//   kCheckpointDtype     the dtype name a checkpoint writes keys as (the
//                        export writes Key values of that dtype, one per key).
//
// Empty / deleted markers: the index keeps a slot's state in its control byte
// (kEmpty, kDeleted, or the H2 tag of a full slot: segment.h), never in the key.
// So no key value is reserved: every int64 (0, -1, INT64_MIN) is a valid key,
// and a traits class need define no sentinel. Stored bytes of an empty or
// deleted slot are garbage and are never read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>

#include "hash.h"

namespace evstore {

// Signed integer keys (int32, int64): stored, owned and written as themselves.
template <typename K>
struct IntegerKeyTraits {
  static_assert(std::is_integral<K>::value && std::is_signed<K>::value, "integer key traits need a signed integer");
  using Key = K;
  using Stored = K;
  using Owned = K;
  using OwnedHash = std::hash<K>;

  // int32 keys hash as their int64 value, so a key routes and hashes alike in
  // an int32 and an int64 table (checkpoints move between the two).
  static uint64_t Hash(Key k) { return Mix64(static_cast<uint64_t>(static_cast<int64_t>(k))); }
  static uint64_t BankHash(Key k) {
    return Mix64(static_cast<uint64_t>(static_cast<int64_t>(k)) ^ 0x9e3779b97f4a7c15ULL);
  }
  static bool Equal(const Stored& s, Key k) { return s == k; }
  static Stored Store(Key k) { return k; }
  static Key Load(const Stored& s) { return s; }
  static Owned Own(Key k) { return k; }
  static Key View(const Owned& o) { return o; }
  static void Release(Stored&) {}

  static constexpr const char* kCheckpointDtype = sizeof(K) == 8 ? "int64" : "int32";
};

// The traits a plain `Table<K>` uses.
template <typename K>
struct DefaultKeyTraits;
template <>
struct DefaultKeyTraits<int64_t> {
  using type = IntegerKeyTraits<int64_t>;
};
template <>
struct DefaultKeyTraits<int32_t> {
  using type = IntegerKeyTraits<int32_t>;
};
template <typename K>
using KeyTraits = typename DefaultKeyTraits<K>::type;

// What the index requires of a traits class (checked where it is used).
template <typename T>
constexpr bool IsKeyTraits() {
  return std::is_trivially_copyable<typename T::Stored>::value &&
         std::is_same<decltype(T::Hash(std::declval<typename T::Key>())), uint64_t>::value &&
         std::is_same<decltype(T::BankHash(std::declval<typename T::Key>())), uint64_t>::value &&
         std::is_same<decltype(T::Equal(std::declval<const typename T::Stored&>(),
                                        std::declval<typename T::Key>())),
                      bool>::value;
}
static_assert(IsKeyTraits<IntegerKeyTraits<int64_t>>(), "int64 key traits");
static_assert(IsKeyTraits<IntegerKeyTraits<int32_t>>(), "int32 key traits");

}  // namespace evstore
