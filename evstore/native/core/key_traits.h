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
//   OwnStored(Stored) -> Owned   an Owned of an entry's key that may share the
//                        entry's storage (the dirty list takes one per first
//                        touch after a seal: it must not copy key bytes).
//   OwnedHash      a std::hash-like functor over Owned (deleted sets).
//   kKeyOutOfLine, PrefetchKey(Stored), PrefetchQuery(Key)   whether Equal
//                        reads memory outside the entry, and prefetches of
//                        the stored and the queried key bytes (batched probes
//                        issue them a few keys ahead; no-ops for integers).
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

#include "group_probe.h"
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
  static Owned OwnStored(const Stored& s) { return s; }
  static Key View(const Owned& o) { return o; }
  static void Release(Stored&) {}
  static size_t HeapBytes(const Stored&) { return 0; }
  static constexpr bool kKeyOutOfLine = false;  // the key is in the entry: nothing more to prefetch
  static void PrefetchKey(const Stored&) {}
  static void PrefetchQuery(Key) {}

  static constexpr const char* kCheckpointDtype = sizeof(K) == 8 ? "int64" : "int32";
};

// A string key's heap block, shared by the index entry and any Owned copies
// (dirty lists, deleted sets, snapshots):
//   [uint16 length, little-endian][uint16 references][length bytes]
// The reference count is atomic (a snapshot is read and dropped outside the
// segment locks). It saturates at kPinned: a block referenced 65,535 times at
// once (never seen: an entry, its open dirty list and a snapshot or two) is
// never freed rather than freed early.
namespace string_block {
constexpr size_t kHeader = 4;
constexpr uint16_t kPinned = 0xFFFF;
inline size_t Length(const uint8_t* p) { return static_cast<size_t>(p[0]) | (static_cast<size_t>(p[1]) << 8); }
inline uint16_t* Refs(uint8_t* p) { return reinterpret_cast<uint16_t*>(p + 2); }
inline uint8_t* New(std::string_view k) {
  uint8_t* p = static_cast<uint8_t*>(std::malloc(kHeader + k.size()));
  if (!p) throw std::bad_alloc();
  p[0] = static_cast<uint8_t>(k.size() & 0xFF);
  p[1] = static_cast<uint8_t>(k.size() >> 8);
  *Refs(p) = 1;
  if (!k.empty()) std::memcpy(p + kHeader, k.data(), k.size());
  return p;
}
inline void Ref(uint8_t* p) {
  uint16_t v = __atomic_load_n(Refs(p), __ATOMIC_RELAXED);
  while (v != kPinned && !__atomic_compare_exchange_n(Refs(p), &v, static_cast<uint16_t>(v + 1), true,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}
inline void Unref(uint8_t* p) {
  if (!p) return;
  uint16_t v = __atomic_load_n(Refs(p), __ATOMIC_RELAXED);
  while (v != kPinned && !__atomic_compare_exchange_n(Refs(p), &v, static_cast<uint16_t>(v - 1), true,
                                                      __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
  }
  if (v == 1) std::free(p);
}
inline std::string_view View(const uint8_t* p) {
  return p ? std::string_view(reinterpret_cast<const char*>(p + kHeader), Length(p)) : std::string_view();
}
}  // namespace string_block

// Equality of n bytes at a and b, inline for the short keys that are the
// common case (word loads, the last one overlapping; no library call, no
// masked vector load), memcmp past 32 bytes. Reads only [a, a+n) and [b, b+n).
inline bool BytesEqual(const char* a, const char* b, size_t n) {
  auto w8 = [](const char* p) { uint64_t v; std::memcpy(&v, p, 8); return v; };
  auto w4 = [](const char* p) { uint32_t v; std::memcpy(&v, p, 4); return v; };
  if (n > 32) return std::memcmp(a, b, n) == 0;
  if (n >= 8) {
    for (size_t i = 0; i + 8 < n; i += 8)
      if (w8(a + i) != w8(b + i)) return false;
    return w8(a + n - 8) == w8(b + n - 8);
  }
  if (n >= 4) return w4(a) == w4(b) && w4(a + n - 4) == w4(b + n - 4);
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// An owned string key: a counted reference to a key block. Copying shares the
// block; an Owned made from a view allocates its own. Compares and hashes by
// the key's bytes, converts to std::string_view.
class StringKeyRef {
 public:
  StringKeyRef() = default;
  explicit StringKeyRef(std::string_view k) : p_(string_block::New(k)) {}
  static StringKeyRef Share(uint8_t* p) {
    string_block::Ref(p);
    return StringKeyRef(p);
  }
  StringKeyRef(const StringKeyRef& o) : p_(o.p_) {
    if (p_) string_block::Ref(p_);
  }
  StringKeyRef(StringKeyRef&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  StringKeyRef& operator=(StringKeyRef o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~StringKeyRef() { string_block::Unref(p_); }
  std::string_view view() const { return string_block::View(p_); }
  operator std::string_view() const { return view(); }
  bool operator==(const StringKeyRef& o) const { return view() == o.view(); }

 private:
  explicit StringKeyRef(uint8_t* p) : p_(p) {}
  uint8_t* p_ = nullptr;
};
static_assert(sizeof(StringKeyRef) == sizeof(void*), "an owned string key is one pointer in dirty lists");

// Byte-string keys (tf.string): any bytes, the empty string and non-UTF-8
// included, at most kMaxKeyBytes long (CheckLength: callers check a batch
// before anything changes, so an over-long key fails the whole op cleanly).
//   Key     std::string_view into the caller's batch (or an Owned key).
//   Stored  one pointer (the entry stays 16 bytes, like an int64 entry) to a
//           string_block (above), allocated by Store and released by Release;
//           equality compares lengths, then bytes.
//   Owned   StringKeyRef: the dirty list shares the entry's block (OwnStored,
//           one reference count increment, no allocation: a training lookup
//           touches each key once per checkpoint interval); deleted sets and
//           snapshots hold references too.
//   Hash    FarmHash Fingerprint64 (string_hash.h): tf.fingerprint's value.
struct StringKeyTraits {
  using Key = std::string_view;
  struct Stored {
    uint8_t* p;  // a string_block
  };
  using Owned = StringKeyRef;
  struct OwnedHash {
    size_t operator()(const StringKeyRef& k) const { return std::hash<std::string_view>()(k.view()); }
  };

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
    return Length(s) == k.size() &&
           BytesEqual(reinterpret_cast<const char*>(s.p + string_block::kHeader), k.data(), k.size());
  }
  static Stored Store(Key k) {
    if (k.size() > kMaxKeyBytes) throw std::invalid_argument("string key longer than kMaxKeyBytes");
    return Stored{string_block::New(k)};
  }
  static Key Load(const Stored& s) { return string_block::View(s.p); }
  static Owned Own(Key k) { return Owned(k); }
  static Owned OwnStored(const Stored& s) { return StringKeyRef::Share(s.p); }
  static Key View(const Owned& o) { return o.view(); }
  static void Release(Stored& s) {
    string_block::Unref(s.p);
    s.p = nullptr;
  }
  static size_t HeapBytes(const Stored& s) { return string_block::kHeader + Length(s); }
  static constexpr bool kKeyOutOfLine = true;  // probes prefetch the key block (index.h: PrefetchAhead)
  // PrefetchT0 (group_probe.h), not __builtin_prefetch: the pointer is read
  // from the entry an SSE tag match picked, and GCC deletes such a builtin.
  // Both ends of the bytes Equal reads: a block of a key up to 32 bytes may
  // straddle two cache lines (a second prefetch of the same line is free).
  static void PrefetchKey(const Stored& s) {
    PrefetchT0(s.p);
    PrefetchT0(s.p + 32);
  }
  static void PrefetchQuery(Key k) {   // the caller's bytes Equal compares
    PrefetchT0(k.data());
    if (k.size() > 1) PrefetchT0(k.data() + k.size() - 1);
  }

  static constexpr const char* kCheckpointDtype = "string";

 private:
  static size_t Length(const Stored& s) { return string_block::Length(s.p); }
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
