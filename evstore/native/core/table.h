// evstore::Table<K>: the EmbeddingVariable's storage. No TensorFlow here.
//
// Layout
//   segments_[S]  (S = 2^segments_log2, default 64) — the index, split by the top
//                 bits of the key hash. Each Segment (segment.h) is an open-
//                 addressing table with its own shared_mutex, its own growth, its
//                 own dirty list and deleted set.
//   arena_        (arena.h) — rows [embedding | optimizer slots] + versions, in
//                 blocks that never move; freed rows are recycled.
//   bank_         initializer bank [bank_rows, dim]: a new row's embedding is
//                 bank_[BankHash(key) % bank_rows] (DeepRec's trick: drawn once
//                 from the TF initializer, deterministic, lock-free).
//
// Key states
//   absent      not in the index (with a BloomFilter, a key that is counted
//               but not admitted is absent too: its count lives in bloom_).
//   filtered    in the index without a row (!RowIsReal(row)): counted, not
//               admitted, reads the default value, ignores gradients, costs
//               one index slot. Its `row` field holds its last-seen step.
//   admitted    has a row (row < 2^31); version slot = global step of its last
//               update, or (never updated) its encoded admission step.
//   Encodings of versions and last-seen steps: evict_policy.h.
//
// Admission (filter_policy.h): a key is admitted on the training lookup whose
// batch brings its count to min_freq: exact counts in the entry (CounterFilter,
// and min_freq = 1 for no filter), or a counting Bloom filter's estimate
// (BloomFilter: no index entry before admission; the admitted key's frequency
// starts from the estimate).
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
//   * Erasing a key puts it in its segment's `deleted` set; re-inserting it
//     takes it out again (it becomes dirty instead).
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
//   Lock order: slots_mu_ -> export_mu_ -> segments (ascending) -> arena.
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

#include "arena.h"
#include "evict_policy.h"
#include "filter_policy.h"
#include "hash.h"
#include "optimizers.h"
#include "parallel.h"
#include "segment.h"
#include "zero_rows.h"

namespace evstore {

struct TableConfig {
  int dim = 0;
  int segments_log2 = 6;
  std::vector<float> bank;           // bank_rows * dim; empty = zeros
  std::vector<float> default_value;  // dim; empty = zeros
  uint32_t min_freq = 1;             // admission threshold (1 = admit at first sight)
  BloomConfig bloom;                 // capacity > 0: count non-admitted keys in a Bloom filter
};

struct TableStats {
  int64_t size = 0;        // keys in the index (admitted + filtered)
  int64_t admitted = 0;    // keys with a row
  int64_t filtered = 0;    // counted, not admitted
  int64_t free_rows = 0;   // rows in the arena's free list
  int64_t index_bytes = 0; // segments: control bytes, entries, dirty lists, deleted sets
  int64_t meta_bytes = 0;  // per-row metadata (versions)
  int64_t row_bytes = 0;   // arena rows (embedding + slots)
  int64_t dirty = 0;       // entries in the open dirty lists (upper bound of dirty keys)
  int64_t deleted = 0;     // keys in the open deleted sets
  int64_t zero_rows = 0;   // admitted keys whose embedding is all zero (zero_rows.h)
  int64_t evicted = 0;     // keys erased by Evict since the table was created
  int64_t filter_bytes = 0;  // Bloom filter counters (0 without one)
};

// One exported key (full export or sealed snapshot readout).
template <typename K>
struct ExportedKey {
  K key;
  bool admitted;
  int64_t version;
  int64_t freq;
  int64_t seen = -1;  // filtered key: step last seen at (-1 unknown); admitted: -1
};

template <typename K>
class Table {
 public:
  using E = Entry<K>;
  static constexpr uint32_t kNoRow = RowArena::kNoRow;

  struct Snapshot {
    uint64_t id = 0;
    std::vector<K> dirty;
    std::vector<K> deleted;
    std::vector<int64_t> bloom_blocks;  // Bloom counter blocks raised (filter_policy.h)
  };

