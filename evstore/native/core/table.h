// evstore::Table<K, Traits, Store>: the EmbeddingVariable's storage. No TensorFlow here.
//
// The table is orchestration over parts that can be read alone:
//   index_        (index.h, segment.h) the key -> entry map, split by the top
//                 bits of the key hash into S = 2^segments_log2 (default 64)
//                 segments, each with its own shared_mutex, growth, dirty list
//                 and deleted set. Keyed by a traits class (key_traits.h).
//   rows_         (row_store.h; default RowArena, arena.h; or TieredStore,
//                 tiered_store.h: a DRAM cache over a disk tier) rows
//                 [embedding | optimizer slots] + versions; ids are stable,
//                 freed rows are recycled.
//   admission_    (filter_policy.h) AdmissionPolicy: CounterAdmission or
//                 BloomAdmission; which keys earn a row.
//   Evict(step, EvictionPolicies) (evict_policy.h): which keys leave.
//   Row updates are functors (optimizers.h) passed to Apply.
//   bank_         initializer bank [bank_rows, dim]: a new row's embedding is
//                 bank_[BankHash(key) % bank_rows] (DeepRec's trick: drawn once
//                 from the TF initializer, deterministic, lock-free).
//
// Key states
//   absent      not in the index (with BloomAdmission, a key that is counted
//               but not admitted is absent too: its count lives in the filter).
//   filtered    in the index without a row (!RowIsReal(row)): counted, not
//               admitted, reads the default value, ignores gradients, costs
//               one index slot. Its `row` field holds its last-seen step.
//   admitted    has a row (row < 2^31); version slot = global step of its last
//               update, or (never updated) its encoded admission step.
//   Encodings of versions and last-seen steps: evict_policy.h.
//
// Admission (filter_policy.h): a key is admitted on the training lookup whose
// batch brings its count to min_freq: exact counts in the entry
// (CounterAdmission, and min_freq = 1 for no filter), or a counting Bloom
// filter's estimate (BloomAdmission: no index entry before admission; the
// admitted key's frequency starts from the estimate).
//
// Clock and eviction: clock_ is the highest global step the table has seen
// (Apply, Evict, versions of imported rows). Training lookups stamp admitted
// keys' admission step and filtered keys' last sighting with it. Evict(step,
// policy) erases keys the policy selects (evict_policy.h) exactly like Erase:
// rows to the free list, keys to the deleted set.
//
// Dirty / deleted tracking (what a delta checkpoint must carry)
//   * A key whose persisted state changes (frequency, row, version, admission)
//     gets its entry's dirty bit set and, on the 0->1 transition, is appended to
//     its segment's `dirty` list. So the open dirty set costs O(changed keys).
//   * Erasing a key puts it in its segment's `deleted` set until the next
//     seal, even if it is re-inserted meanwhile (then it is dirty too). A
//     reader applies a delta's deleted keys before its rows and filtered keys,
//     so a key erased and re-inserted in one delta ends in its new state; and
//     a reader that serves only admitted rows (a serving replica) learns from
//     the deleted keys alone every key that lost its row, without reading the
//     counted-not-admitted keys.
//   * BeginExport() seals both sets into a Snapshot under each segment lock in
//     turn: dirty keys still present with the bit set move into the snapshot
//     (bit cleared, which also drops duplicates and erased keys); deleted sets
//     move wholesale. New changes go to fresh sets. Commit(id) drops the
//     snapshot; Abort(id) merges it back, so a failed save loses nothing.
//     At most one snapshot is open at a time.
//
// Zero rows (zero_rows.h)
//   zero_rows_[s] counts segment s's admitted rows whose embedding is all zero
//   (rows the group-lasso optimizers dropped, or zero-initialised rows). It is
//   kept exact under the segment lock wherever a row is written or freed:
//   Admit, Apply, ImportRows, EraseLocked, Clear.
//
// Concurrency
//   Every batch op hashes its keys, groups them by segment (counting sort), and
//   processes segments in parallel through the caller's ParallelFor, taking each
//   segment lock once per batch: shared for Find, exclusive for FindOrInsert,
//   Apply, Import, Erase. A row is read or written only under its key's segment
//   lock, so no reader sees a torn row and concurrent applies to one key
//   serialise (order-free math such as SGD sums gives a serial run's result).
//   Lock order: slots_mu_ -> export_mu_ -> segments (ascending) -> row store.
//   Never call the ParallelFor while holding a segment lock: its workers are
//   TensorFlow's intra-op threads, which may themselves be waiting for that
//   lock (so slot relayout, which holds them all, copies serially).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "arena.h"
#include "evict_policy.h"
#include "filter_policy.h"
#include "index.h"
#include "key_traits.h"
#include "optimizers.h"
#include "parallel.h"
#include "row_store.h"
#include "schema.h"
#include "segment.h"
#include "span_reader.h"
#include "zero_rows.h"

namespace evstore {

struct TableConfig {
  int dim = 0;
  int segments_log2 = 6;
  std::vector<float> bank;           // bank_rows * dim; empty = zeros
  std::vector<float> default_value;  // dim; empty = zeros
  uint32_t min_freq = 1;             // admission threshold (1 = admit at first sight)
  BloomConfig bloom;                 // capacity > 0: count non-admitted keys in a Bloom filter
  TierConfig tier;                   // a tiered row store's budget and directory (row_store.h)
};

// One int64 per field of the schema (schema.h: EVSTORE_STATS_FIELDS, which
// documents each; EvStats writes them in that order).
struct TableStats {
#define EVSTORE_STATS_MEMBER_(name, doc) int64_t name = 0;
  EVSTORE_STATS_FIELDS(EVSTORE_STATS_MEMBER_)
#undef EVSTORE_STATS_MEMBER_
};
static_assert(sizeof(TableStats) == schema::kNumStatsFields * sizeof(int64_t), "one int64 per stats field");

// One exported key (full export or sealed snapshot readout).
template <typename K>
struct ExportedKey {
  K key;
  bool admitted;
  int64_t version;
  int64_t freq;
  int64_t seen = -1;  // filtered key: step last seen at (-1 unknown); admitted: -1
};

// Keys an eviction removed and their embeddings (values: dim floats per key,
// in keys' order); a filtered key evicted reads the default value.
template <typename Owned>
struct EvictedRows {
  std::vector<Owned> keys;
  std::vector<float> values;
};

template <typename K, typename Traits = KeyTraits<K>, typename Store = RowArena>
class Table {
 public:
  static_assert(std::is_same<K, typename Traits::Key>::value, "Table<K, Traits>: Traits::Key must be K");
  static_assert(IsRowStore<Store>(), "Table's Store must implement the row store contract (row_store.h)");
  using Owned = typename Traits::Owned;
  using Idx = Index<Traits>;
  using Seg = typename Idx::Seg;
  using E = typename Idx::E;
  static constexpr uint32_t kNoRow = kNoRowId;

  struct Snapshot {
    uint64_t id = 0;
    std::vector<Owned> dirty;
    std::vector<Owned> deleted;
    std::vector<int64_t> bloom_blocks;  // Bloom counter blocks raised (filter_policy.h)
  };

  explicit Table(TableConfig cfg)
      : dim_(cfg.dim),
        index_(cfg.segments_log2),  // checks the range before anything is sized by it
        nseg_(index_.num_segments()),
        rows_(MakeRowStore<Store>(cfg.dim, cfg.tier)) {
    rows_.AttachLocks([this](int s) -> std::shared_mutex& { return index_.segment(s).mu; });
    if (dim_ <= 0) throw std::invalid_argument("dim must be positive, got " + std::to_string(dim_));
    default_ = cfg.default_value.empty() ? std::vector<float>(dim_, 0.f) : cfg.default_value;
    if (static_cast<int>(default_.size()) != dim_)
      throw std::invalid_argument("default_value must have dim elements");
    bank_ = cfg.bank.empty() ? std::vector<float>(dim_, 0.f) : cfg.bank;
    if (bank_.size() % dim_ != 0) throw std::invalid_argument("bank size must be a multiple of dim");
    bank_rows_ = bank_.size() / dim_;
    bank_zero_.resize(bank_rows_);
    for (size_t r = 0; r < bank_rows_; ++r) bank_zero_[r] = IsZeroRow(bank_.data() + r * dim_, dim_);
    zero_rows_.reset(new int64_t[nseg_]());
    admission_ = MakeAdmissionPolicy(cfg.min_freq, cfg.bloom, nseg_);
  }

