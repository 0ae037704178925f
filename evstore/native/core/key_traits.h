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
//   kKeyOutOfLine, PrefetchKey(Stored)   whether Equal reads memory outside
//                        the entry, and a prefetch of it (batched probes
//                        issue it a few keys ahead; a no-op for integers).
//   HeapBytes(Stored)    bytes the stored key holds outside the entry (0 for
//                        integers; a string key's allocation), counted in
//                        the index bytes the stats report.
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
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "hash.h"
#include "schema.h"
#include "string_hash.h"

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
  static size_t HeapBytes(const Stored&) { return 0; }
  static constexpr bool kKeyOutOfLine = false;  // the key is in the entry: nothing more to prefetch
  static void PrefetchKey(const Stored&) {}

  static constexpr const char* kCheckpointDtype = sizeof(K) == 8 ? "int64" : "int32";
};

// Byte-string keys (tf.string): any bytes, the empty string and non-UTF-8
// included, at most kMaxKeyBytes long (CheckLength: callers check a batch
// before anything changes, so an over-long key fails the whole op cleanly).
//   Key     std::string_view into the caller's batch (or an Owned string).
//   Stored  one pointer (the entry stays 16 bytes, like an int64 entry) to a
//           heap block [uint16 length | bytes], allocated by Store and freed
//           by Release; equality compares lengths, then bytes.
//   Owned   std::string (dirty lists, deleted sets, snapshots).
//   Hash    FarmHash Fingerprint64 (string_hash.h): tf.fingerprint's value.
struct StringKeyTraits {
  using Key = std::string_view;
  struct Stored {
    uint8_t* p;  // [uint16 little-endian length][bytes]
  };
  using Owned = std::string;
  using OwnedHash = std::hash<std::string>;

  static constexpr size_t kMaxKeyBytes = schema::kMaxStringKeyBytes;
  static_assert(kMaxKeyBytes <= 0xFFFF, "the stored length is 16 bits");
  // Throws std::invalid_argument naming the key's position when a key is
  // longer than kMaxKeyBytes.
  static void CheckLength(const Key* keys, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      if (keys[i].size() > kMaxKeyBytes)
        throw std::invalid_argument("string key " + std::to_string(i) + " is " + std::to_string(keys[i].size()) +
                                    " bytes; string keys are at most " + std::to_string(kMaxKeyBytes) + " bytes");
  }

  static uint64_t Hash(Key k) { return StringFingerprint64(k); }
  static uint64_t BankHash(Key k) { return Mix64(StringFingerprint64(k) ^ 0x9e3779b97f4a7c15ULL); }
  static bool Equal(const Stored& s, Key k) {
    return Length(s) == k.size() && std::memcmp(s.p + 2, k.data(), k.size()) == 0;
  }
  static Stored Store(Key k) {
    if (k.size() > kMaxKeyBytes) throw std::invalid_argument("string key longer than kMaxKeyBytes");
    uint8_t* p = static_cast<uint8_t*>(std::malloc(2 + k.size()));
    if (!p) throw std::bad_alloc();
    p[0] = static_cast<uint8_t>(k.size() & 0xFF);
    p[1] = static_cast<uint8_t>(k.size() >> 8);
    if (!k.empty()) std::memcpy(p + 2, k.data(), k.size());
    return Stored{p};
  }
  static Key Load(const Stored& s) { return Key(reinterpret_cast<const char*>(s.p + 2), Length(s)); }
  static Owned Own(Key k) { return Owned(k); }
  static Key View(const Owned& o) { return Key(o); }
  static void Release(Stored& s) {
    std::free(s.p);
    s.p = nullptr;
  }
  static size_t HeapBytes(const Stored& s) { return 2 + Length(s); }
  static constexpr bool kKeyOutOfLine = true;  // probes prefetch the key block (index.h: PrefetchAhead)
  static void PrefetchKey(const Stored& s) { __builtin_prefetch(s.p); }

  static constexpr const char* kCheckpointDtype = "string";

 private:
  static size_t Length(const Stored& s) { return static_cast<size_t>(s.p[0]) | (static_cast<size_t>(s.p[1]) << 8); }
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
template <>
struct DefaultKeyTraits<std::string_view> {
  using type = StringKeyTraits;
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
static_assert(IsKeyTraits<StringKeyTraits>(), "string key traits");
static_assert(sizeof(StringKeyTraits::Stored) == 8, "a string entry holds one pointer (16-byte entries)");

}  // namespace evstore
