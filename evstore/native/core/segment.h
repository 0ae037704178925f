// Segment: one independently locked, independently growing piece of the index.
//
// Layout (Swiss-table style, open addressing in groups of 16):
//   ctrl[capacity]   one byte per slot: kEmpty (0x80), kDeleted (0xFE), or the
//                    low 7 bits of the key's hash (H2) when the slot is full
//                    (group_probe.h: the 16-wide compare and its portable twin).
//   slots[capacity]  Entry {key, row, freq|dirty}: 16 bytes for int64 keys
//                    (static_assert below).
// capacity = 16 * ngroups. A key's probe starts at its home group (chosen by
// hash bits 7..38, fast range reduction, so ngroups needs not be a power of
// two) and walks groups linearly.
//
// The key type is a traits parameter (key_traits.h): hashing, equality, how
// the entry stores the key. Slot state lives in the control byte, so no key
// value is reserved as a marker.
//
// Per-key metadata lives in the entry: `row` (a row id < 2^31, or, for a key
// counted but not admitted, which costs index space only, kNoRow or its
// last-seen step: evict_policy.h), `freq` (31-bit saturating
// lookup count) and the `dirty` bit (changed since the last sealed export).
// The version lives beside the row in the row store (only admitted keys have one).
//
// Invariants:
//  * Every access holds `mu`: shared for read-only finds, exclusive otherwise.
//  * A probe stops at the first group holding an empty slot, so erasing a slot
//    in a group that still has an empty slot may mark it empty; otherwise it
//    becomes a tombstone, cleared by the next rehash.
//  * Load (full + tombstones) stays <= 7/8 of capacity. Growth picks the
//    capacity that brings the load back to 7/12 (kGrowNum / kGrowDen: growth
//    factor 1.5), so index bytes per key stay between 17/0.875 and 17/0.583
//    (19.4-29.1). A segment grown from empty has moved 2-3 entries per key
//    (3x its size at its last growth) and allocated about 3x its final
//    arrays; with the factor 1.25 used before, 4-5 entries per key and 5x,
//    about a third of the CPU of inserting new keys (BENCHMARKS.md). A
//    training lookup that knows how many of a batch's keys are absent grows
//    once for all of them before inserting them (GrowFor), to the same 7/12
//    once they are in; a bulk import sizes segments at load 0.7 instead
//    (Reserve). Growth rehashes this segment only; rows never move.
//  * `dirty` holds every key whose entry has the dirty bit set (plus, possibly,
//    keys erased since); `deleted` holds every key erased since the last
//    sealed export, re-inserted since or not (a re-inserted key is also
//    dirty: a reader erases a delta's deleted keys before it applies its rows).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <shared_mutex>
#include <unordered_set>
#include <vector>

#include "group_probe.h"
#include "key_traits.h"
#include "row_store.h"

namespace evstore {

template <typename S>
struct Entry {
  S key;  // the traits' Stored key
  uint32_t row;
  uint32_t freq_dirty;  // bit 31: dirty, bits 0..30: frequency (saturating)

  static constexpr uint32_t kDirtyBit = 0x80000000u;
  static constexpr uint32_t kFreqMask = 0x7FFFFFFFu;
  uint32_t freq() const { return freq_dirty & kFreqMask; }
  bool dirty() const { return (freq_dirty & kDirtyBit) != 0; }
  void add_freq(uint32_t n) {
    uint32_t f = freq();
    uint32_t nf = (kFreqMask - f < n) ? kFreqMask : f + n;
    freq_dirty = (freq_dirty & kDirtyBit) | nf;
  }
  void set_freq(uint64_t f) {
    freq_dirty = (freq_dirty & kDirtyBit) | static_cast<uint32_t>(f > kFreqMask ? kFreqMask : f);
  }
};

static_assert(sizeof(Entry<int64_t>) == 16, "an int64 entry is 16 bytes (17 with its control byte)");
static_assert(sizeof(Entry<int32_t>) == 12, "an int32 entry is 12 bytes");

template <typename Traits>
class Segment {
 public:
  static_assert(IsKeyTraits<Traits>(), "Segment needs a key traits class (key_traits.h)");
  using Key = typename Traits::Key;
  using Owned = typename Traits::Owned;
  using E = Entry<typename Traits::Stored>;
  static constexpr uint8_t kEmpty = kCtrlEmpty;
  static constexpr uint8_t kDeleted = kCtrlDeleted;
  static constexpr int kGroup = kGroupWidth;
  // Growth: capacity becomes size * kGrowNum / kGrowDen (load 7/12 = 0.583).
  static constexpr size_t kGrowNum = 12, kGrowDen = 7;
  static_assert(kGrowNum * 7 >= kGrowDen * 8 * 3 / 2, "growth from load 7/8 is at least 1.5x");