  int dim() const { return dim_; }
  uint32_t min_freq() const { return admission_->min_freq(); }
  // True when keys not yet admitted are counted outside the index (Bloom).
  bool has_bloom() const { return !admission_->CountsInIndex(); }
  const AdmissionPolicy& admission() const { return *admission_; }
  // The admission policy's Bloom counters (checkpointed in blocks), or null.
  const CountingBloom* bloom() const { return admission_->bloom(); }
  // Highest global step seen (-1: none yet); see evict_policy.h.
  int64_t clock() const { return clock_.load(std::memory_order_relaxed); }
  void AdvanceClock(int64_t step) {
    int64_t c = clock_.load(std::memory_order_relaxed);
    while (step > c && !clock_.compare_exchange_weak(c, step, std::memory_order_relaxed)) {
    }
  }
  // Sets the clock (a full restore: the saved table's clock, exactly).
  void SetClock(int64_t step) { clock_.store(step < -1 ? -1 : step, std::memory_order_relaxed); }
  const std::vector<float>& default_value() const { return default_; }

  // ---- optimizer slots ---------------------------------------------------

  // Makes sure every named slot exists, appending missing ones to every row
  // (a one-time relayout). Returns each slot's float offset from the row start.
  // An existing slot keeps its values; its initial value for new rows is
  // updated to the given one (the optimizer is the authority).
  std::vector<int> EnsureSlots(const SlotSpecs& specs) {
    std::lock_guard<std::mutex> l(slots_mu_);
    SlotSpecs missing;
    bool changed = false;
    for (const auto& s : specs) {
      int idx = SlotIndexLocked(s.first);
      if (idx < 0) {
        missing.push_back(s);
      } else if (slots_[idx].second != s.second) {
        changed = true;
      }
    }
    if (!missing.empty() || changed) {
      // The store prepares wider rows before any segment lock is taken
      // (arena.h: PrepareWiden, as many blocks as the memory headroom allows,
      // at least a few), and the table waits for that part with lookups
      // running; Relayout copies, and prepares the rest, under the locks.
      int new_stride = RowFloats(dim_, static_cast<int>(slots_.size() + missing.size()));
      std::unique_ptr<typename Store::Widened> prepared;
      if (!missing.empty()) {
        prepared = rows_.PrepareWiden(new_stride);
        prepared->WaitPrepared();
      }
      // Rows and the slot-init row change only with every segment lock held.
      std::vector<std::unique_lock<std::shared_mutex>> locks;
      locks.reserve(nseg_);
      for (int i = 0; i < nseg_; ++i) locks.emplace_back(index_.segment(i).mu);
      for (const auto& s : specs) {
        int idx = SlotIndexLocked(s.first);
        if (idx >= 0) slots_[idx].second = s.second;
      }
      if (!missing.empty()) {
        std::vector<float> tail;
        for (const auto& s : missing) tail.insert(tail.end(), dim_, s.second);
        rows_.Relayout(new_stride, tail, prepared.get());
        for (const auto& s : missing) slots_.push_back(s);
      }
      slot_init_row_.clear();
      for (const auto& s : slots_) slot_init_row_.insert(slot_init_row_.end(), dim_, s.second);
    }
    std::vector<int> offs;
    for (const auto& s : specs) offs.push_back((1 + SlotIndexLocked(s.first)) * dim_);
    return offs;
  }
  SlotSpecs slots() const {
    std::lock_guard<std::mutex> l(slots_mu_);
    return slots_;
  }
  // Floats per row: RowFloats(dim, number of slots) (row_store.h).
  int stride() const {
    std::lock_guard<std::mutex> l(slots_mu_);
    return RowFloats(dim_, static_cast<int>(slots_.size()));
  }

  // ---- lookups -------------------------------------------------------------

  // A caller-given occurrence count as a saturating frequency increment.
  static uint32_t Occurrences(int64_t c) {
    return c <= 0 ? 0u : (c >= 0x7FFFFFFF ? 0x7FFFFFFFu : static_cast<uint32_t>(c));
  }

  // Read-only: out[i] = row of keys[i] if admitted, else the default value.
  // Never inserts, never counts; a tier reads cold rows without caching them.
  // A large output is written with streaming stores, as FindOrInsert's is
  // (CanStreamOut, RowsOut).
  void Find(const K* keys, int64_t n, float* out, const ParallelFor& pf) const {
    Grouping g;
    index_.Group(keys, n, &g);
    const bool stream_out = CanStreamOut(out, n);
    index_.template ForEachSegmentOfBatch<std::shared_lock<std::shared_mutex>>(g, n, 60, pf, [&](Seg& seg, int64_t lo,
                                                                                                 int64_t hi) {
      thread_local std::vector<const float*> src;  // row per position, prefetched
      src.resize(hi - lo);
      if constexpr (Store::kAllResident) {
        // The part's hashes and keys gathered into probe order first: the
        // gather's loads are independent of each other and overlap, where
        // the probe loop reading them at random through g.order waited for
        // each before it could prefetch that key's control bytes.
        thread_local std::vector<uint64_t> hs;
        thread_local std::vector<K> ks;
        const int64_t m = hi - lo;
        hs.resize(m);
        ks.resize(m);
        Idx::GatherInOrder(g, keys, lo, hi, hs.data(), ks.data());
        for (int64_t q = 0; q < m; ++q) {
          Idx::PrefetchAheadInOrder(seg, hs.data(), ks.data(), q, m);
          const E* en = seg.Find(ks[q], hs[q]);
          const float* p = (en && RowIsReal(en->row)) ? rows_.ReadRow(en->row) : default_.data();
          rows_.PrefetchRow(p, dim_);
          src[q] = p;
        }
      } else {
        // A tier: note the rows, then read them in place or, the cold ones,
        // from disk together without caching them (a read-only lookup
        // evicts nothing: Store::PeekRows).
        thread_local std::vector<int64_t> at;  // position of each admitted row
        thread_local std::vector<uint32_t> want;
        thread_local std::vector<const float*> got;
        at.clear();
        want.clear();
        for (int64_t j = lo; j < hi; ++j) {
          Idx::PrefetchAhead(seg, g, keys, j, hi);
          uint32_t i = g.order[j];
          const E* en = seg.Find(keys[i], g.hash[i]);
          if (en && RowIsReal(en->row)) {
            at.push_back(j - lo);
            want.push_back(en->row);
          } else {
            src[j - lo] = default_.data();
          }
        }
        got.resize(want.size());
        rows_.PeekRows(want.data(), want.size(), got.data());
        for (size_t k = 0; k < want.size(); ++k) {
          rows_.PrefetchRow(got[k], dim_);
          src[at[k]] = got[k];
        }
      }
      RowsOut(g, lo, hi, src, out, stream_out);
    });
  }

  // A serving table's lookup (ev_resource.h, serving_rows.h): like Find, but
  // hands each key's row to `emit(i, row)` under its segment's lock (row: the
  // key's admitted row, stride floats, or nullptr: it has none) instead of
  // copying it. With `count`, every occurrence of an admitted key adds one to
  // its frequency and the row store is hinted with it, as a training lookup
  // does, so predictions weigh in a tier's cache policy (cache_policy.h). The
  // frequency is raised with a relaxed atomic add (other lookups of the key
  // hold the same shared lock); it is never marked dirty.
  template <typename Emit>
  void FindEach(const K* keys, int64_t n, bool count, const ParallelFor& pf, Emit&& emit) const {
    Grouping g;
    index_.Group(keys, n, &g);
    index_.template ForEachSegmentOfBatch<std::shared_lock<std::shared_mutex>>(g, n, 60, pf, [&](Seg& seg, int64_t lo,
                                                                                                 int64_t hi) {
      thread_local std::vector<uint32_t> rows;  // row per position (kNoRow: none)
      thread_local std::vector<uint32_t> want;
      rows.resize(hi - lo);
      want.clear();
      for (int64_t j = lo; j < hi; ++j) {
        Idx::PrefetchAhead(seg, g, keys, j, hi);
        const uint32_t i = g.order[j];
        E* en = seg.Find(keys[i], g.hash[i]);
        rows[j - lo] = (en && RowIsReal(en->row)) ? en->row : kNoRow;
        if (rows[j - lo] == kNoRow) continue;
        want.push_back(en->row);
        if (count) rows_.Hint(en->row, CountLookup(en));
      }
      rows_.FaultMany(want.data(), want.size());
      for (int64_t j = lo; j < hi; ++j)
        emit(static_cast<int64_t>(g.order[j]), rows[j - lo] != kNoRow ? rows_.ReadRow(rows[j - lo]) : nullptr);
    });
  }

