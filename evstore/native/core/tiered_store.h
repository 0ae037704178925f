// TieredStore: a row store (row_store.h) whose rows live in a DRAM cache of
// bounded size over a record file on local disk (row_file.h). No TensorFlow.
//
// Layout
//   meta_     per row id, always in DRAM (RowMeta, 16 bytes, static_assert
//             below): the version, the DRAM slot holding the row (kNoSlot
//             when it is on disk only), the owning segment, flags (a disk copy
//             exists; the embedding was zero when written) and the row's heat
//             (cache_policy.h, from the table's frequency hint). Two-level
//             directory of 65,536-row chunks, never reallocated.
//   slots     the DRAM cache: `stride` floats per slot, in chunks of 4,096
//             slots that are never reallocated (except by Relayout), plus per
//             slot its row, weight (the policy's) and dirty byte (written
//             through Row() since loaded: a clean row with a disk copy is
//             dropped without a write).
//   file_     record r of RowFile = row r (row ids are dense: no disk index).
//   The budget: `dram_bytes` / (stride * 4 + slot bookkeeping) slots.
//
// Pinning (the contract's central invariant). Row(r) is called under the
// segment lock of the key owning r, and the row must stay resident until that
// lock is released. The store learns each row's owner from Bind(r, segment)
// (the table calls it when it admits a key). A slot's row may be evicted only
// by a thread holding the owner's segment lock exclusively: the faulting
// thread try-locks the candidate's owner (never blocking, so no lock-order
// cycle with threads waiting for the store's mutex) and skips candidates
// owned by the segment it holds itself (a table thread holds at most one
// segment lock when it touches rows; Relayout, under all of them, is the
// store's own). A candidate whose owner is locked by anyone is therefore
// pinned and skipped. When no candidate can be evicted (every other segment
// busy, or one batch touching more rows of one segment than the budget), the
// store takes a slot beyond the budget and gives it back at later faults:
// the budget is a target that one batch may overshoot, never a correctness
// limit.
//
// Lock-free hits: meta_[r].slot changes only while r's owner segment lock is
// held exclusively (eviction) or under the store mutex with the owner lock
// held (a fault by a reader holding it shared). A caller holding the owner
// lock therefore reads a stable slot, published with release/acquire.
//
// I/O outside the store mutex (mu_). A miss takes its slot under mu_ and
// reads the row into it without mu_, publishing meta_[r].slot only when the
// row is there; a victim chosen under mu_ is written back without mu_ while
// this thread keeps its owner segment try-locked (the row pinned, no other
// evictor can pick it: their try-lock fails), then unpublished under mu_.
// So hits never wait on a miss, and misses of different threads overlap
// their I/O. Two readers of one segment (both holding its lock shared)
// missing the same row: the first marks it kLoading, the second waits on
// loaded_ (a condition variable on mu_). A thread waiting for mu_ may hold a
// victim's segment lock; no thread holding mu_ ever waits for a segment lock
// (it only try-locks), so this adds no lock cycle.
//
// Cost: every miss is one pread and every dirty eviction one pwrite of a
// row: a syscall each, whose fixed per-call cost dominates a row's bytes
// (measured by bench/tiered_engine_bench.cc; docs/guides/tiered-storage.md
// "Speed").
//
// Errors: a write-back the disk refuses (full disk, RLIMIT_FSIZE) keeps the
// victim in DRAM, counts a write failure and remembers the message; the
// store overshoots instead of losing the row. Callers (the TF kernels) turn
// a new failure into an op error. A failed read throws (row_file.h).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache_policy.h"
#include "row_file.h"
#include "row_store.h"
#include "zero_rows.h"

namespace evstore {

// Policy: which rows stay in DRAM (cache_policy.h). Engine: the disk tier,
// RowFile (row_file.h) or any class with its interface (the benchmark plugs
// RocksDB in here to compare: bench/tiered_engine_bench.cc).
template <typename Policy = FrequencyClock, typename Engine = RowFile>
class TieredStore {
 public:
  static constexpr uint32_t kNoSlot = 0xFFFFFFFFu;
  static constexpr uint16_t kNoOwner = 0xFFFFu;

