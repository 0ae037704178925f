// Index: the table's key -> entry map, split into independently locked segments.
//
// Layout
//   segments_[S]  S = 2^seg_bits (default 64, at most 4096). Key k lives in
//                 segment SegmentOf(Hash(k)) = the top seg_bits bits of its
//                 hash; each Segment (segment.h) is a Swiss-table with its own
//                 shared_mutex, growth, dirty list and deleted set.
// The key type is a traits parameter (key_traits.h). Entries hold a key, a
// row id or not-admitted mark (row_store.h, evict_policy.h), a frequency and
// a dirty bit; the index knows nothing of rows, admission or eviction.
//
// Batches: Group() hashes a batch once and orders its positions by segment
// (counting sort); ForEachSegmentOfBatch() then visits the segments in
// parallel, taking each segment's lock once per batch.
//
// Invariants
//  * A key is in at most one segment, always the same one (the hash is fixed:
//    key_traits.h); segments never exchange entries.
//  * Never call the ParallelFor while holding a segment lock: its workers are
//    TensorFlow's intra-op threads, which may themselves wait for that lock.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <stdexcept>
#include <vector>

#include "key_traits.h"
#include "parallel.h"
#include "segment.h"

namespace evstore {

template <typename Traits>
class Index {
 public:
  using Key = typename Traits::Key;
  using Seg = Segment<Traits>;
  using E = typename Seg::E;
  static constexpr int kMaxSegBits = 12;

  // A batch hashed once and ordered by segment.
  struct Grouping {
    std::vector<uint64_t> hash;   // [n]: Traits::Hash of each position's key
    std::vector<uint32_t> order;  // batch positions sorted by segment
    std::vector<int64_t> start;   // [nseg + 1]: segment s holds order[start[s], start[s+1])
  };

  explicit Index(int seg_bits)
      : seg_bits_(CheckSegBits(seg_bits)), nseg_(1 << seg_bits_), segments_(new Seg[1 << seg_bits_]) {}

  int num_segments() const { return nseg_; }
  Seg& segment(int s) const { return segments_[s]; }
  int IndexOf(const Seg& seg) const { return static_cast<int>(&seg - segments_.get()); }
  int SegmentOf(uint64_t h) const { return seg_bits_ == 0 ? 0 : static_cast<int>(h >> (64 - seg_bits_)); }
  Seg& SegmentFor(uint64_t h) const { return segments_[SegmentOf(h)]; }

  void Group(const Key* keys, int64_t n, Grouping* g) const {
    if (n > 0xFFFFFFFFll) throw std::invalid_argument("batch too large (more than 2^32 keys)");
    g->hash.resize(n);
    g->order.resize(n);
    g->start.assign(nseg_ + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = Traits::Hash(keys[i]);
      g->hash[i] = h;
      ++g->start[SegmentOf(h) + 1];
    }
    for (int s = 0; s < nseg_; ++s) g->start[s + 1] += g->start[s];
    std::vector<int64_t> pos(g->start.begin(), g->start.end() - 1);
    for (int64_t i = 0; i < n; ++i) g->order[pos[SegmentOf(g->hash[i])]++] = static_cast<uint32_t>(i);
  }

  // A batch grouped as by Group(), with each position's hash and key also
  // copied into segment order: hash_in_order[j] = hash[order[j]], and
  // key_in_order[j] = keys[order[j]]. Group() leaves them to be read through
  // `order`, at a stride of about the number of segments, each read a cache
  // miss that the probe waits for; an inserting first pass (Table::
  // FindOrInsert) reads them in order instead, one gather pass ahead.
  struct OrderedGrouping : Grouping {
    std::vector<uint64_t> hash_in_order;
    std::vector<Key> key_in_order;
  };

  void GroupInOrder(const Key* keys, int64_t n, OrderedGrouping* g) const {
    Group(keys, n, g);
    g->hash_in_order.resize(n);
    g->key_in_order.resize(n);
    GatherInOrder(*g, keys, 0, n, g->hash_in_order.data(), g->key_in_order.data());
  }

  // The hashes and keys of positions [lo, hi) of g.order, in that order,
  // into h[0, hi - lo) and k[0, hi - lo): GroupInOrder's gather for the whole
  // batch, Table::Find's for one segment's part (on the thread probing it).
  static void GatherInOrder(const Grouping& g, const Key* keys, int64_t lo, int64_t hi, uint64_t* h, Key* k) {
    for (int64_t j = lo; j < hi; ++j) {
      const uint32_t i = g.order[j];
      h[j - lo] = g.hash[i];
      k[j - lo] = keys[i];
    }
  }

  // Runs fn(segment, lo, hi) for every segment that holds batch positions
  // [lo, hi) of g.order, segments in parallel, each under its lock (`Lock`:
  // shared for reads, unique for writes), taken once per batch.
  template <typename Lock, typename Fn>
  void ForEachSegmentOfBatch(const Grouping& g, int64_t n, int64_t ns_per_key, const ParallelFor& pf,
                             const Fn& fn) const {
    pf(nseg_, std::max<int64_t>(1, n * ns_per_key / nseg_), [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        int64_t lo = g.start[s], hi = g.start[s + 1];
        if (lo == hi) continue;
        Lock lock(segments_[s].mu);
        fn(segments_[s], lo, hi);
      }
    });
  }