  // Training lookup: inserts unseen keys, adds every occurrence to the key's
  // frequency, admits keys whose frequency reaches min_freq (initial row from
  // the bank, admission step = clock), stamps keys left filtered with the
  // clock as their last sighting, and writes the row (or the default value
  // for keys not admitted). With a Bloom filter, keys without an entry are
  // counted in the filter and get an entry only when admitted. All
  // occurrences of a key in one batch see the same result.
  // `counts` (optional) gives each key's number of occurrences: a caller that
  // deduplicated the batch (a sharded EV's lookup sends unique keys to the
  // shard) passes them so that frequencies and admission are exactly those of
  // the full batch.
  void FindOrInsert(const K* keys, int64_t n, float* out, const ParallelFor& pf,
                    const int64_t* counts = nullptr) {
    OrderedGrouping g;
    index_.GroupInOrder(keys, n, &g);
    const uint64_t* const hash = g.hash_in_order.data();  // by position in segment order (j)
    const auto* const key = g.key_in_order.data();
    const int64_t clock = this->clock();
    const uint32_t seen_mark = FilteredMark(clock);
    AdmissionPolicy& adm = *admission_;
    const bool count_outside = !adm.CountsInIndex();
    const bool stream_out = CanStreamOut(out, n);
    index_.template ForEachSegmentOfBatch<std::unique_lock<std::shared_mutex>>(g, n, 120, pf, [&](Seg& seg, int64_t lo,
                                                                                                  int64_t hi) {
      const int s = index_.IndexOf(seg);
      thread_local std::vector<const float*> src;  // row per position, prefetched
      thread_local std::vector<Pending> pending;    // positions whose key has no row yet
      thread_local std::vector<uint32_t> rows;
      src.resize(hi - lo);
      pending.clear();
      [[maybe_unused]] TierPart* tier = nullptr;
      if constexpr (!Store::kAllResident) {
        tier = &ThisTierPart();
        tier->Clear();
      }
      // Pass 1 counts every occurrence in its key's entry and notes its row
      // (or, for a key without one, the position as pending).
      auto note = [&](E* en, int64_t j) {
        en->add_freq(counts ? Occurrences(counts[g.order[j]]) : 1);
        seg.MarkDirty(en);
        if (RowIsReal(en->row)) {
          if constexpr (Store::kAllResident) {
            rows_.Hint(en->row, en->freq());
            src[j - lo] = rows_.ReadRow(en->row);
            rows_.PrefetchRow(src[j - lo], dim_);
          } else {
            // Hinted with the rest of the part (AccessMany), its metadata
            // prefetched now.
            rows_.PrefetchMeta(en->row);
            tier->rows.push_back(en->row);
            tier->freqs.push_back(en->freq());
            tier->positions.push_back(j);
          }
        } else {
          pending.push_back({j, en, seg.rehashes()});
        }
      };
      thread_local std::vector<int64_t> absent;     // positions whose key 1a left absent
      thread_local std::vector<uint64_t> distinct;  // Idx::DistinctHashes' scratch
      absent.clear();
      bool bloom_pending = false;
      // A segment with room for every key of its part inserts absent keys as
      // they come (no growth can follow); one without room grows in 1b, once,
      // for the keys found absent, instead of in the middle of 1a, where each
      // growth left the prefetched slots and every pending entry taken before
      // it stale (pass 2b found those again, one cache miss each).
      const bool room = !seg.Overfills(static_cast<size_t>(hi - lo));
      // 1a: every position probed. An absent key is inserted (room), noted
      // for 1b, or, with a Bloom filter, counted in the filter below
      // (prefetched, so misses overlap).
      for (int64_t j = lo; j < hi; ++j) {
        Idx::PrefetchAheadInOrder(seg, g, j, hi);
        E* en = seg.Find(key[j], hash[j]);
        if (!en && room && !count_outside) en = seg.InsertAbsent(key[j], hash[j]);
        if (en) {
          note(en, j);
        } else if (count_outside) {
          pending.push_back({j, nullptr, 0});
          bloom_pending = true;
        } else {
          absent.push_back(j);
        }
      }
      // 1b: the absent keys inserted after at most one growth, for all of
      // them (each key's repeats in the batch counted once, so the load ends
      // at 7/12, where growth leaves it: segment.h). A key's first occurrence
      // inserts it, its repeats find it.
      if (!absent.empty()) {
        if (seg.Overfills(absent.size())) seg.GrowFor(Idx::DistinctHashes(g, absent, &distinct));
        const int64_t na = static_cast<int64_t>(absent.size());
        const int64_t* const at = absent.data();
        for (int64_t q = 0; q < na; ++q) {
          Idx::PrefetchAheadOf(seg, g, q, na, [at](int64_t r) { return at[r]; });
          note(seg.FindOrAdd(key[at[q]], hash[at[q]]), at[q]);
        }
      }
      if constexpr (!Store::kAllResident) {
        const std::vector<uint32_t>& want = tier->rows;
        std::vector<float*>& got = tier->pointers;
        got.resize(want.size());
        rows_.AccessMany(want.data(), want.size(), false, got.data(), tier->freqs.data(), dim_);
        for (size_t k = 0; k < want.size(); ++k) src[tier->positions[k] - lo] = got[k];
      }
      // Pass 2a (Bloom): a key without an entry is admitted (entry + row)
      // once the filter's batch-complete estimate reaches min_freq.
      if (bloom_pending) {
        constexpr size_t kBloomAhead = 6;
        for (size_t q = 0; q < pending.size(); ++q) {
          if (q + kBloomAhead < pending.size() && !pending[q + kBloomAhead].en)
            adm.Prefetch(s, hash[pending[q + kBloomAhead].pos]);
          if (!pending[q].en) {
            const int64_t j = pending[q].pos;
            adm.Add(s, hash[j], counts ? Occurrences(counts[g.order[j]]) : 1);
          }
        }
        for (const Pending& p : pending) {
          if (p.en) continue;
          E* en = seg.Find(key[p.pos], hash[p.pos]);  // admitted by an earlier occurrence?
          if (!en) {
            uint32_t est = adm.Estimate(s, hash[p.pos]);
            if (!adm.Admits(est)) {
              src[p.pos - lo] = default_.data();
              continue;
            }
            en = seg.FindOrAdd(key[p.pos], hash[p.pos]);
            en->set_freq(est);
            seg.MarkDirty(en);
            Admit(seg, en, rows_.Allocate());
            bloom_admitted_.fetch_add(1, std::memory_order_relaxed);
          }
          src[p.pos - lo] = rows_.Row(en->row);
        }
      }
      // Pass 2b: keys with an entry but no row are admitted once their
      // (batch-complete) count reaches min_freq, so all occurrences in a batch
      // agree; the others record this sighting. Entry pointers from pass 1 are
      // reused unless a rehash moved the entries.
      size_t admit = 0;
      for (Pending& p : pending) {
        if (!p.en) continue;
        if (p.rehashes != seg.rehashes()) {
          p.en = seg.Find(key[p.pos], hash[p.pos]);
          p.rehashes = seg.rehashes();
        }
        if (p.en->row == kAdmitting || RowIsReal(p.en->row)) continue;
        if (adm.Admits(p.en->freq())) {
          p.en->row = kAdmitting;
          ++admit;
        } else {
          p.en->row = seen_mark;
        }
      }
      rows.resize(admit);
      if (admit) rows_.AllocateMany(admit, rows.data());
      size_t next = 0;
      for (const Pending& p : pending) {
        if (!p.en) continue;
        if (p.en->row == kAdmitting) Admit(seg, p.en, rows[next++]);
        src[p.pos - lo] = RowIsReal(p.en->row) ? rows_.Row(p.en->row) : default_.data();
      }
      RowsOut(g, lo, hi, src, out, stream_out);
    });
  }

  // ---- optimizer apply -------------------------------------------------------