  Segment() { Reset(1); }
  ~Segment() {
    if (slots_) ForEach([](E& e) { Traits::Release(e.key); });
    FreeArrays();
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  mutable std::shared_mutex mu;
  // Keys whose dirty bit was set in the open generation. May hold keys that
  // were erased since (filtered out when the export is sealed).
  std::vector<Owned> dirty;
  // Keys erased (evicted / removed) since the last sealed export.
  std::unordered_set<Owned, typename Traits::OwnedHash> deleted;

  size_t size() const { return size_; }
  // Bumped by every rehash: entry pointers taken at an older count are stale.
  uint64_t rehashes() const { return rehashes_; }
  size_t admitted() const { return admitted_; }
  void adjust_admitted(int64_t d) { admitted_ += d; }
  size_t capacity() const { return ngroups_ * kGroup; }
  size_t bytes() const {
    return capacity() * (1 + sizeof(E)) + key_heap_bytes_ + dirty.capacity() * sizeof(Owned) +
           deleted.size() * (sizeof(Owned) + 2 * sizeof(void*)) + deleted.bucket_count() * sizeof(void*);
  }

  // Batch probes pipeline two prefetches per key: first the home group's
  // control bytes (PrefetchCtrl, far ahead), then, once those are cached, the
  // one entry whose H2 matches (PrefetchSlot, nearer). A group's 16 entries
  // span four cache lines, so prefetching "the group" would miss 3 times in 4.
  void PrefetchCtrl(uint64_t h) const { __builtin_prefetch(ctrl_ + HomeGroup(h) * kGroup); }
  // With no tag match (a new key, most likely), the entry of the home
  // group's first free slot: where Place() puts the key.
  void PrefetchSlot(uint64_t h) const {
    const size_t g = HomeGroup(h);
    const GroupProbe c(ctrl_ + g * kGroup);
    uint32_t m = c.Match(static_cast<uint8_t>(h & 0x7F));
    if (!m) m = c.MatchEmptyOrDeleted();
    PrefetchT0(slots_ + g * kGroup + (m ? __builtin_ctz(m) : 0));
  }
  // Third stage, for keys stored outside the entry (strings): once the entry
  // is cached, the key bytes it points to (Equal reads them). A no-op for
  // inline keys. Only a full slot can match an H2 tag, so the pointer read is
  // a live key's.
  void PrefetchKey(uint64_t h) const {
    const E* e = HomeCandidate(h);
    if (e) Traits::PrefetchKey(e->key);
  }
  // The first entry of h's home group whose tag matches h, or null: what the
  // prefetch stages read (a key found later in its probe sequence is simply
  // not prefetched). Reads the group's control bytes.
  const E* HomeCandidate(uint64_t h) const {
    size_t g = HomeGroup(h);
    uint32_t m = GroupProbe(ctrl_ + g * kGroup).Match(static_cast<uint8_t>(h & 0x7F));
    return m ? slots_ + g * kGroup + __builtin_ctz(m) : nullptr;
  }

  E* Find(Key key, uint64_t h) const {
    const uint8_t h2 = static_cast<uint8_t>(h & 0x7F);
    size_t g = HomeGroup(h);
    for (size_t probes = 0; probes < ngroups_; ++probes) {
      const GroupProbe c(ctrl_ + g * kGroup);
      uint32_t m = c.Match(h2);
      while (m) {
        int i = __builtin_ctz(m);
        E* e = slots_ + g * kGroup + i;
        if (Traits::Equal(e->key, key)) return e;
        m &= m - 1;
      }
      if (c.MatchEmpty()) return nullptr;
      g = (g + 1 == ngroups_) ? 0 : g + 1;
    }
    return nullptr;
  }

  // The key's entry, inserted (counted 0, no row) if absent; a re-inserted key
  // stays in the deleted set. Caller holds `mu` exclusively. May rehash.
  E* FindOrAdd(Key key, uint64_t h) {
    E* en = Find(key, h);
    if (!en) en = InsertAbsent(key, h);
    return en;
  }

  // Sets the entry's dirty bit; on the 0->1 transition the key joins `dirty`.
  void MarkDirty(E* en) {
    if (!en->dirty()) {
      en->freq_dirty |= E::kDirtyBit;
      dirty.push_back(Traits::OwnStored(en->key));
    }
  }

  // Inserts a key known to be absent; returns its entry (row = kNoRow,
  // freq = 0, clean). May rehash: entry pointers from before are invalid.
  E* InsertAbsent(Key key, uint64_t h) {
    if (Overfills(1)) Rehash(GroupsFor(1));
    E* e = Place(key, h);
    ++size_;
    return e;
  }

  // Removes an entry found by Find(). The caller has freed its row.
  void Erase(E* e) {
    size_t idx = static_cast<size_t>(e - slots_);
    size_t g = idx / kGroup;
    key_heap_bytes_ -= Traits::HeapBytes(e->key);
    Traits::Release(e->key);
    if (GroupProbe(ctrl_ + g * kGroup).MatchEmpty() != 0) {
      ctrl_[idx] = kEmpty;
    } else {
      ctrl_[idx] = kDeleted;
      ++tombstones_;
    }
    --size_;
  }

  // Calls fn(E&) for every full slot.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    size_t cap = capacity();
    for (size_t i = 0; i < cap; ++i)
      if (!(ctrl_[i] & 0x80)) fn(slots_[i]);
  }