  explicit Table(TableConfig cfg)
      : dim_(cfg.dim),
        seg_bits_(CheckSegBits(cfg.segments_log2)),  // before the shift and the allocation below
        nseg_(1 << seg_bits_),
        min_freq_(cfg.min_freq < 1 ? 1 : cfg.min_freq),
        segments_(new Segment<K>[1 << seg_bits_]),
        arena_(cfg.dim) {
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
    if (cfg.bloom.capacity > 0) {
      if (min_freq_ > CountingBloom::kMaxCount)
        throw std::invalid_argument("a Bloom filter counts up to 255: min_freq must be <= 255, got " +
                                    std::to_string(min_freq_));
      bloom_ = std::make_unique<CountingBloom>(cfg.bloom, nseg_);
    }
  }

  int dim() const { return dim_; }
  uint32_t min_freq() const { return min_freq_; }
  bool has_bloom() const { return bloom_ != nullptr; }
  const CountingBloom* bloom() const { return bloom_.get(); }
  // Highest global step seen (-1: none yet); see evict_policy.h.
  int64_t clock() const { return clock_.load(std::memory_order_relaxed); }
  void AdvanceClock(int64_t step) {
    int64_t c = clock_.load(std::memory_order_relaxed);
    while (step > c && !clock_.compare_exchange_weak(c, step, std::memory_order_relaxed)) {
    }
  }
  // Sets the clock (a full restore: the saved table's clock, exactly).
  void SetClock(int64_t step) { clock_.store(step < -1 ? -1 : step, std::memory_order_relaxed); }
  void set_min_freq(uint32_t f) { min_freq_ = f < 1 ? 1 : f; }
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
      // New memory for wider rows is obtained before any segment lock is
      // taken (arena.h: PrepareWiden), so lookups continue meanwhile.
      int new_stride = dim_ * (1 + static_cast<int>(slots_.size() + missing.size()));
      std::unique_ptr<RowArena::Widened> prepared;
      if (!missing.empty()) prepared = arena_.PrepareWiden(new_stride);
      // Rows and the slot-init row change only with every segment lock held.
      std::vector<std::unique_lock<std::shared_mutex>> locks;
      locks.reserve(nseg_);
      for (int i = 0; i < nseg_; ++i) locks.emplace_back(segments_[i].mu);
      for (const auto& s : specs) {
        int idx = SlotIndexLocked(s.first);
        if (idx >= 0) slots_[idx].second = s.second;
      }
      if (!missing.empty()) {
        std::vector<float> tail;
        for (const auto& s : missing) tail.insert(tail.end(), dim_, s.second);
        arena_.Relayout(new_stride, tail, prepared.get());
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
  // Floats per row: dim * (1 + number of slots).
  int stride() const {
    std::lock_guard<std::mutex> l(slots_mu_);
    return dim_ * (1 + static_cast<int>(slots_.size()));
  }

  // ---- lookups -------------------------------------------------------------

  // A caller-given occurrence count as a saturating frequency increment.
  static uint32_t Occurrences(int64_t c) {
    return c <= 0 ? 0u : (c >= 0x7FFFFFFF ? 0x7FFFFFFFu : static_cast<uint32_t>(c));
  }

  // Read-only: out[i] = row of keys[i] if admitted, else the default value.
  // Never inserts, never counts.
  void Find(const K* keys, int64_t n, float* out, const ParallelFor& pf) const {
    Grouping g;
    GroupBySegment(keys, n, &g);
    ForEachSegmentOfBatch<std::shared_lock<std::shared_mutex>>(g, n, 60, pf, [&](Segment<K>& seg, int64_t lo,
                                                                                 int64_t hi) {
      thread_local std::vector<const float*> src;  // row per position, prefetched
      src.resize(hi - lo);
      for (int64_t j = lo; j < hi; ++j) {
        PrefetchAhead(seg, g, j, hi);
        uint32_t i = g.order[j];
        const E* en = seg.Find(keys[i], g.hash[i]);
        const float* p = (en && RowIsReal(en->row)) ? arena_.Row(en->row) : default_.data();
        arena_.PrefetchRow(p, dim_);
        src[j - lo] = p;
      }
      CopyRowsOut(g, lo, hi, src, out);
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
    Grouping g;
    GroupBySegment(keys, n, &g);
    const int64_t clock = this->clock();
    const uint32_t seen_mark = FilteredMark(clock);
    ForEachSegmentOfBatch<std::unique_lock<std::shared_mutex>>(g, n, 120, pf, [&](Segment<K>& seg, int64_t lo,
                                                                                  int64_t hi) {
      const int s = static_cast<int>(&seg - segments_.get());
      thread_local std::vector<const float*> src;  // row per position, prefetched
      thread_local std::vector<Pending> pending;    // positions whose key has no row yet
      thread_local std::vector<uint32_t> rows;
      src.resize(hi - lo);
      pending.clear();
      bool bloom_pending = false;
      // Pass 1: count every occurrence (inserting unseen keys, or counting
      // them in the Bloom filter), note rows.
      for (int64_t j = lo; j < hi; ++j) {
        PrefetchAhead(seg, g, j, hi);
        uint32_t i = g.order[j];
        E* en;
        if (bloom_) {
          en = seg.Find(keys[i], g.hash[i]);
          if (!en) {  // counted in the filter below (prefetched, so misses overlap)
            pending.push_back({j, nullptr, 0});
            bloom_pending = true;
            continue;
          }
        } else {
          en = FindOrAdd(seg, keys[i], g.hash[i]);
        }
        en->add_freq(counts ? Occurrences(counts[i]) : 1);
        MarkDirty(seg, en);
        if (RowIsReal(en->row)) {
          src[j - lo] = arena_.Row(en->row);
          arena_.PrefetchRow(src[j - lo], dim_);
        } else {
          pending.push_back({j, en, seg.rehashes()});
        }
      }
      // Pass 2a (Bloom): a key without an entry is admitted (entry + row)
      // once the filter's batch-complete estimate reaches min_freq.
      if (bloom_pending) {
        constexpr size_t kBloomAhead = 6;
        for (size_t q = 0; q < pending.size(); ++q) {
          if (q + kBloomAhead < pending.size() && !pending[q + kBloomAhead].en)
            bloom_->Prefetch(s, g.hash[g.order[pending[q + kBloomAhead].pos]]);
          if (!pending[q].en) {
            const uint32_t i = g.order[pending[q].pos];
            bloom_->Add(s, g.hash[i], counts ? Occurrences(counts[i]) : 1);
          }
        }
        for (const Pending& p : pending) {
          if (p.en) continue;
          uint32_t i = g.order[p.pos];
          E* en = seg.Find(keys[i], g.hash[i]);  // admitted by an earlier occurrence?
          if (!en) {
            uint32_t est = bloom_->Estimate(s, g.hash[i]);
            if (est < min_freq_) {
              src[p.pos - lo] = default_.data();
              continue;
            }
            en = FindOrAdd(seg, keys[i], g.hash[i]);
            en->set_freq(est);
            MarkDirty(seg, en);
            Admit(seg, en, arena_.Allocate());
            bloom_admitted_.fetch_add(1, std::memory_order_relaxed);
          }
          src[p.pos - lo] = arena_.Row(en->row);
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
          uint32_t i = g.order[p.pos];
          p.en = seg.Find(keys[i], g.hash[i]);
          p.rehashes = seg.rehashes();
        }
        if (p.en->row == kAdmitting || RowIsReal(p.en->row)) continue;
        if (p.en->freq() >= min_freq_) {
          p.en->row = kAdmitting;
          ++admit;
        } else {
          p.en->row = seen_mark;
        }
      }
      rows.resize(admit);
      if (admit) arena_.AllocateMany(admit, rows.data());
      size_t next = 0;
      for (const Pending& p : pending) {
        if (!p.en) continue;
        if (p.en->row == kAdmitting) Admit(seg, p.en, rows[next++]);
        src[p.pos - lo] = RowIsReal(p.en->row) ? arena_.Row(p.en->row) : default_.data();
      }
      CopyRowsOut(g, lo, hi, src, out);
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
    GroupBySegment(keys, n, &g);
    std::atomic<int64_t> applied{0};
    const int stride = this->stride();
    AdvanceClock(step);
    ForEachSegmentOfBatch<std::unique_lock<std::shared_mutex>>(g, n, 200, pf, [&](Segment<K>& seg, int64_t lo,
                                                                                  int64_t hi) {
      thread_local std::vector<E*> hit;  // entry per position (nullptr: absent or filtered)
      hit.resize(hi - lo);
      // Pass 1: resolve entries and prefetch their rows and versions (no
      // inserts, so entry pointers stay valid for pass 2).
      for (int64_t j = lo; j < hi; ++j) {
        PrefetchAhead(seg, g, j, hi);
        uint32_t i = g.order[j];
        E* en = seg.Find(keys[i], g.hash[i]);
        if (en && !RowIsReal(en->row)) en = nullptr;
        if (en) {
          arena_.PrefetchRow(arena_.Row(en->row), stride);
          __builtin_prefetch(&arena_.Version(en->row));
        }
        hit[j - lo] = en;
      }
      // Pass 2: fused update, version stamp, dirty mark.
      int64_t local = 0, zero_delta = 0;
      for (int64_t j = lo; j < hi; ++j) {
        E* en = hit[j - lo];
        if (!en) continue;
        float* row = arena_.Row(en->row);
        const bool was_zero = IsZeroRow(row, dim_);
        update(row, grads + static_cast<int64_t>(g.order[j]) * dim_);
        zero_delta += static_cast<int>(IsZeroRow(row, dim_)) - static_cast<int>(was_zero);
        arena_.Version(en->row) = step;
        MarkDirty(seg, en);
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
      uint64_t h = HashKey(keys[i]);
      Segment<K>& seg = segments_[SegmentOf(h)];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(keys[i], h);
      if (!en) continue;
      EraseLocked(seg, en, track_deleted);
      ++erased;
    }
    return erased;
  }

  // Erases every key for which pred(key, admitted, version, freq, row) is true
  // (version: the public one, -1 if never updated).
  // Used by eviction policies. Returns the number erased.
  template <typename Pred>
  int64_t EraseIf(const Pred& pred) {
    int64_t erased = 0;
    std::vector<K> victims;
    for (int s = 0; s < nseg_; ++s) {
      Segment<K>& seg = segments_[s];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      victims.clear();
      seg.ForEach([&](const E& en) {
        bool adm = RowIsReal(en.row);
        int64_t ver = adm ? PublicVersion(arena_.Version(en.row)) : -1;
        if (pred(en.key, adm, ver, static_cast<int64_t>(en.freq()), adm ? arena_.Row(en.row) : nullptr))
          victims.push_back(en.key);
      });
      for (K k : victims) EraseLocked(seg, seg.Find(k, HashKey(k)));
      erased += victims.size();
    }
    return erased;
  }

  // Evicts at global step `step` (advancing the clock to it) every key the
  // policy selects (evict_policy.h: Decide). Evicted keys are erased like
  // Erase does (rows to the free list, keys to the deleted set). Keys whose
  // age reference is unknown are stamped with `step` instead; an admitted
  // key's stamp changes its saved version, so it is marked dirty. Returns
  // the number of keys evicted.
  int64_t Evict(int64_t step, const EvictPolicy& policy) {
    AdvanceClock(step);
    if (!policy.any()) return 0;
    int64_t erased = 0;
    std::vector<K> victims;
    for (int s = 0; s < nseg_; ++s) {
      Segment<K>& seg = segments_[s];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      victims.clear();
      seg.ForEach([&](E& en) {
        const bool adm = RowIsReal(en.row);
        const int64_t ref = adm ? VersionReference(arena_.Version(en.row)) : FilteredReference(en.row);
        switch (Decide(policy, step, ref, adm ? arena_.Row(en.row) : nullptr, dim_)) {
          case EvictDecision::kEvict:
            victims.push_back(en.key);
            break;
          case EvictDecision::kStamp:
            if (adm) {
              arena_.Version(en.row) = EncodeAdmission(step);
            } else {
              en.row = FilteredMark(step);
            }
            MarkDirty(seg, &en);  // the stamp is saved state (version / last-seen step)
            break;
          case EvictDecision::kKeep:
            break;
        }
      });
      for (K k : victims) EraseLocked(seg, seg.Find(k, HashKey(k)));
      erased += victims.size();
    }
    evicted_.fetch_add(erased, std::memory_order_relaxed);
    return erased;
  }

  // Drops every key, row, dirty and deleted mark (before a restore).
  void Clear() {
    for (int s = 0; s < nseg_; ++s) {
      Segment<K>& seg = segments_[s];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      seg.ForEach([&](const E& en) {
        if (RowIsReal(en.row)) arena_.Free(en.row);
      });
      seg.Clear();
      zero_rows_[s] = 0;
      if (bloom_) bloom_->ClearSegment(s);
    }
  }

  // ---- export / import -------------------------------------------------------

  // Visits every key of segment s under its shared lock:
  // fn(const ExportedKey<K>&, const float* row_or_null). Rows are full stride.
  template <typename Fn>
  void ForEachInSegment(int s, const Fn& fn) const {
    const Segment<K>& seg = segments_[s];
    std::shared_lock<std::shared_mutex> lock(seg.mu);
    seg.ForEach([&](const E& en) {
      bool adm = RowIsReal(en.row);
      ExportedKey<K> x{en.key, adm, adm ? arena_.Version(en.row) : -1, static_cast<int64_t>(en.freq()),
                       adm ? -1 : FilteredReference(en.row)};
      fn(x, adm ? arena_.Row(en.row) : nullptr);
    });
  }
  int num_segments() const { return nseg_; }

  // Reads keys' current state (for a sealed snapshot's dirty keys). For each
  // key: present[i], admitted[i], version (the raw slot: evict_policy.h;
  // -1 for filtered keys) / freq, and its full row in
  // rows[i*stride] when admitted (zeros otherwise); rows may be null. `seen`
  // (optional) gets a filtered key's last-seen step (-1 unknown or admitted).
  void Read(const K* keys, int64_t n, int stride, uint8_t* present, uint8_t* admitted, int64_t* versions,
            int64_t* freqs, float* rows, int64_t* seen = nullptr) const {
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = HashKey(keys[i]);
      const Segment<K>& seg = segments_[SegmentOf(h)];
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      const E* en = seg.Find(keys[i], h);
      present[i] = en != nullptr;
      admitted[i] = en && RowIsReal(en->row);
      versions[i] = admitted[i] ? arena_.Version(en->row) : -1;
      freqs[i] = en ? en->freq() : 0;
      if (seen) seen[i] = (en && !admitted[i]) ? FilteredReference(en->row) : -1;
      if (!rows) continue;  // metadata only
      if (admitted[i])
        std::memcpy(rows + i * stride, arena_.Row(en->row), stride * sizeof(float));
      else
        std::memset(rows + i * stride, 0, stride * sizeof(float));
    }
  }

  // Upserts admitted keys. Key i's embedding is at values + i*values_stride;
  // its slot c at slots + i*slots_stride + c*dim, written to the table row at
  // slot_offsets[c] (from EnsureSlots). Sets version (raw slot value,
  // evict_policy.h) and frequency, and advances the clock to the newest step
  // the versions name. Reads the caller's buffers in place (a restore makes
  // no staging copy).
  void ImportRows(const K* keys, int64_t n, const float* values, int64_t values_stride, const float* slots,
                  int64_t slots_stride, const std::vector<int>& slot_offsets, const int64_t* versions,
                  const int64_t* freqs, bool mark_dirty) {
    ImportRows(keys, n, values, values_stride, slots, slots_stride, dim_, slot_offsets, versions, freqs,
               mark_dirty);
  }
  // Same, with slot c of key i at slots + i*slots_stride + c*slot_stride
  // (slot-major chunks from a checkpoint: slot_stride = n*dim, slots_stride = dim).
  void ImportRows(const K* keys, int64_t n, const float* values, int64_t values_stride, const float* slots,
                  int64_t slots_stride, int64_t slot_stride, const std::vector<int>& slot_offsets,
                  const int64_t* versions, const int64_t* freqs, bool mark_dirty) {
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = HashKey(keys[i]);
      Segment<K>& seg = segments_[SegmentOf(h)];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = FindOrAdd(seg, keys[i], h);
      if (!RowIsReal(en->row)) Admit(seg, en);
      float* dst = arena_.Row(en->row);
      const bool was_zero = IsZeroRow(dst, dim_);
      std::memcpy(dst, values + i * values_stride, dim_ * sizeof(float));
      ZeroCount(seg) += static_cast<int>(IsZeroRow(dst, dim_)) - static_cast<int>(was_zero);
      for (size_t c = 0; c < slot_offsets.size(); ++c)
        std::memcpy(dst + slot_offsets[c], slots + i * slots_stride + c * slot_stride, dim_ * sizeof(float));
      arena_.Version(en->row) = versions[i];
      AdvanceClock(VersionReference(versions[i]));
      en->set_freq(static_cast<uint64_t>(freqs[i] < 0 ? 0 : freqs[i]));
      if (mark_dirty) MarkDirty(seg, en);
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
      uint64_t h = HashKey(keys[i]);
      Segment<K>& seg = segments_[SegmentOf(h)];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = FindOrAdd(seg, keys[i], h);
      if (demote && RowIsReal(en->row)) {
        if (IsZeroRow(arena_.Row(en->row), dim_)) --ZeroCount(seg);
        arena_.Free(en->row);
        en->row = kNoRow;
        seg.adjust_admitted(-1);
      }
      if (seen && !RowIsReal(en->row)) en->row = FilteredMark(seen[i]);
      en->set_freq(static_cast<uint64_t>(freqs[i] < 0 ? 0 : freqs[i]));
      if (mark_dirty) MarkDirty(seg, en);
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
      Segment<K>& seg = segments_[s];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      for (K k : seg.dirty) {
        E* en = seg.Find(k, HashKey(k));
        if (en && en->dirty()) {
          en->freq_dirty &= ~E::kDirtyBit;
          snap->dirty.push_back(k);
        }
      }
      std::vector<K>().swap(seg.dirty);
      if (bloom_) bloom_->SealDirty(s, &snap->bloom_blocks);
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
    for (K k : open_->dirty) {
      uint64_t h = HashKey(k);
      Segment<K>& seg = segments_[SegmentOf(h)];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(k, h);
      if (en) MarkDirty(seg, en);  // erased since: already in the open deleted set
    }
    for (K k : open_->deleted) {
      uint64_t h = HashKey(k);
      Segment<K>& seg = segments_[SegmentOf(h)];
      std::unique_lock<std::shared_mutex> lock(seg.mu);
      E* en = seg.Find(k, h);
      if (en)
        MarkDirty(seg, en);  // re-inserted since: the next export upserts it
      else
        seg.deleted.insert(k);
    }
    for (int64_t b : open_->bloom_blocks) {
      std::unique_lock<std::shared_mutex> lock(segments_[bloom_->SegmentOfBlock(b)].mu);
      bloom_->MarkBlockDirty(b);
    }
    open_.reset();
  }

  // Bloom counter block `id` (filter_policy.h) into out[0, kBlock), under its
  // segment's lock; returns whether any counter is non-zero. Needs a Bloom filter.
  bool ReadBloomBlock(int64_t id, uint8_t* out) const {
    std::shared_lock<std::shared_mutex> lock(segments_[bloom_->SegmentOfBlock(id)].mu);
    return bloom_->ReadBlock(id, out);
  }
  // Overwrites Bloom counter block `id` (a restore); throws std::out_of_range
  // for an id outside the filter.
  void WriteBloomBlock(int64_t id, const uint8_t* in) {
    if (id < 0 || id >= bloom_->num_blocks()) throw std::out_of_range("bloom block id out of range");
    std::unique_lock<std::shared_mutex> lock(segments_[bloom_->SegmentOfBlock(id)].mu);
    bloom_->WriteBlock(id, in);
  }
  // Sizes every segment for `total_keys` keys in the whole table (spread
  // evenly, with 10% slack), so a bulk import does not grow them step by step.
  void Reserve(int64_t total_keys) {
    if (total_keys <= 0) return;
    const size_t per = static_cast<size_t>(total_keys / nseg_ + total_keys / nseg_ / 10 + 16);
    for (int s = 0; s < nseg_; ++s) {
      std::unique_lock<std::shared_mutex> lock(segments_[s].mu);
      segments_[s].Reserve(per);
    }
  }

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
    for (int s = 0; s < nseg_; ++s) {
      const Segment<K>& seg = segments_[s];
      std::shared_lock<std::shared_mutex> lock(seg.mu);
      st.size += seg.size();
      st.admitted += seg.admitted();
      st.index_bytes += seg.bytes();
      st.dirty += seg.dirty.size();
      st.deleted += seg.deleted.size();
      st.zero_rows += zero_rows_[s];
      if (bloom_) bloom_distinct += bloom_->DistinctEstimate(s);
    }
    st.filtered = st.size - st.admitted;
    if (bloom_) {
      st.filtered += std::max<int64_t>(0, std::llround(bloom_distinct) - bloom_admitted_.load());
      st.filter_bytes = bloom_->bytes();
    }
    st.evicted = evicted_.load();
    st.free_rows = arena_.free_rows();
    st.meta_bytes = arena_.version_bytes();
    st.row_bytes = arena_.bytes() - st.meta_bytes;
    return st;
  }
  int64_t size() const {
    int64_t n = 0;
    for (int s = 0; s < nseg_; ++s) {
      std::shared_lock<std::shared_mutex> lock(segments_[s].mu);
      n += segments_[s].admitted();
    }
    return n;
  }

 private:
  struct Grouping {
    std::vector<uint64_t> hash;
    std::vector<uint32_t> order;   // batch positions sorted by segment
    std::vector<int64_t> start;    // [nseg + 1]
  };

  static int CheckSegBits(int b) {
    if (b < 0 || b > 12) throw std::invalid_argument("segments_log2 must be in [0, 12]");
    return b;
  }
  // A pass-1 entry without a row, for pass 2 of FindOrInsert.
  struct Pending {
    int64_t pos;
    E* en;
    uint64_t rehashes;  // segment's rehash count when `en` was taken
  };
  // Marks an entry chosen for admission while rows are allocated in bulk.
  static constexpr uint32_t kAdmitting = RowArena::kNoRow - 1;

  static constexpr int kCtrlAhead = 16;  // positions ahead to prefetch control bytes
  static constexpr int kSlotAhead = 8;   // positions ahead to prefetch the matching entry

  static void PrefetchAhead(const Segment<K>& seg, const Grouping& g, int64_t j, int64_t hi) {
    if (j + kCtrlAhead < hi) seg.PrefetchCtrl(g.hash[g.order[j + kCtrlAhead]]);
    if (j + kSlotAhead < hi) seg.PrefetchSlot(g.hash[g.order[j + kSlotAhead]]);
  }

  // Runs fn(segment, lo, hi) for every segment that holds batch positions
  // [lo, hi) of g.order, segments in parallel, each under its lock (`Lock`:
  // shared for reads, unique for writes), taken once per batch.
  template <typename Lock, typename Fn>
  void ForEachSegmentOfBatch(const Grouping& g, int64_t n, int64_t ns_per_key, const ParallelFor& pf,
                             const Fn& fn) const {
    pf(nseg_, SegmentCost(n, ns_per_key), [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        int64_t lo = g.start[s], hi = g.start[s + 1];
        if (lo == hi) continue;
        Lock lock(segments_[s].mu);
        fn(segments_[s], lo, hi);
      }
    });
  }

  // Copies the rows noted for positions [lo, hi) to their output slots.
  void CopyRowsOut(const Grouping& g, int64_t lo, int64_t hi, const std::vector<const float*>& src,
                   float* out) const {
    for (int64_t j = lo; j < hi; ++j)
      std::memcpy(out + static_cast<int64_t>(g.order[j]) * dim_, src[j - lo], dim_ * sizeof(float));
  }

  int SegmentOf(uint64_t h) const { return seg_bits_ == 0 ? 0 : static_cast<int>(h >> (64 - seg_bits_)); }

  void GroupBySegment(const K* keys, int64_t n, Grouping* g) const {
    if (n > 0xFFFFFFFFll) throw std::invalid_argument("batch too large (more than 2^32 keys)");
    g->hash.resize(n);
    g->order.resize(n);
    g->start.assign(nseg_ + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      uint64_t h = HashKey(keys[i]);
      g->hash[i] = h;
      ++g->start[SegmentOf(h) + 1];
    }
    for (int s = 0; s < nseg_; ++s) g->start[s + 1] += g->start[s];
    std::vector<int64_t> pos(g->start.begin(), g->start.end() - 1);
    for (int64_t i = 0; i < n; ++i) g->order[pos[SegmentOf(g->hash[i])]++] = static_cast<uint32_t>(i);
  }
  int64_t SegmentCost(int64_t n, int64_t ns_per_key) const {
    return std::max<int64_t>(1, n * ns_per_key / nseg_);
  }

  void MarkDirty(Segment<K>& seg, E* en) {
    if (!en->dirty()) {
      en->freq_dirty |= E::kDirtyBit;
      seg.dirty.push_back(en->key);
    }
  }

  // The key's entry, inserted (counted 0, no row) if absent; a re-inserted key
  // leaves the deleted set. Caller holds the segment lock exclusively.
  E* FindOrAdd(Segment<K>& seg, K key, uint64_t h) {
    E* en = seg.Find(key, h);
    if (!en) {
      en = seg.InsertAbsent(key, h);
      if (!seg.deleted.empty()) seg.deleted.erase(key);
    }
    return en;
  }

  // Gives a filtered key its row: embedding from the bank, slots from their
  // initial values, version = the encoded admission step (the clock). Caller holds the segment lock exclusively and
  // decides about the dirty mark (ImportRows with mark_dirty=false must not set it).
  void Admit(Segment<K>& seg, E* en) { Admit(seg, en, arena_.Allocate()); }
  void Admit(Segment<K>& seg, E* en, uint32_t r) {
    float* row = arena_.Row(r);
    const size_t b = BankHash(en->key) % bank_rows_;
    std::memcpy(row, bank_.data() + b * dim_, dim_ * sizeof(float));
    if (bank_zero_[b]) ++ZeroCount(seg);
    if (!slot_init_row_.empty())
      std::memcpy(row + dim_, slot_init_row_.data(), slot_init_row_.size() * sizeof(float));
    arena_.Version(r) = EncodeAdmission(clock());
    en->row = r;
    seg.adjust_admitted(1);
  }

  void EraseLocked(Segment<K>& seg, E* en, bool track_deleted = true) {
    K k = en->key;
    if (RowIsReal(en->row)) {
      if (IsZeroRow(arena_.Row(en->row), dim_)) --ZeroCount(seg);
      arena_.Free(en->row);
      seg.adjust_admitted(-1);
    }
    seg.Erase(en);
    if (track_deleted) seg.deleted.insert(k);
  }

  // Zero-row counter of a segment; caller holds its lock (exclusive to write).
  int64_t& ZeroCount(const Segment<K>& seg) { return zero_rows_[&seg - segments_.get()]; }

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
  const int seg_bits_;
  const int nseg_;
  uint32_t min_freq_;
  std::unique_ptr<CountingBloom> bloom_;  // BloomFilter admission; null otherwise
  std::atomic<int64_t> bloom_admitted_{0};
  std::atomic<int64_t> clock_{-1};
  std::atomic<int64_t> evicted_{0};
  std::vector<float> default_;
  std::vector<float> bank_;
  size_t bank_rows_ = 1;
  std::vector<uint8_t> bank_zero_;          // bank row r is all zero
  std::unique_ptr<int64_t[]> zero_rows_;    // [nseg]: zero rows per segment, under its lock
  std::unique_ptr<Segment<K>[]> segments_;
  RowArena arena_;
  mutable std::mutex slots_mu_;
  SlotSpecs slots_;
  std::vector<float> slot_init_row_;  // written under every segment lock
  mutable std::mutex export_mu_;
  std::shared_ptr<Snapshot> open_;
  uint64_t next_snapshot_id_ = 0;
};

}  // namespace evstore