  // Applies `update(row, grad)` to each admitted key of a batch of *unique*
  // keys (see UniqueSum), stamps version = step and marks the key dirty.
  // Absent and filtered keys are skipped. Returns the number of rows updated.
  template <typename Update>
  int64_t Apply(const K* keys, const float* grads, int64_t n, int64_t step, const Update& update,
                const ParallelFor& pf) {
    Grouping g;
    index_.Group(keys, n, &g);
    std::atomic<int64_t> applied{0};
    const int stride = this->stride();
    AdvanceClock(step);
    index_.template ForEachSegmentOfBatch<std::unique_lock<std::shared_mutex>>(g, n, 200, pf, [&](Seg& seg, int64_t lo,
                                                                                                  int64_t hi) {
      thread_local std::vector<E*> hit;  // entry per position (nullptr: absent or filtered)
      hit.resize(hi - lo);
      // Pass 1: resolve entries and prefetch their rows and versions (no
      // inserts, so entry pointers stay valid for pass 2); a tier faults the
      // cold rows in together instead.
      [[maybe_unused]] TierPart* tier = nullptr;
      if constexpr (!Store::kAllResident) {
        tier = &ThisTierPart();
        tier->Clear();
      }
      for (int64_t j = lo; j < hi; ++j) {
        Idx::PrefetchAhead(seg, g, keys, j, hi);
        uint32_t i = g.order[j];
        E* en = seg.Find(keys[i], g.hash[i]);
        if (en && !RowIsReal(en->row)) en = nullptr;
        if (en) {
          if constexpr (Store::kAllResident) {
            rows_.PrefetchRow(rows_.Row(en->row), stride);
          } else {
            tier->rows.push_back(en->row);
          }
          __builtin_prefetch(&rows_.Version(en->row));
        }
        hit[j - lo] = en;
      }
      // A tier: fault the cold rows in together, then resolve every row's
      // slot and prefetch it (the resident store prefetched in pass 1).
      if constexpr (!Store::kAllResident) {
        std::vector<float*>& got = tier->pointers;
        got.resize(tier->rows.size());
        rows_.AccessMany(tier->rows.data(), tier->rows.size(), true, got.data(), nullptr, stride);
      }
      // Pass 2: fused update, version stamp, dirty mark.
      int64_t local = 0, zero_delta = 0;
      [[maybe_unused]] float* const* tier_rows = nullptr;  // a tier's rows noted in pass 1, in order
      if constexpr (!Store::kAllResident) tier_rows = tier->pointers.data();
      for (int64_t j = lo; j < hi; ++j) {
        E* en = hit[j - lo];
        if (!en) continue;
        float* row;
        if constexpr (Store::kAllResident) {
          row = rows_.Row(en->row);
        } else {
          row = tier_rows[local];
        }
        const bool was_zero = IsZeroRow(row, dim_);
        update(row, grads + static_cast<int64_t>(g.order[j]) * dim_);
        zero_delta += static_cast<int>(IsZeroRow(row, dim_)) - static_cast<int>(was_zero);
        rows_.Version(en->row) = step;
        seg.MarkDirty(en);
        ++local;
      }
      if (zero_delta) ZeroCount(seg) += zero_delta;
      applied += local;
    });
    return applied.load();
  }

  // ---- removal ---------------------------------------------------------------

  // Erases keys (admitted or filtered); their rows go to the free list and the
  // keys to the deleted set. Returns how many were present.
  // With track_deleted=false (applying a checkpoint's deletions during a
  // restore) the keys do not enter the deleted set.
  int64_t Erase(const K* keys, int64_t n, bool track_deleted = true) {
    int64_t erased = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = Traits::Hash(keys[i]);
      Seg& seg = index_.SegmentFor(h);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(keys[i], h);
      if (!en) continue;
      EraseLocked(seg, en, track_deleted);
      ++erased;
    }
    return erased;
  }

  // Evicts at global step `step` (advancing the clock to it) every key the
  // policies select (evict_policy.h: EvictionPolicies::Decide). Evicted keys are erased like
  // Erase does (rows to the free list, keys to the deleted set). Keys whose
  // age reference is unknown are stamped with `step` instead; an admitted
  // key's stamp changes its saved version, so it is marked dirty. Returns
  // the number of keys evicted. `kept` (optional) receives each evicted key
  // and its embedding (dim floats each, read before the row is freed), for a
  // caller that keeps the values the table drops (a reference model's
  // copy-on-write: evstore_app/job/reference.py).
  int64_t Evict(int64_t step, const EvictionPolicies& policies, EvictedRows<Owned>* kept = nullptr) {
    AdvanceClock(step);
    if (policies.empty()) return 0;
    int64_t erased = 0;
    std::vector<Owned> victims;
    // Only a policy that reads weights (L2) reads rows: eviction by step
    // never brings a tiered store's cold rows back into DRAM.
    const bool needs_row = policies.NeedsRow();
    Scratch scratch(this);
    for (int s = 0; s < nseg_; ++s) {
      Seg& seg = index_.segment(s);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      victims.clear();
      seg.ForEach([&](E& en) {
        const bool adm = RowIsReal(en.row);
        const int64_t ref = adm ? VersionReference(rows_.Version(en.row)) : FilteredReference(en.row);
        switch (policies.Decide(step, ref, adm && needs_row ? rows_.PeekRow(en.row, scratch.data()) : nullptr, dim_)) {
          case EvictDecision::kEvict:
            victims.push_back(Traits::OwnStored(en.key));
            break;
          case EvictDecision::kStamp:
            if (adm) {
              rows_.Version(en.row) = EncodeAdmission(step);
            } else {
              en.row = FilteredMark(step);
            }
            seg.MarkDirty(&en);  // the stamp is saved state (version / last-seen step)
            break;
          case EvictDecision::kKeep:
            break;
        }
      });
      for (const Owned& o : victims) {
        const K k = Traits::View(o);
        E* en = seg.Find(k, Traits::Hash(k));
        if (kept) {
          const float* row = RowIsReal(en->row) ? rows_.PeekRow(en->row, scratch.data()) : default_.data();
          kept->keys.push_back(o);
          kept->values.insert(kept->values.end(), row, row + dim_);
        }
        EraseLocked(seg, en);
      }
      erased += victims.size();
    }
    evicted_.fetch_add(erased, std::memory_order_relaxed);
    return erased;
  }

  // Drops every key, row, dirty and deleted mark (before a restore), and an
  // export in flight: its writer died (a restore never runs beside a save of
  // the same process), e.g. a chief killed mid-save whose parameter servers
  // live on; a writer still streaming it keeps its own reference.
  void Clear() {
    {
      std::lock_guard<std::mutex> l(export_mu_);
      open_.reset();
    }
    for (int s = 0; s < nseg_; ++s) {
      Seg& seg = index_.segment(s);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      seg.ForEach([&](const E& en) {
        if (RowIsReal(en.row)) rows_.Free(en.row);
      });
      seg.Clear();
      zero_rows_[s] = 0;
      admission_->ClearSegment(s);
    }
  }

  // ---- export / import -------------------------------------------------------

  // Visits every key of segment s under its shared lock:
  // fn(const ExportedKey<K>&, const float* row_or_null). Rows are full stride.
  // A tiered store reads the segment's cold rows in groups, each sorted by
  // disk location (PeekMany), into a bounded buffer; they are not cached.
  template <typename Fn>
  void ForEachInSegment(int s, const Fn& fn) const {
    const Seg& seg = index_.segment(s);
    if constexpr (Store::kAllResident) {
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      seg.ForEach([&](const E& en) {
        bool adm = RowIsReal(en.row);
        ExportedKey<K> x{Traits::Load(en.key), adm, adm ? rows_.Version(en.row) : -1,
                         static_cast<int64_t>(en.freq()), adm ? -1 : FilteredReference(en.row)};
        fn(x, adm ? rows_.Row(en.row) : nullptr);
      });
    } else {
      constexpr size_t kGroup = 4096;
      const int stride = this->stride();
      std::vector<ExportedKey<K>> xs;
      std::vector<uint32_t> rows;
      std::vector<float> buf(kGroup * static_cast<size_t>(stride));
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      xs.reserve(seg.size());
      rows.reserve(seg.size());
      seg.ForEach([&](const E& en) {
        bool adm = RowIsReal(en.row);
        xs.push_back({Traits::Load(en.key), adm, adm ? rows_.Version(en.row) : -1, static_cast<int64_t>(en.freq()),
                      adm ? -1 : FilteredReference(en.row)});
        rows.push_back(adm ? en.row : kNoRow);
      });
      std::vector<uint32_t> group;
      std::vector<size_t> at;
      for (size_t lo = 0; lo < xs.size(); lo += kGroup) {
        const size_t hi = std::min(xs.size(), lo + kGroup);
        group.clear();
        at.assign(hi - lo, 0);
        for (size_t i = lo; i < hi; ++i)
          if (rows[i] != kNoRow) {
            at[i - lo] = group.size();
            group.push_back(rows[i]);
          }
        rows_.PeekMany(group.data(), group.size(), buf.data());
        for (size_t i = lo; i < hi; ++i)
          fn(xs[i], rows[i] != kNoRow ? buf.data() + at[i - lo] * stride : nullptr);
      }
    }
  }
  int num_segments() const { return nseg_; }