  // Drops every entry (rows are the caller's business).
  void Clear() {
    ForEach([](E& e) { Traits::Release(e.key); });
    key_heap_bytes_ = 0;
    FreeArrays();
    Reset(1);
    dirty.clear();
    deleted.clear();
    admitted_ = 0;
  }

  // Whether `more` inserts would take the load (full + tombstones) over 7/8.
  bool Overfills(size_t more) const { return (size_ + tombstones_ + more) * 8 > capacity() * 7; }

  // Makes room for `more` keys known to be absent (a training lookup's
  // misses, each key once): when inserting them would take the load over
  // 7/8, one rehash to the capacity at which they bring it to 7/12, rather
  // than a growth each time the load crosses 7/8 on the way. Exact counts
  // keep the index's bytes per key where growth keeps them; a count too high
  // would leave the segment larger than its keys need. Returns whether it
  // rehashed (entry pointers from before are then invalid).
  bool GrowFor(size_t more) {
    if (!Overfills(more)) return false;
    Rehash(GroupsFor(more));
    return true;
  }

  // Makes room for `n` entries in total without further growth (a bulk
  // import: keys that arrive in hash order would otherwise pile into the
  // few groups of a small, repeatedly growing segment).
  void Reserve(size_t n) {
    size_t want = n * 10 / 7 / kGroup + 1;
    if (want > ngroups_) Rehash(want);
  }

 private:
  size_t HomeGroup(uint64_t h) const {
    return static_cast<size_t>(((h >> 7) & 0xFFFFFFFFu) * ngroups_ >> 32);
  }

  E* Place(Key key, uint64_t h) {
    size_t g = HomeGroup(h);
    for (;;) {
      uint32_t m = GroupProbe(ctrl_ + g * kGroup).MatchEmptyOrDeleted();
      if (m) {
        size_t idx = g * kGroup + __builtin_ctz(m);
        typename Traits::Stored stored = Traits::Store(key);  // may throw (allocation): nothing changed yet
        key_heap_bytes_ += Traits::HeapBytes(stored);
        if (ctrl_[idx] == kDeleted) --tombstones_;
        ctrl_[idx] = static_cast<uint8_t>(h & 0x7F);
        E* e = slots_ + idx;
        e->key = stored;
        e->row = kNoRowId;
        e->freq_dirty = 0;
        return e;
      }
      g = (g + 1 == ngroups_) ? 0 : g + 1;
    }
  }

  // A free slot for an entry being moved by a rehash (the caller copies it).
  E* PlaceStored(const typename Traits::Stored&, uint64_t h) {
    size_t g = HomeGroup(h);
    for (;;) {
      uint32_t m = GroupProbe(ctrl_ + g * kGroup).MatchEmptyOrDeleted();
      if (m) {
        size_t idx = g * kGroup + __builtin_ctz(m);
        ctrl_[idx] = static_cast<uint8_t>(h & 0x7F);
        return slots_ + idx;
      }
      g = (g + 1 == ngroups_) ? 0 : g + 1;
    }
  }

  // Groups for a rehash before `more` inserts: load kGrowDen / kGrowNum once
  // they are in, never fewer groups than now (a segment full of tombstones
  // keeps its size).
  size_t GroupsFor(size_t more) const {
    const size_t want = (size_ + more) * kGrowNum / kGrowDen / kGroup + 1;
    return want < ngroups_ ? ngroups_ : want;
  }

  void Rehash(size_t want) {
    ++rehashes_;
    uint8_t* old_ctrl = ctrl_;
    E* old_slots = slots_;
    size_t old_cap = capacity();
    Reset(want);
    for (size_t i = 0; i < old_cap; ++i) {
      if (old_ctrl[i] & 0x80) continue;
      E& o = old_slots[i];
      E* n = PlaceStored(o.key, Traits::Hash(Traits::Load(o.key)));
      *n = o;
    }
    std::free(old_ctrl);
    std::free(old_slots);
  }

  void Reset(size_t ngroups) {
    ngroups_ = ngroups;
    size_t cap = capacity();
    // Plain pages here: segments reallocate on every growth, and each huge-page
    // fault zeroes (and may compact) 2 MiB, which an insert would then wait for.
    ctrl_ = static_cast<uint8_t*>(std::aligned_alloc(16, cap));
    slots_ = static_cast<E*>(std::malloc(cap * sizeof(E)));
    if (!ctrl_ || !slots_) throw std::bad_alloc();
    std::memset(ctrl_, kEmpty, cap);
    tombstones_ = 0;
  }
  void FreeArrays() {
    std::free(ctrl_);
    std::free(slots_);
    ctrl_ = nullptr;
    slots_ = nullptr;
    size_ = 0;
  }

  uint8_t* ctrl_ = nullptr;
  E* slots_ = nullptr;
  size_t ngroups_ = 0;
  size_t size_ = 0;
  size_t tombstones_ = 0;
  size_t key_heap_bytes_ = 0;  // Traits::HeapBytes of every stored key
  size_t admitted_ = 0;
  uint64_t rehashes_ = 0;
};

}  // namespace evstore