  // A store without a tier config is not usable (IsRowStore asks for the
  // (int) constructor: the table passes its TierConfig through MakeRowStore).
  explicit TieredStore(int stride) : TieredStore(stride, TierConfig{}) {}
  TieredStore(int stride, const TierConfig& cfg)
      : stride_(stride), dim_(stride), file_(cfg.path, static_cast<size_t>(stride) * sizeof(float)) {
    if (cfg.dram_bytes <= 0) throw std::invalid_argument("tiered storage needs dram_bytes > 0");
    dram_bytes_ = cfg.dram_bytes;
    budget_ = BudgetSlots();
    row_dir_.reset(new std::unique_ptr<RowMeta[]>[kRowChunks]);
    slot_dir_.reset(new SlotChunk[kSlotChunks]);
  }
  ~TieredStore() {
    for (uint32_t c = 0; c < nslot_chunks_; ++c) std::free(slot_dir_[c].data);
  }
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  int stride() const { return stride_; }
  const std::string& dir() const { return file_.dir(); }

  static void PrefetchRow(const float* row, int floats) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int off = 0; off < floats * 4; off += 64) __builtin_prefetch(p + off);
  }

  // ---- row access (caller holds r's owner segment lock) ----------------------
  float* Row(uint32_t r) const { return Access(r, true); }
  const float* ReadRow(uint32_t r) const { return Access(r, false); }
  // A row for reading once (a full export, Table::Read, an L2 eviction pass):
  // a resident row in place, a cold one copied into `scratch` from disk
  // without taking a slot, so streaming every row keeps DRAM at the budget.
  static constexpr bool kAllResident = false;
  const float* PeekRow(uint32_t r, float* scratch) const {
    const RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_acquire);
    if (s != kNoSlot) return SlotData(s);
    // No store mutex needed: only a write-back (owner lock exclusive, which
    // our caller's lock excludes) changes record r or its flags. A reader of
    // the same segment faulting it in meanwhile copies the same record.
    if (m.flags.load(std::memory_order_relaxed) & kOnDisk) {
      file_.Read(r, scratch);
      return scratch;
    }
    std::memset(scratch, 0, stride_ * sizeof(float));  // never written: unspecified, zeros
    return scratch;
  }
  int64_t& Version(uint32_t r) const { return Meta(r).version; }
  void Hint(uint32_t r, uint32_t freq) const { Meta(r).heat = Policy::HeatOf(freq); }
  void Bind(uint32_t r, int segment) { Meta(r).owner = static_cast<uint16_t>(segment); }
  // Whether row r's embedding (first `dim` floats) is all zero, without
  // reading a row that is on disk only (its flag was set when written).
  bool RowIsZero(uint32_t r, int dim) const {
    const RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_acquire);
    if (s != kNoSlot) return IsZeroRow(SlotData(s), dim);
    const uint8_t f = m.flags.load(std::memory_order_relaxed);
    if (f & kOnDisk) return (f & kZero) != 0;
    return false;  // never written: contents unspecified (the table initialises rows before use)
  }
  void AttachLocks(SegmentLocks locks) { locks_ = std::move(locks); }

  // ---- ids -----------------------------------------------------------------
  uint32_t Allocate() {
    uint32_t r;
    AllocateMany(1, &r);
    return r;
  }
  void AllocateMany(size_t n, uint32_t* out) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t k = 0; k < n; ++k) {
      if (!free_ids_.empty()) {
        out[k] = free_ids_.back();
        free_ids_.pop_back();
        continue;
      }
      if (next_ >= kMaxRowIds) throw std::length_error("table is full (2^31 rows)");
      if ((next_ & (kRowChunk - 1)) == 0) {
        std::unique_ptr<RowMeta[]> chunk(new RowMeta[kRowChunk]);
        row_dir_[next_ >> kRowChunkShift] = std::move(chunk);
      }
      out[k] = next_++;
    }
  }
  // Called under r's owner lock: the row leaves DRAM and its disk copy is void.
  void Free(uint32_t r) {
    std::lock_guard<std::mutex> l(mu_);
    RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_relaxed);
    if (s != kNoSlot) ReleaseSlot(s);
    m.slot.store(kNoSlot, std::memory_order_release);
    m.flags.store(0, std::memory_order_relaxed);
    m.heat = 0;
    m.owner = kNoOwner;
    free_ids_.push_back(r);
  }

  // ---- sizes -----------------------------------------------------------------
  int64_t free_rows() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(free_ids_.size());
  }
  // DRAM held: cache slots (rows + bookkeeping), per-row metadata, free lists.
  int64_t bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(nslot_chunks_) * kSlotChunk * (stride_ * 4 + sizeof(SlotInfo)) + MetaBytesLocked() +
           static_cast<int64_t>(free_ids_.capacity() + free_slots_.capacity()) * 4;
  }
  // Per-row metadata bytes (version, slot, owner, flags, heat): the DRAM cost
  // per key that the tier does not move to disk.
  int64_t version_bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    return MetaBytesLocked();
  }
  TierStats tier_stats() const {
    std::lock_guard<std::mutex> l(mu_);
    TierStats t;
    for (const Counter& c : hits_) t.hits += c.n.load(std::memory_order_relaxed);
    t.misses = misses_.load(std::memory_order_relaxed);
    t.writebacks = writebacks_;
    t.write_failures = write_failures_.load(std::memory_order_relaxed);
    t.resident = resident_;
    t.budget_rows = budget_;
    t.disk_bytes = file_.disk_bytes();
    return t;
  }
  // Write-backs the disk refused so far (cheap: no lock).
  int64_t write_failures() const { return write_failures_.load(std::memory_order_relaxed); }
  // Message of the most recent write failure (empty if none).
  std::string last_failure() const {
    std::lock_guard<std::mutex> l(mu_);
    return last_failure_;
  }

  // ---- widening (every segment lock held by the caller) ---------------------
  struct Widened {};
  std::unique_ptr<Widened> PrepareWiden(int) const { return std::make_unique<Widened>(); }
  // Widening empties the cache: every resident row is written to the file
  // at the old width, the file is re-laid out at the new one, and the slots
  // are released (kept, they would hold budget-at-the-old-width rows at the
  // new width: three times the budget when Adam's two slots arrive). Rows
  // fault back in as they are used. Any failed write throws before the
  // stride changes: the table is then unchanged (rows written so far are
  // merely clean).
  void Relayout(int new_stride, const std::vector<float>& tail_init, Widened*) {
    std::lock_guard<std::mutex> l(mu_);
    const size_t tail_bytes = (new_stride - stride_) * sizeof(float);
    std::vector<char> tail(tail_bytes);
    std::memcpy(tail.data(), tail_init.data(), tail_bytes);
    auto fail = [&] {
      throw std::runtime_error("tiered storage: widening rows on disk failed: " +
                               std::string(std::strerror(file_.last_error())));
    };
    const uint32_t nslots = nslot_chunks_ * kSlotChunk;
    for (uint32_t s = 0; s < nslots; ++s) {
      SlotInfo& in = Info(s);
      if (in.row == kNoRowId) continue;
      RowMeta& m = Meta(in.row);
      const float* data = SlotData(s);
      if (in.dirty.load(std::memory_order_relaxed) || !(m.flags.load(std::memory_order_relaxed) & kOnDisk)) {
        if (!file_.Write(in.row, data)) fail();
        ++writebacks_;
      }
      m.flags.store(DiskFlags(data), std::memory_order_relaxed);
      in.dirty.store(0, std::memory_order_relaxed);
    }
    if (!file_.Widen(static_cast<size_t>(new_stride) * sizeof(float), next_,
                     [&](uint32_t r) { return (Meta(r).flags.load(std::memory_order_relaxed) & kOnDisk) != 0; }, tail))
      fail();
    for (uint32_t s = 0; s < nslots; ++s) {
      SlotInfo& in = Info(s);
      if (in.row != kNoRowId) Meta(in.row).slot.store(kNoSlot, std::memory_order_release);
    }
    for (uint32_t c = 0; c < nslot_chunks_; ++c) {
      std::free(slot_dir_[c].data);
      slot_dir_[c].data = nullptr;
      slot_dir_[c].info.reset();
    }
    nslot_chunks_ = 0;
    free_slots_.clear();
    resident_ = 0;
    hand_ = 0;
    stride_ = new_stride;
    budget_ = BudgetSlots();
  }

 private:
  // kLoading: a thread is reading the row into a slot outside the store
  // mutex; another reader of the same segment (shared lock) waits for it.
  enum : uint8_t { kOnDisk = 1, kZero = 2, kLoading = 4 };
  struct RowMeta {
    int64_t version = 0;
    std::atomic<uint32_t> slot{kNoSlot};
    uint16_t owner = kNoOwner;
    std::atomic<uint8_t> flags{0};  // changed under mu_; read under the owner lock
    mutable uint8_t heat = 0;
  };
  static_assert(sizeof(RowMeta) == 16, "per-row DRAM cost of the tier: 16 bytes (docs/guides/tiered-storage.md)");
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "slot ids are read without the store mutex");
  struct SlotInfo {
    uint32_t row = kNoRowId;
    std::atomic<uint8_t> weight{0};
    std::atomic<uint8_t> dirty{0};
    uint8_t second_chance = 0;
  };
  struct SlotChunk {
    float* data = nullptr;
    std::unique_ptr<SlotInfo[]> info;
  };
  static constexpr uint32_t kRowChunkShift = 16;
  static constexpr uint32_t kRowChunk = 1u << kRowChunkShift;
  static constexpr uint32_t kRowChunks = kMaxRowIds >> kRowChunkShift;
  static constexpr uint32_t kSlotChunkShift = 12;
  static constexpr uint32_t kSlotChunk = 1u << kSlotChunkShift;
  static constexpr uint32_t kSlotChunks = 1u << 16;  // 2^28 resident rows at most
  static_assert(static_cast<uint64_t>(kRowChunks) * kRowChunk == kMaxRowIds, "the directory covers every row id");

  RowMeta& Meta(uint32_t r) const { return row_dir_[r >> kRowChunkShift][r & (kRowChunk - 1)]; }
  float* SlotData(uint32_t s) const {
    return slot_dir_[s >> kSlotChunkShift].data + static_cast<size_t>(s & (kSlotChunk - 1)) * stride_;
  }
  SlotInfo& Info(uint32_t s) const { return slot_dir_[s >> kSlotChunkShift].info[s & (kSlotChunk - 1)]; }
  int64_t MetaBytesLocked() const {
    return static_cast<int64_t>((next_ + kRowChunk - 1) >> kRowChunkShift) * kRowChunk * sizeof(RowMeta);
  }
  int64_t BudgetSlots() const {
    int64_t per = static_cast<int64_t>(stride_) * 4 + sizeof(SlotInfo);
    int64_t n = dram_bytes_ / per;
    return n < 1 ? 1 : n;
  }

  float* Access(uint32_t r, bool write) const {
    RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_acquire);
    if (s == kNoSlot) {
      s = const_cast<TieredStore*>(this)->Fault(r);
    } else {
      CountHit(m.owner);
    }
    SlotInfo& in = Info(s);
    Policy::OnAccess(in.weight, m.heat);
    if (write && !in.dirty.load(std::memory_order_relaxed)) in.dirty.store(1, std::memory_order_relaxed);
    return SlotData(s);
  }

  // Brings row r into a slot (caller holds r's owner lock, shared or not).
  // The disk I/O (the victim's write-back, r's read) runs outside mu_, so
  // hits, other misses and other segments never wait for it: the slot being
  // filled is not yet published in meta_[r].slot, and the victim stays
  // pinned by its owner's segment lock, which this thread holds until the
  // victim is written and unpublished.
  uint32_t Fault(uint32_t r) {
    RowMeta& m = Meta(r);
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      uint32_t s = m.slot.load(std::memory_order_acquire);
      if (s != kNoSlot) {  // another reader of the same segment brought it in
        CountHit(m.owner);
        return s;
      }
      if (!(m.flags.load(std::memory_order_relaxed) & kLoading)) break;
      ++waiters_;
      loaded_.wait(l);  // that reader is reading it now (both hold r's owner lock shared)
      --waiters_;
    }
    misses_.fetch_add(1, std::memory_order_relaxed);
    m.flags.fetch_or(kLoading, std::memory_order_relaxed);
    uint32_t s;
    try {
      s = TakeSlot(m.owner, l);
    } catch (...) {
      m.flags.fetch_and(static_cast<uint8_t>(~kLoading), std::memory_order_relaxed);
      if (waiters_) loaded_.notify_all();
      throw;
    }
    SlotInfo& in = Info(s);
    in.row = r;  // pinned: r's owner lock is ours, so no evictor takes it
    in.dirty.store(0, std::memory_order_relaxed);
    in.weight.store(0, std::memory_order_relaxed);
    in.second_chance = 0;
    if (m.flags.load(std::memory_order_relaxed) & kOnDisk) {
      l.unlock();
      try {
        file_.Read(r, SlotData(s));
      } catch (...) {
        l.lock();
        ReleaseSlot(s);
        m.flags.fetch_and(static_cast<uint8_t>(~kLoading), std::memory_order_relaxed);
        if (waiters_) loaded_.notify_all();
        throw;
      }
      l.lock();
    }
    m.slot.store(s, std::memory_order_release);
    m.flags.fetch_and(static_cast<uint8_t>(~kLoading), std::memory_order_relaxed);
    if (waiters_) loaded_.notify_all();
    return s;
  }

  // A slot for a row being faulted in: a victim's slot (its row written to
  // disk first if changed, outside mu_), or a free slot within the budget,
  // or one beyond the budget when nothing can be evicted now (every
  // candidate pinned, or the disk refused the write: the victim stays).
  // mu_ held on entry and on return (`l`).
  uint32_t TakeSlot(uint16_t self, std::unique_lock<std::mutex>& l) {
    while (resident_ >= budget_) {
      std::unique_lock<std::shared_mutex> owner;
      const uint32_t v = PickVictim(self, &owner);
      if (v == kNoSlot) break;
      SlotInfo& in = Info(v);
      RowMeta& vm = Meta(in.row);
      const float* data = SlotData(v);
      if (in.dirty.load(std::memory_order_relaxed) || !(vm.flags.load(std::memory_order_relaxed) & kOnDisk)) {
        const uint32_t row = in.row;
        l.unlock();
        int err = 0;
        const bool ok = file_.Write(row, data, &err);
        l.lock();
        if (!ok) {
          write_failures_.fetch_add(1, std::memory_order_relaxed);
          last_failure_ = "tiered storage: writing a row to " + file_.dir() + " failed (" + std::strerror(err) +
                          "); the row stays in memory";
          break;
        }
        ++writebacks_;
      }
      vm.flags.store(DiskFlags(data), std::memory_order_relaxed);
      vm.slot.store(kNoSlot, std::memory_order_release);
      in.row = kNoRowId;  // the slot passes to the caller: resident_ unchanged
      return v;
    }
    if (free_slots_.empty()) GrowSlots();
    uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    ++resident_;
    return s;
  }
  uint8_t DiskFlags(const float* data) const {
    return static_cast<uint8_t>(kOnDisk | (IsZeroRow(data, dim_) ? kZero : 0));
  }
  // One chunk of slots, cache-line aligned. Not AllocLarge: its 2 MiB
  // rounding of a chunk (3 MiB at dim 64 with Adam) would add a third to
  // the DRAM the budget allows.
  static float* AllocSlots(int stride) {
    size_t bytes = (static_cast<size_t>(kSlotChunk) * stride * sizeof(float) + 63) / 64 * 64;
    float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p) throw std::bad_alloc();
    return p;
  }
  void ReleaseSlot(uint32_t s) {  // mu_ held
    Info(s).row = kNoRowId;
    free_slots_.push_back(s);
    --resident_;
  }
  void GrowSlots() {  // mu_ held
    if (nslot_chunks_ >= kSlotChunks) throw std::length_error("tiered storage: too many resident rows");
    SlotChunk& ch = slot_dir_[nslot_chunks_];
    ch.data = AllocSlots(stride_);
    if (!ch.data) throw std::bad_alloc();
    ch.info.reset(new SlotInfo[kSlotChunk]);
    uint32_t base = nslot_chunks_ * kSlotChunk;
    for (uint32_t i = kSlotChunk; i-- > 0;) free_slots_.push_back(base + i);
    ++nslot_chunks_;
  }

  // The next victim: the hand sweeps slots; a slot at zero weight whose
  // owner segment is not `self` and can be locked now is chosen, and its
  // owner lock handed to the caller in `owner` (held until the victim is
  // written and unpublished). kNoSlot when none was found within a bounded
  // sweep. mu_ held.
  uint32_t PickVictim(uint16_t self, std::unique_lock<std::shared_mutex>* owner) {
    if (!locks_) return kNoSlot;
    const uint64_t nslots = static_cast<uint64_t>(nslot_chunks_) * kSlotChunk;
    const uint64_t limit = nslots * (Policy::kMaxWeight + 2);
    for (uint64_t step = 0; step < limit; ++step) {
      uint32_t s = hand_;
      hand_ = (hand_ + 1 == nslots) ? 0 : hand_ + 1;
      SlotInfo& in = Info(s);
      if (in.row == kNoRowId) continue;
      if (!Policy::Pass(in.weight)) continue;
      RowMeta& m = Meta(in.row);
      if (m.owner == self || m.owner == kNoOwner) continue;
      std::shared_mutex& mu = locks_(m.owner);
      if (!mu.try_lock()) continue;  // pinned by whoever holds it
      std::unique_lock<std::shared_mutex> held(mu, std::adopt_lock);
      if (m.version > newest_) newest_ = m.version;
      if (!in.second_chance && Policy::Recent(m.version, newest_)) {
        in.second_chance = 1;
        continue;
      }
      *owner = std::move(held);
      return s;
    }
    return kNoSlot;
  }

  int stride_;
  const int dim_;  // the embedding width: the first stride at construction
  int64_t dram_bytes_ = 0;
  int64_t budget_ = 1;
  mutable Engine file_;
  SegmentLocks locks_;
  mutable std::mutex mu_;
  std::condition_variable loaded_;  // a row's kLoading cleared
  int waiters_ = 0;                 // threads waiting on loaded_ (mu_)
  uint32_t next_ = 0;
  std::vector<uint32_t> free_ids_;
  std::unique_ptr<std::unique_ptr<RowMeta[]>[]> row_dir_;
  std::unique_ptr<SlotChunk[]> slot_dir_;
  uint32_t nslot_chunks_ = 0;
  std::vector<uint32_t> free_slots_;
  int64_t resident_ = 0;
  uint32_t hand_ = 0;
  int64_t newest_ = -1;
  int64_t writebacks_ = 0;
  // Hits are counted per owner segment stripe, one cache line each: a single
  // counter bumped by every thread on every row access cost more than the
  // access (the line ping-pongs between cores).
  struct alignas(64) Counter {
    std::atomic<int64_t> n{0};
  };
  static constexpr int kHitStripes = 64;
  mutable Counter hits_[kHitStripes];
  void CountHit(uint16_t owner) const { hits_[owner % kHitStripes].n.fetch_add(1, std::memory_order_relaxed); }
  mutable std::atomic<int64_t> misses_{0};
  std::atomic<int64_t> write_failures_{0};
  std::string last_failure_;
};

static_assert(IsRowStore<TieredStore<>>(), "TieredStore implements the row store contract (row_store.h)");

}  // namespace evstore