  // Visits every key once, each call under its segment's shared lock:
  // fn(const ExportedKey<K>&, const float* row_or_null), rows at least the
  // export's stride (a widening meanwhile hands wider rows). All-DRAM:
  // segment by segment (ForEachInSegment). Tiered: segment by segment the
  // filtered keys and the rows in DRAM, then the cold rows in the order of
  // the tier file, read in long spans (ForEachColdKey). So the order of the
  // keys is not a contract: readers of a full look keys up.
  template <typename Fn>
  void ForEachKey(const Fn& fn) const {
    if constexpr (Store::kAllResident) {
      for (int s = 0; s < nseg_; ++s) ForEachInSegment(s, fn);
    } else {
      ForEachColdKey(fn);
    }
  }

  // Reads keys' current state (for a sealed snapshot's dirty keys). For each
  // key: present[i], admitted[i], version (the raw slot: evict_policy.h;
  // -1 for filtered keys) / freq, and its full row in
  // rows[i*stride] when admitted (zeros otherwise); rows may be null. `seen`
  // (optional) gets a filtered key's last-seen step (-1 unknown or admitted).
  void Read(const K* keys, int64_t n, int stride, uint8_t* present, uint8_t* admitted, int64_t* versions,
            int64_t* freqs, float* rows, int64_t* seen = nullptr) const {
    Scratch scratch(this);
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = Traits::Hash(keys[i]);
      const Seg& seg = index_.SegmentFor(h);
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      const E* en = seg.Find(keys[i], h);
      present[i] = en != nullptr;
      admitted[i] = en && RowIsReal(en->row);
      versions[i] = admitted[i] ? rows_.Version(en->row) : -1;
      freqs[i] = en ? en->freq() : 0;
      if (seen) seen[i] = (en && !admitted[i]) ? FilteredReference(en->row) : -1;
      if (!rows) continue;  // metadata only
      if (admitted[i])
        std::memcpy(rows + i * stride, rows_.PeekRow(en->row, scratch.data()), stride * sizeof(float));
      else
        std::memset(rows + i * stride, 0, stride * sizeof(float));
    }
  }

  // Copy-on-write of another table's values (a reference model kept beside a
  // trained one: evstore_app/job/reference.py). For each of `keys` this table
  // holds no row of, imports the embedding an inference lookup of `src` reads
  // now (its row, or src's default value for a key it holds no row of), as
  // a never-updated row (version -1, frequency 0, not dirty); a key this
  // table holds keeps its row, so only the first call for a key copies.
  // Returns how many keys were copied. Reads src under its segment locks;
  // the caller serialises calls on this table (a check, then an import).
  template <typename Src>
  int64_t KeepFrom(const Src& src, const K* keys, int64_t n) {
    if (src.dim() != dim_)
      throw std::invalid_argument("the source table's dim " + std::to_string(src.dim()) + " is not " +
                                  std::to_string(dim_));
    static const std::vector<int> kNoSlots;
    std::vector<float> row(src.stride());
    const int64_t never = -1, zero = 0;
    int64_t copied = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t h = Traits::Hash(keys[i]);
      {
        const Seg& seg = index_.SegmentFor(h);
        std::shared_lock<std::shared_mutex> lock(seg.mu);
        const E* en = seg.Find(keys[i], h);
        if (en && RowIsReal(en->row)) continue;
      }
      uint8_t present, admitted;
      int64_t version, freq;
      src.Read(keys + i, 1, src.stride(), &present, &admitted, &version, &freq, row.data());
      const float* value = admitted ? row.data() : src.default_value().data();
      ImportRows(keys + i, 1, value, dim_, nullptr, 0, kNoSlots, &never, &zero, /*mark_dirty=*/false);
      ++copied;
    }
    return copied;
  }

  // Upserts admitted keys. Key i's embedding is at values + i*values_stride;
  // its slot c at slots + i*slots_stride + c*dim, written to the table row at
  // slot_offsets[c] (from EnsureSlots). Sets version (raw slot value,
  // evict_policy.h) and frequency, and advances the clock to the newest step
  // the versions name. Reads the caller's buffers in place (a restore makes
  // no staging copy).
  void ImportRows(const K* keys, int64_t n, const float* values, int64_t values_stride, const float* slots,
                  int64_t slots_stride, const std::vector<int>& slot_offsets, const int64_t* versions,
                  const int64_t* freqs, bool mark_dirty, const ParallelFor& pf = SerialFor) {
    ImportRows(keys, n, values, values_stride, slots, slots_stride, dim_, slot_offsets, versions, freqs,
               mark_dirty, pf);
  }
  // Same, with slot c of key i at slots + i*slots_stride + c*slot_stride
  // (slot-major chunks from a checkpoint: slot_stride = n*dim, slots_stride = dim).
  //
  // A batch: the keys are grouped by segment (Index::Group keeps their order
  // within a segment, so a key given twice ends with its last row) and each
  // segment's part is written under its lock taken once, segments through
  // `pf`. Per part, pass 1 finds or adds the entries (index prefetched ahead)
  // and notes the rows; the keys without one are admitted together (one
  // AllocateMany; a tier takes their slots in the same FaultMany as the
  // part's cold rows); pass 2 resolves every row and prefetches it; pass 3
  // copies. A serving table's publish upserts a delta this way under its
  // write lock (serving_loader/publisher.py). At most kImportPiece keys are
  // grouped at once, so a tier holds at most that many rows of one segment
  // beyond its budget while the lock is held (a one-segment table included).
  void ImportRows(const K* keys, int64_t n, const float* values, int64_t values_stride, const float* slots,
                  int64_t slots_stride, int64_t slot_stride, const std::vector<int>& slot_offsets,
                  const int64_t* versions, const int64_t* freqs, bool mark_dirty, const ParallelFor& pf = SerialFor) {
    for (int64_t b = 0; b < n; b += kImportPiece) {
      const int64_t m = std::min(kImportPiece, n - b);
      ImportPiece(keys + b, m, values + b * values_stride, values_stride,
                  slot_offsets.empty() ? slots : slots + b * slots_stride, slots_stride, slot_stride, slot_offsets,
                  versions + b, freqs + b, mark_dirty, pf);
    }
  }

  // Upserts counted-but-not-admitted keys with their frequencies. A key that
  // is already admitted stays admitted (only its frequency is set), unless
  // `demote` (applying a delta in which the key was evicted and came back
  // unadmitted): then its row is freed. `seen` (optional) restores a key left
  // unadmitted's last-seen step (-1 unknown; evict_policy.h).
  void ImportFiltered(const K* keys, int64_t n, const int64_t* freqs, bool mark_dirty, bool demote = false,
                      const int64_t* seen = nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = Traits::Hash(keys[i]);
      Seg& seg = index_.SegmentFor(h);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.FindOrAdd(keys[i], h);
      if (demote && RowIsReal(en->row)) {
        if (rows_.RowIsZero(en->row, dim_)) --ZeroCount(seg);
        rows_.Free(en->row);
        en->row = kNoRow;
        seg.adjust_admitted(-1);
      }
      if (seen && !RowIsReal(en->row)) en->row = FilteredMark(seen[i]);
      en->set_freq(static_cast<uint64_t>(freqs[i] < 0 ? 0 : freqs[i]));
      if (mark_dirty) seg.MarkDirty(en);
    }
  }

  // ---- two-phase export ----------------------------------------------------

  // Seals the open dirty and deleted sets into a snapshot and starts new ones.
  // Throws std::logic_error if a snapshot is already open.
  std::shared_ptr<const Snapshot> BeginExport() {
    std::lock_guard<std::mutex> l(export_mu_);
    if (open_) throw std::logic_error("an export is already in flight (commit or abort it first)");
    auto snap = std::make_shared<Snapshot>();
    snap->id = ++next_snapshot_id_;
    for (int s = 0; s < nseg_; ++s) {
      Seg& seg = index_.segment(s);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      for (Owned& o : seg.dirty) {
        const K k = Traits::View(o);
        E* en = seg.Find(k, Traits::Hash(k));
        if (en && en->dirty()) {
          en->freq_dirty &= ~E::kDirtyBit;
          snap->dirty.push_back(std::move(o));
        }
      }
      std::vector<Owned>().swap(seg.dirty);
      if (CountingBloom* b = admission_->mutable_bloom()) b->SealDirty(s, &snap->bloom_blocks);
      snap->deleted.insert(snap->deleted.end(), seg.deleted.begin(), seg.deleted.end());
      seg.deleted.clear();
    }
    open_ = snap;
    return snap;
  }

  // Drops the open snapshot: its changes are durable elsewhere.
  void Commit(uint64_t id) {
    std::lock_guard<std::mutex> l(export_mu_);
    CheckOpen(id);
    open_.reset();
  }

  // Merges the open snapshot back into the open sets: the next export carries
  // every change the failed one held.
  void Abort(uint64_t id) {
    std::lock_guard<std::mutex> l(export_mu_);
    CheckOpen(id);
    for (const Owned& o : open_->dirty) {
      const K k = Traits::View(o);
      uint64_t h = Traits::Hash(k);
      Seg& seg = index_.SegmentFor(h);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(k, h);
      if (en) seg.MarkDirty(en);  // erased since: already in the open deleted set
    }
    for (const Owned& o : open_->deleted) {
      const K k = Traits::View(o);
      uint64_t h = Traits::Hash(k);
      Seg& seg = index_.SegmentFor(h);
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(k, h);
      if (en) seg.MarkDirty(en);  // re-inserted since: the next export upserts it too
      seg.deleted.insert(o);
    }
    if (CountingBloom* bloom = admission_->mutable_bloom()) {
      for (int64_t b : open_->bloom_blocks) {
        std::unique_lock<std::shared_mutex> lock(index_.segment(bloom->SegmentOfBlock(b)).mu);
        bloom->MarkBlockDirty(b);
      }
    }
    open_.reset();
  }

  // Bloom counter block `id` (filter_policy.h) into out[0, kBlock), under its
  // segment's lock; returns whether any counter is non-zero. Needs a Bloom filter.
  bool ReadBloomBlock(int64_t id, uint8_t* out) const {
    const CountingBloom* bloom = admission_->bloom();
    std::shared_lock<std::shared_mutex> lock(index_.segment(bloom->SegmentOfBlock(id)).mu);
    return bloom->ReadBlock(id, out);
  }
  // Overwrites Bloom counter block `id` (a restore); throws std::out_of_range
  // for an id outside the filter.
  void WriteBloomBlock(int64_t id, const uint8_t* in) {
    CountingBloom* bloom = admission_->mutable_bloom();
    if (id < 0 || id >= bloom->num_blocks()) throw std::out_of_range("bloom block id out of range");
    std::unique_lock<std::shared_mutex> lock(index_.segment(bloom->SegmentOfBlock(id)).mu);
    bloom->WriteBlock(id, in);
  }
  // Sizes every segment for `total_keys` keys in the whole table (spread
  // evenly, with 10% slack), so a bulk import does not grow them step by step.
  void Reserve(int64_t total_keys) { index_.Reserve(total_keys); }

  // The open snapshot with this id (for a writer streaming it out).
  std::shared_ptr<const Snapshot> OpenSnapshot(uint64_t id) const {
    std::lock_guard<std::mutex> l(export_mu_);
    CheckOpen(id);
    return open_;
  }
  bool export_in_flight() const {
    std::lock_guard<std::mutex> l(export_mu_);
    return open_ != nullptr;
  }

  // ---- stats -------------------------------------------------------------------

  // `filtered` is exact for keys with an entry; with a Bloom filter it adds an
  // estimate of the distinct keys counted in the filter and not admitted
  // (distinct keys in the filter minus admissions through it, floored at 0).
  TableStats Stats() const {
    TableStats st;
    double bloom_distinct = 0;
    const bool count_outside = has_bloom();
    for (int s = 0; s < nseg_; ++s) {
      const Seg& seg = index_.segment(s);
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      st.size += seg.size();
      st.admitted += seg.admitted();
      st.index_bytes += seg.bytes();
      st.dirty += seg.dirty.size();
      st.deleted += seg.deleted.size();
      st.zero_rows += zero_rows_[s];
      if (count_outside) bloom_distinct += admission_->DistinctEstimate(s);
    }
    st.filtered = st.size - st.admitted;
    if (count_outside)
      st.filtered += std::max<int64_t>(0, std::llround(bloom_distinct) - bloom_admitted_.load());
    st.filter_bytes = admission_->bytes();
    st.evicted = evicted_.load();
    st.free_rows = rows_.free_rows();
    st.meta_bytes = rows_.version_bytes();
    st.row_bytes = rows_.bytes() - st.meta_bytes;
    const TierStats tier = rows_.tier_stats();
    st.cache_hits = tier.hits;
    st.cache_misses = tier.misses;
    st.cache_rows = tier.resident;
    st.disk_bytes = tier.disk_bytes;
    st.cache_capacity = tier.budget_rows;
    return st;
  }
  // The row store's cache figures (all zero for the all-DRAM store).
  TierStats tier_stats() const { return rows_.tier_stats(); }
  // The end of a bulk load or restore: a tier writes the rows it holds in
  // DRAM only (TieredStore::WriteNewRows); nothing for the all-DRAM store.
  // The caller holds no segment lock.
  void WriteNewRows() {
    if constexpr (!Store::kAllResident) rows_.WriteNewRows();
  }
  const Store& store() const { return rows_; }
  Store& store() { return rows_; }
  int64_t size() const {
    int64_t n = 0;
    for (int s = 0; s < nseg_; ++s) {
      std::shared_lock<std::shared_mutex> lock(index_.segment(s).mu);
      n += index_.segment(s).admitted();
    }
    return n;
  }

 private:
  using Grouping = typename Idx::Grouping;
  using OrderedGrouping = typename Idx::OrderedGrouping;

  // ForEachKey over a tiered store (its ColdStream, tiered_store.h).
  //   Pass 1, each segment under its shared lock: filtered keys and rows in
  //   DRAM (or never written) are visited at once; a cold row's key (owned),
  //   row id and disk record are kept (16 bytes a cold row for int64 and
  //   string keys, freed at the end).
  //   Pass 2: the kept rows sorted by record, read in spans of up to
  //   kStreamBytes of the file (gaps of dead or DRAM rows' records up to
  //   kGapBytes read through, one read per run) holding no lock, by a
  //   SpanReader thread one span ahead (span_reader.h: the reads overlap the
  //   visits, which write the checkpoint); then, per segment under its
  //   shared lock, each key found again and visited with its span bytes if
  //   its row is still that cold record (ColdAt: no extent is reused while
  //   the stream is open, so those are the record's bytes), else with its
  //   current row (PeekRow: it moved, was widened, or the key's row changed).
  //   A key erased since pass 1 is skipped, as a key erased between
  //   segments of ForEachInSegment's visit would be.
  // Every row is a value it had during the visit, never torn; the version and
  // frequency are read with it.
  static constexpr size_t kStreamBytes = size_t{16} << 20;
  static constexpr size_t kGapBytes = size_t{64} << 10;
  // Pass 2 prefetches a row's metadata (version, slot, location) this many
  // keys ahead: nearer than the index's entry (Idx::PrefetchAhead), as it
  // needs one load, not two.
  static constexpr int64_t kMetaAhead = 8;
  struct ColdKey {
    Owned key;
    uint32_t loc, row;
  };
  template <typename Fn>
  void ForEachColdKey(const Fn& fn) const {
    typename Store::ColdStream stream(rows_);
    std::vector<ColdKey> cold;
    std::vector<float> scratch;
    uint64_t epoch = 0;
    int stride = 0;
    for (int s = 0; s < nseg_; ++s) {
      const Seg& seg = index_.segment(s);
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      if (s == 0) {
        epoch = rows_.layout_epoch();
        stride = rows_.stride();
      }
      const bool keep = rows_.layout_epoch() == epoch;  // a widening since segment 0: this segment's rows now
      scratch.resize(rows_.stride());
      seg.ForEach([&](const E& en) {
        const bool adm = RowIsReal(en.row);
        uint32_t loc;
        if (adm && keep && rows_.ColdAt(en.row, &loc)) {
          cold.push_back({Traits::OwnStored(en.key), loc, en.row});
          return;
        }
        ExportedKey<K> x{Traits::Load(en.key), adm, adm ? rows_.Version(en.row) : -1,
                         static_cast<int64_t>(en.freq()), adm ? -1 : FilteredReference(en.row)};
        fn(x, adm ? rows_.PeekRow(en.row, scratch.data()) : nullptr);
      });
    }
    if (cold.empty()) return;
    std::sort(cold.begin(), cold.end(), [](const ColdKey& a, const ColdKey& b) { return a.loc < b.loc; });
    const size_t rb = static_cast<size_t>(RecordBytes(stride)), n = cold.size();
    const size_t window = std::max<size_t>(1, kStreamBytes / rb), gap = kGapBytes / rb;
    // Spans of at most `window` records from a kept row's record; in each,
    // runs with gaps of at most `gap` records, one read each.
    using Reader = SpanReader<typename Store::ColdStream>;
    std::vector<size_t> span_at;  // span k is cold[span_at[k], span_at[k + 1])
    std::vector<std::vector<typename Reader::Run>> runs;
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && cold[j].loc - cold[i].loc < window) ++j;
      span_at.push_back(i);
      runs.emplace_back();
      for (size_t a = i; a < j;) {
        size_t b = a + 1;
        while (b < j && cold[b].loc - cold[b - 1].loc - 1 <= gap) ++b;
        runs.back().push_back({cold[a].loc, cold[b - 1].loc - cold[a].loc + 1,
                               static_cast<size_t>(cold[a].loc - cold[i].loc) * stride});
        a = b;
      }
      i = j;
    }
    span_at.push_back(n);
    Reader reader(stream, epoch, window * static_cast<size_t>(stride), std::move(runs));
    Grouping g;
    std::vector<K> span_keys;
    for (size_t sp = 0; sp + 1 < span_at.size(); ++sp) {
      const size_t i = span_at[sp], j = span_at[sp + 1];
      const uint32_t base = cold[i].loc;
      bool read = false;
      const float* buf = reader.Next(&read);
      // The span's keys by segment, each segment locked once, and found again
      // as a batch lookup is (the index's prefetch pipeline, and each row's
      // metadata ahead): at random over the index, each key's probe would
      // otherwise wait for two cache misses in turn.
      span_keys.resize(j - i);
      for (size_t k = i; k < j; ++k) span_keys[k - i] = Traits::View(cold[k].key);
      index_.Group(span_keys.data(), static_cast<int64_t>(j - i), &g);
      for (int s = 0; s < nseg_; ++s) {
        const int64_t lo = g.start[s], hi = g.start[s + 1];
        if (lo == hi) continue;
        const Seg& seg = index_.segment(s);
        std::shared_lock<std::shared_mutex> lock(seg.mu);
        const bool same = read && rows_.layout_epoch() == epoch;
        scratch.resize(rows_.stride());
        for (int64_t q = lo; q < hi; ++q) {
          Idx::PrefetchAhead(seg, g, span_keys.data(), q, hi);
          if (q + kMetaAhead < hi) rows_.PrefetchMeta(cold[i + g.order[q + kMetaAhead]].row);
          const uint32_t p = g.order[q];
          const ColdKey& c = cold[i + p];
          const K key = span_keys[p];
          const E* en = seg.Find(key, g.hash[p]);
          if (!en) continue;  // erased since pass 1
          const bool adm = RowIsReal(en->row);
          ExportedKey<K> x{key, adm, adm ? rows_.Version(en->row) : -1, static_cast<int64_t>(en->freq()),
                           adm ? -1 : FilteredReference(en->row)};
          if (!adm) {
            fn(x, nullptr);
            continue;
          }
          uint32_t loc;
          const bool as_read = same && en->row == c.row && rows_.ColdAt(c.row, &loc) && loc == c.loc;
          fn(x, as_read ? buf + static_cast<size_t>(c.loc - base) * stride : rows_.PeekRow(en->row, scratch.data()));
        }
      }
    }
  }

  // A row-sized buffer for PeekRow (row_store.h), allocated only for a store
  // whose rows may be off DRAM.
  struct Scratch {
    explicit Scratch(const Table* t) {
      if constexpr (!Store::kAllResident) buf.resize(t->stride());
    }
    float* data() { return buf.data(); }
    std::vector<float> buf;
  };
  // A pass-1 entry without a row, for pass 2 of FindOrInsert.
  struct Pending {
    int64_t pos;
    E* en;
    uint64_t rehashes;  // segment's rehash count when `en` was taken
  };
  // Marks an entry chosen for admission while rows are allocated in bulk.
  static constexpr uint32_t kAdmitting = kNoRowId - 1;
  static_assert(kAdmitting == kNoRowMark - 1, "the admitting mark is the one evict_policy.h leaves free");

  // Keys ImportRows groups at once (its piece of a larger batch).
  static constexpr int64_t kImportPiece = 16384;

  // ImportRows of one piece (at most kImportPiece keys): see ImportRows.
  void ImportPiece(const K* keys, int64_t n, const float* values, int64_t values_stride, const float* slots,
                   int64_t slots_stride, int64_t slot_stride, const std::vector<int>& slot_offsets,
                   const int64_t* versions, const int64_t* freqs, bool mark_dirty, const ParallelFor& pf) {
    if (n <= 0) return;
    Grouping g;
    index_.Group(keys, n, &g);
    int64_t newest = -1;
    for (int64_t i = 0; i < n; ++i) newest = std::max(newest, VersionReference(versions[i]));
    AdvanceClock(newest);
    const int stride = this->stride();
    index_.template ForEachSegmentOfBatch<std::unique_lock<std::shared_mutex>>(g, n, 150, pf, [&](Seg& seg, int64_t lo,
                                                                                                  int64_t hi) {
      thread_local std::vector<uint32_t> rows;     // row per position
      thread_local std::vector<uint32_t> freq;     // the entry's frequency per position (the cache hint)
      thread_local std::vector<float*> dst;        // resolved row per position
      thread_local std::vector<Pending> pending;   // positions whose key had no row
      thread_local std::vector<Pending> admitted;  // one per key admitted here (its first position)
      thread_local std::vector<uint32_t> fresh;    // their rows
      rows.resize(hi - lo);
      freq.resize(hi - lo);
      dst.resize(hi - lo);
      pending.clear();
      admitted.clear();
      // Pass 1: entries, frequencies, dirty marks; rows noted (a key without
      // one is marked kAdmitting once, however often the piece names it).
      size_t admit = 0;
      for (int64_t j = lo; j < hi; ++j) {
        Idx::PrefetchAhead(seg, g, keys, j, hi);
        const uint32_t i = g.order[j];
        E* en = seg.FindOrAdd(keys[i], g.hash[i]);
        en->set_freq(static_cast<uint64_t>(freqs[i] < 0 ? 0 : freqs[i]));
        freq[j - lo] = en->freq();
        if (mark_dirty) seg.MarkDirty(en);
        if (RowIsReal(en->row)) {
          rows[j - lo] = en->row;
          __builtin_prefetch(&rows_.Version(en->row));
          continue;
        }
        if (en->row != kAdmitting) {
          en->row = kAdmitting;
          ++admit;
        }
        pending.push_back({j, en, seg.rehashes()});
      }
      // Admissions: rows allocated together (entries found again if the
      // segment rehashed since pass 1 took them).
      if (admit) {
        fresh.resize(admit);
        rows_.AllocateMany(admit, fresh.data());
        size_t next = 0;
        for (Pending& p : pending) {
          if (p.rehashes != seg.rehashes()) {
            const uint32_t i = g.order[p.pos];
            p.en = seg.Find(keys[i], g.hash[i]);
            p.rehashes = seg.rehashes();
          }
          if (p.en->row == kAdmitting) {
            const uint32_t r = fresh[next++];
            rows_.Bind(r, index_.IndexOf(seg));
            rows_.Hint(r, p.en->freq());
            p.en->row = r;
            admitted.push_back(p);
          }
          rows[p.pos - lo] = p.en->row;
        }
      }
      // Pass 2: a tier makes the part's rows resident together (cold ones
      // read in disk order, new ones given slots); every row is resolved and
      // prefetched, and the admitted ones initialised.
      if constexpr (!Store::kAllResident) rows_.FaultMany(rows.data(), hi - lo);
      for (int64_t j = lo; j < hi; ++j) {
        dst[j - lo] = rows_.Row(rows[j - lo]);
        rows_.PrefetchRow(dst[j - lo], stride);
      }
      for (const Pending& p : admitted) InitRow(seg, p.en, rows[p.pos - lo], dst[p.pos - lo]);
      // Pass 3: the rows written, versions set, zero rows counted.
      int64_t zero_delta = 0;
      for (int64_t j = lo; j < hi; ++j) {
        const uint32_t i = g.order[j];
        const uint32_t r = rows[j - lo];
        float* row = dst[j - lo];
        const bool was_zero = IsZeroRow(row, dim_);
        std::memcpy(row, values + i * values_stride, dim_ * sizeof(float));
        zero_delta += static_cast<int>(IsZeroRow(row, dim_)) - static_cast<int>(was_zero);
        for (size_t c = 0; c < slot_offsets.size(); ++c)
          std::memcpy(row + slot_offsets[c], slots + i * slots_stride + c * slot_stride, dim_ * sizeof(float));
        rows_.Version(r) = versions[i];
        rows_.Hint(r, freq[j - lo]);  // the imported frequency weighs in a tier's cache policy
      }
      if (zero_delta) ZeroCount(seg) += zero_delta;
    });
  }

  // A tiered store's rows of one segment's part of a batch, accessed
  // together (AccessMany); per thread, used only when rows may be off DRAM.
  struct TierPart {
    std::vector<uint32_t> rows;
    std::vector<uint32_t> freqs;     // each row's lookup count (FindOrInsert hints the tier with it)
    std::vector<int64_t> positions;  // each row's position in the batch (FindOrInsert)
    std::vector<float*> pointers;    // each row's slot, resolved by AccessMany
    void Clear() {
      rows.clear();
      freqs.clear();
      positions.clear();
    }
  };
  // This thread's TierPart. A caller takes it once per part and keeps the
  // reference: each call reaches the thread-local storage (in a shared
  // library, a __tls_get_addr call), which FindOrInsert made three times a
  // key.
  static TierPart& ThisTierPart() {
    thread_local TierPart p;
    return p;
  }

  // An output of at least kStreamOutBytes whose rows are whole, aligned cache
  // lines is written with streaming stores (StreamRowsOut).
  static constexpr int64_t kStreamOutBytes = int64_t{2} << 20;
  bool CanStreamOut(const float* out, int64_t n) const {
#if defined(__SSE2__)
    const int64_t row_bytes = static_cast<int64_t>(dim_) * sizeof(float);
    return row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0 && n * row_bytes >= kStreamOutBytes;
#else
    (void)out;
    (void)n;
    return false;
#endif
  }
  // CopyRowsOut with non-temporal stores, for an output CanStreamOut accepts.
  // Positions of one segment are scattered over the whole output (the batch
  // is grouped by segment), so each row written is a cache line at random in
  // an output larger than L2: an ordinary store first reads that line from
  // memory (read for ownership) and the copy waits on it. Streaming stores
  // write whole lines without reading them. The fence orders them before the
  // segment lock is released (they are weakly ordered).
  void StreamRowsOut(const Grouping& g, int64_t lo, int64_t hi, const std::vector<const float*>& src,
                     float* out) const {
#if defined(__SSE2__)
    const int64_t vecs = dim_ / 4;  // 16-byte pieces per row
    for (int64_t j = lo; j < hi; ++j) {
      const __m128i* s = reinterpret_cast<const __m128i*>(src[j - lo]);
      __m128i* d = reinterpret_cast<__m128i*>(out + static_cast<int64_t>(g.order[j]) * dim_);
      for (int64_t v = 0; v < vecs; v += 4) {
        const __m128i a = _mm_loadu_si128(s + v), b = _mm_loadu_si128(s + v + 1);
        const __m128i c = _mm_loadu_si128(s + v + 2), e = _mm_loadu_si128(s + v + 3);
        _mm_stream_si128(d + v, a);
        _mm_stream_si128(d + v + 1, b);
        _mm_stream_si128(d + v + 2, c);
        _mm_stream_si128(d + v + 3, e);
      }
    }
    _mm_sfence();
#else
    CopyRowsOut(g, lo, hi, src, out);
#endif
  }

  // Copies the rows noted for positions [lo, hi) to their output slots.
  // The rows of positions [lo, hi) into out: streamed when the batch's
  // output passed CanStreamOut (decided once per batch), else copied.
  void RowsOut(const Grouping& g, int64_t lo, int64_t hi, const std::vector<const float*>& src, float* out,
               bool stream) const {
    if (stream)
      StreamRowsOut(g, lo, hi, src, out);
    else
      CopyRowsOut(g, lo, hi, src, out);
  }
  void CopyRowsOut(const Grouping& g, int64_t lo, int64_t hi, const std::vector<const float*>& src,
                   float* out) const {
    for (int64_t j = lo; j < hi; ++j)
      std::memcpy(out + static_cast<int64_t>(g.order[j]) * dim_, src[j - lo], dim_ * sizeof(float));
  }

  // Gives a filtered key its row: embedding from the bank, slots from their
  // initial values, version = the encoded admission step (the clock). Caller holds the segment lock exclusively and
  // decides about the dirty mark (ImportRows with mark_dirty=false must not set it).
  void Admit(Seg& seg, E* en) { Admit(seg, en, rows_.Allocate()); }
  void Admit(Seg& seg, E* en, uint32_t r) {
    rows_.Bind(r, index_.IndexOf(seg));
    rows_.Hint(r, en->freq());
    InitRow(seg, en, r, rows_.Row(r));
  }
  // Admit's part after the store has the row resident at `row`: bank
  // embedding, initial slots, admission version; `en` owns row r.
  void InitRow(Seg& seg, E* en, uint32_t r, float* row) {
    const size_t b = Traits::BankHash(Traits::Load(en->key)) % bank_rows_;
    std::memcpy(row, bank_.data() + b * dim_, dim_ * sizeof(float));
    if (bank_zero_[b]) ++ZeroCount(seg);
    if (!slot_init_row_.empty())
      std::memcpy(row + dim_, slot_init_row_.data(), slot_init_row_.size() * sizeof(float));
    rows_.Version(r) = EncodeAdmission(clock());
    en->row = r;
    seg.adjust_admitted(1);
  }

  void EraseLocked(Seg& seg, E* en, bool track_deleted = true) {
    Owned k = Traits::OwnStored(en->key);
    if (RowIsReal(en->row)) {
      if (rows_.RowIsZero(en->row, dim_)) --ZeroCount(seg);
      rows_.Free(en->row);
      seg.adjust_admitted(-1);
    }
    seg.Erase(en);
    if (track_deleted) seg.deleted.insert(std::move(k));
  }

  // One lookup added to `en`'s frequency (saturating; the dirty bit kept) by
  // a reader holding its segment lock shared; returns the new frequency.
  static uint32_t CountLookup(E* en) {
    uint32_t old = __atomic_load_n(&en->freq_dirty, __ATOMIC_RELAXED), next;
    do {
      const uint32_t f = old & E::kFreqMask;
      next = (old & E::kDirtyBit) | (f == E::kFreqMask ? f : f + 1);
    } while (!__atomic_compare_exchange_n(&en->freq_dirty, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return next & E::kFreqMask;
  }

  // Zero-row counter of a segment; caller holds its lock (exclusive to write).
  int64_t& ZeroCount(const Seg& seg) { return zero_rows_[index_.IndexOf(seg)]; }

  int SlotIndexLocked(const std::string& name) const {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].first == name) return static_cast<int>(i);
    return -1;
  }
  void CheckOpen(uint64_t id) const {
    if (!open_ || open_->id != id)
      throw std::logic_error("no open export with id " + std::to_string(id));
  }

  const int dim_;
  Idx index_;
  const int nseg_;
  std::unique_ptr<AdmissionPolicy> admission_;
  std::atomic<int64_t> bloom_admitted_{0};  // admissions through an outside-index count
  std::atomic<int64_t> clock_{-1};
  std::atomic<int64_t> evicted_{0};
  std::vector<float> default_;
  std::vector<float> bank_;
  size_t bank_rows_ = 1;
  std::vector<uint8_t> bank_zero_;          // bank row r is all zero
  std::unique_ptr<int64_t[]> zero_rows_;    // [nseg]: zero rows per segment, under its lock
  Store rows_;
  mutable std::mutex slots_mu_;
  SlotSpecs slots_;
  std::vector<float> slot_init_row_;  // written under every segment lock
  mutable std::mutex export_mu_;
  std::shared_ptr<Snapshot> open_;
  uint64_t next_snapshot_id_ = 0;
};

}  // namespace evstore