  // Batch probes prefetch control bytes kCtrlAhead positions ahead and the
  // matching entry kSlotAhead positions ahead (segment.h). For keys stored
  // outside the entry (strings) the pipeline has a third stage, and the
  // query keys are prefetched too: a batch is probed in segment order, so
  // its string views and their bytes are read at random, like the index.
  static void PrefetchAhead(const Seg& seg, const Grouping& g, const Key* keys, int64_t j, int64_t hi) {
    if constexpr (Traits::kKeyOutOfLine) {   // three dependent loads per key: a longer pipeline
      if (j + 3 * kKeyAhead < hi) {
        const uint32_t i = g.order[j + 3 * kKeyAhead];
        seg.PrefetchCtrl(g.hash[i]);
        PrefetchT0(keys + i);
      }
      if (j + 2 * kKeyAhead < hi) seg.PrefetchSlot(g.hash[g.order[j + 2 * kKeyAhead]]);
      if (j + kKeyAhead < hi) {
        const uint32_t i = g.order[j + kKeyAhead];
        seg.PrefetchKey(g.hash[i]);
        Traits::PrefetchQuery(keys[i]);
      }
    } else {
      if (j + kCtrlAhead < hi) seg.PrefetchCtrl(g.hash[g.order[j + kCtrlAhead]]);
      if (j + kSlotAhead < hi) seg.PrefetchSlot(g.hash[g.order[j + kSlotAhead]]);
    }
  }

  // PrefetchAhead for a batch grouped in order (GroupInOrder): the same
  // stages, reading the hashes and keys at j + distance directly.
  static void PrefetchAheadInOrder(const Seg& seg, const OrderedGrouping& g, int64_t j, int64_t hi) {
    PrefetchAheadInOrder(seg, g.hash_in_order.data(), g.key_in_order.data(), j, hi);
  }
  // The same over hashes h and keys k gathered in probe order (GatherInOrder).
  static void PrefetchAheadInOrder(const Seg& seg, const uint64_t* h, const Key* k, int64_t j, int64_t hi) {
    PrefetchAheadOf(seg, h, k, j, hi, [](int64_t q) { return q; });
  }

  // The same for a subsequence of a segment's positions in order, q-th of n,
  // position at(q) (Table::FindOrInsert's absent keys, probed again to insert).
  template <typename At>
  static void PrefetchAheadOf(const Seg& seg, const OrderedGrouping& g, int64_t q, int64_t n, const At& at) {
    PrefetchAheadOf(seg, g.hash_in_order.data(), g.key_in_order.data(), q, n, at);
  }

  // The same stages over hashes h and keys k already in probe order
  // (GatherInOrder's).
  template <typename At>
  static void PrefetchAheadOf(const Seg& seg, const uint64_t* h, const Key* k, int64_t q, int64_t n, const At& at) {
    if constexpr (Traits::kKeyOutOfLine) {
      if (q + 3 * kKeyAhead < n) seg.PrefetchCtrl(h[at(q + 3 * kKeyAhead)]);
      if (q + 2 * kKeyAhead < n) seg.PrefetchSlot(h[at(q + 2 * kKeyAhead)]);
      if (q + kKeyAhead < n) {
        seg.PrefetchKey(h[at(q + kKeyAhead)]);
        Traits::PrefetchQuery(k[at(q + kKeyAhead)]);
      }
    } else {
      if (q + kCtrlAhead < n) seg.PrefetchCtrl(h[at(q + kCtrlAhead)]);
      if (q + kSlotAhead < n) seg.PrefetchSlot(h[at(q + kSlotAhead)]);
    }
  }

  // How many distinct hashes the positions pos hold in g (hash_in_order):
  // the number of keys among them, each key's repeats in the batch counted
  // once. Two keys of equal 64-bit hash count as one, so the count is never
  // above the keys'. `set` is scratch (an open-addressed set of at least
  // twice pos.size() slots; 0 marks a free slot, and the hash 0 is counted
  // apart).
  static size_t DistinctHashes(const OrderedGrouping& g, const std::vector<int64_t>& pos,
                               std::vector<uint64_t>* set) {
    size_t cap = 16;
    while (cap < pos.size() * 2) cap <<= 1;
    set->assign(cap, 0);
    uint64_t* const slot = set->data();
    size_t distinct = 0;
    bool zero = false;
    for (const int64_t j : pos) {
      const uint64_t h = g.hash_in_order[j];
      if (h == 0) {
        distinct += !zero;
        zero = true;
        continue;
      }
      size_t p = h & (cap - 1);  // low bits: a segment's hashes share their top bits
      while (slot[p] != 0 && slot[p] != h) p = (p + 1) & (cap - 1);
      distinct += slot[p] == 0;
      slot[p] = h;
    }
    return distinct;
  }

  // Sizes every segment for `total_keys` keys in the whole index (spread
  // evenly, with 10% slack), so a bulk import does not grow them step by step.
  void Reserve(int64_t total_keys) {
    if (total_keys <= 0) return;
    const size_t per = static_cast<size_t>(total_keys / nseg_ + total_keys / nseg_ / 10 + 16);
    for (int s = 0; s < nseg_; ++s) {
      std::unique_lock<std::shared_mutex> lock(segments_[s].mu);
      segments_[s].Reserve(per);
    }
  }

 private:
  static constexpr int kCtrlAhead = 16;
  static constexpr int kSlotAhead = 8;
  static constexpr int kKeyAhead = 8;   // out-of-line keys: ctrl at 3x, entry at 2x, key bytes at 1x
  static_assert(kCtrlAhead > kSlotAhead, "the slot prefetch reads the control bytes fetched before");
  static int CheckSegBits(int b) {
    if (b < 0 || b > kMaxSegBits) throw std::invalid_argument("segments_log2 must be in [0, 12]");
    return b;
  }

  const int seg_bits_;
  const int nseg_;
  std::unique_ptr<Seg[]> segments_;
};

}  // namespace evstore
