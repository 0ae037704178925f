// TieredStore: a row store (row_store.h) whose rows live in a DRAM cache of
// bounded size over a log-structured record file on local disk (row_file.h,
// log_space.h). No TensorFlow.
//
// Layout
//   meta_     per row id, always in DRAM (RowMeta, 24 bytes, static_assert
//             below): the version, the DRAM slot holding the row (kNoSlot
//             when it is on disk only), the disk location of its copy (when
//             flagged kOnDisk), the owning segment, flags (a disk copy exists;
//             the embedding was zero when written) and the row's heat
//             (cache_policy.h, from the table's frequency hint). Two-level
//             directory of 65,536-row chunks, never reallocated (allocated
//             four at a time on huge pages: kMetaSlab below).
//   slots     the DRAM cache: `stride` floats per slot, in chunks of 4,096
//             slots that are never reallocated (except by Relayout; slabs of
//             whole 2 MiB pages where the stride allows: SlotSlab), plus per
//             slot its row, weight (the policy's) and dirty byte (written
//             through Row() since loaded: a clean row with a disk copy is
//             dropped without a write).
//   log_      the file's layout (log_space.h): extents of 256 records, a
//             live count per extent and the row id per record (4 bytes per
//             disk record, counted in meta bytes with meta_).
//   The budget: `dram_bytes` / (stride * 4 + slot bookkeeping) slots.
//
// Pinning (the contract's central invariant). Row(r) is called under the
// segment lock of the key owning r, and the row must stay resident until that
// lock is released. The store learns each row's owner from Bind(r, segment)
// (the table calls it when it admits a key), and keeps which segments ever
// had a row (bound_, a bit each): a fault whose segment is the only one can
// evict nothing, and does not sweep. A slot's row may be evicted, and
// a row's disk location may change, only by a thread holding the owner's
// segment lock exclusively: an evicting thread try-locks the candidate's
// owner (never blocking, so no lock-order cycle with threads waiting for the
// store's mutex) and skips candidates owned by the segment it holds itself
// (a table thread holds at most one segment lock when it touches rows;
// Relayout, under all of them, is the store's own). A candidate whose owner
// is locked by anyone else is therefore pinned and skipped. When too few
// candidates can be evicted (every other segment busy, or one batch touching
// more rows of one segment than the budget), the store takes slots beyond the
// budget and gives them back later: the budget is a target that one batch may
// overshoot, never a correctness limit. It does so only then: a fault whose
// sweep found too few victims sweeps again (bounded sweeps, mu_ let go in
// between) and one that finds the candidates held by another thread's batch
// waits for that batch's slots (EvictUntil). So the slot arrays, which are
// never returned, hold at most the budget, the victims of the batches being
// written and the rows the batches hold pinned.
//
// The cleaner. One thread per store (started by AttachLocks) keeps a batch
// of slots free below the budget, so most misses take a free slot and evict
// nothing. It holds no segment lock of its own, so it may evict rows of any
// segment not locked right now: with one index segment, where a faulting
// thread can evict nothing, it brings the cache back within budget between
// batches (Settle waits for that).
//
// Write-back in batches. When a fault still needs slots beyond the budget,
// the faulting thread evicts a batch itself (up to batch_ = budget/8, at most
// one extent); the cleaner evicts the same way. Victims are chosen by a
// bounded sweep of the CLOCK hand under mu_, holding each victim's owner lock. The victims that need a write (dirty, or never
// written) and, when the log has more dead records than live ones, the live
// cold records of one sparse extent (compaction) are written as one run of
// adjacent records, outside mu_: one pwritev straight from the victims' slots
// (pinned by their owner locks) and the moved records' buffer. Then, under mu_,
// each written row gets its new location (its old record dies), the victims'
// slots are unpublished and freed, and the owner locks are released.
//
// Misses of one batch are read together: the table hands every row of a
// segment's part of a batch to FaultMany (or AccessMany), which takes all their slots at
// once, and reads the cold ones sorted by disk location: a memcpy each from
// the file's mapping (row_file.h), or on the portable path one preadv per run
// of adjacent records (rows evicted together come back together). The table
// then resolves and prefetches the batch's rows before using them.
//
// Lock-free hits: meta_[r].slot changes only while r's owner segment lock is
// held exclusively (eviction) or under the store mutex with the owner lock
// held (a fault by a reader holding it shared). A caller holding the owner
// lock therefore reads a stable slot, published with release/acquire; and a
// stable disk location (PeekRow reads it without mu_).
//
// I/O outside the store mutex (mu_). A fault takes its slots under mu_ and
// reads rows into them without mu_, publishing meta_[r].slot only when the
// row is there; a write-back runs without mu_ while this thread keeps the
// victims' owner segments try-locked (the rows pinned, no other evictor can
// pick them: their try-lock fails). So hits never wait on a miss, and misses
// of different threads overlap their I/O. Two readers of one segment (both
// holding its lock shared) missing the same row: the first marks it
// kLoading, the second waits on loaded_ (a condition variable on mu_). A
// thread waiting for mu_ may hold a victim's segment lock; no thread holding
// mu_ ever waits for a segment lock (it only try-locks), so this adds no lock
// cycle. An extent is reused only when none of its records is live, and a
// live record's row cannot move while a reader holds its owner lock, so no
// read ever sees its record overwritten.
//
// Errors: a write-back the disk refuses (full disk, RLIMIT_FSIZE) keeps the
// victims in DRAM, counts a write failure and remembers the message; the
// store overshoots instead of losing rows. The failure goes to the operation
// whose eviction it was (write_back_report.h: the report open on the evicting
// thread; the TF kernels turn it into an op error); one of the cleaner
// thread, which serves no operation, goes to the next fault (or MakeRoom) on
// a thread with a report open, once, unless a write-back has succeeded since
// (the disk took rows again: nothing is held in DRAM for it any more). A
// failed read throws (row_file.h).
#pragma once
#include <atomic>
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cache_policy.h"
#include "log_space.h"
#include "memory.h"
#include "row_file.h"
#include "row_store.h"
#include "write_back_report.h"
#include "zero_rows.h"

namespace evstore {

// Policy: which rows stay in DRAM (cache_policy.h). Engine: the disk tier,
// RowFile (row_file.h) or any class with its interface.
template <typename Policy = FrequencyClock, typename Engine = RowFile>
class TieredStore {
 public:
  static constexpr uint32_t kNoSlot = 0xFFFFFFFFu;
  static constexpr uint16_t kNoOwner = 0xFFFFu;
  // The cleaner thread's name (/proc/<pid>/task/<tid>/comm: at most 15 characters).
  static constexpr const char* kCleanerName = "evstore-cleaner";

  // A store without a tier config is not usable (IsRowStore asks for the
  // (int) constructor: the table passes its TierConfig through MakeRowStore).
  explicit TieredStore(int stride) : TieredStore(stride, TierConfig{}) {}
  TieredStore(int stride, const TierConfig& cfg)
      : stride_(stride), dim_(stride), file_(cfg.path, static_cast<size_t>(RecordBytes(stride)), cfg.mapped_reads),
        log_(static_cast<uint64_t>(std::max<int64_t>(cfg.max_disk_records, 0))) {
    if (cfg.dram_bytes <= 0) throw std::invalid_argument("tiered storage needs dram_bytes > 0");
    if (cfg.max_disk_records < 0) throw std::invalid_argument("tiered storage needs max_disk_records >= 0");
    dram_bytes_ = cfg.dram_bytes;
    SetBudget();
    row_dir_.reset(new RowMeta*[kRowChunks]());
    slot_dir_.reset(new SlotChunk[kSlotChunks]);
  }
  ~TieredStore() {
    StopCleaner();
    FreeSlotChunks();
    for (uint32_t c = 0; c < kRowChunks; c += kMetaSlab) std::free(row_dir_[c]);
  }
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  int stride() const { return stride_; }
  const std::string& dir() const { return file_.dir(); }
  bool mapped_reads() const { return file_.mapped_reads(); }

  static void PrefetchRow(const float* row, int floats) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int off = 0; off < floats * 4; off += 64) __builtin_prefetch(p + off);
  }

  // ---- row access (caller holds r's owner segment lock) ----------------------
  float* Row(uint32_t r) const { return Access(r, true); }
  const float* ReadRow(uint32_t r) const { return Access(r, false); }
  // Makes rows[0..n) resident at once (all owned by the one segment whose
  // lock the caller holds): the cold ones are read together, sorted by disk
  // location. Row/ReadRow on them then hit. Duplicates are allowed.
  void FaultMany(const uint32_t* rows, size_t n) const {
    thread_local std::vector<uint32_t> miss;
    miss.clear();
    for (size_t i = 0; i < n; ++i)
      if (Meta(rows[i]).slot.load(std::memory_order_acquire) == kNoSlot) miss.push_back(rows[i]);
    if (miss.empty()) return;
    std::sort(miss.begin(), miss.end());
    miss.erase(std::unique(miss.begin(), miss.end()), miss.end());
    const_cast<TieredStore*>(this)->Load(miss);
  }
  // A training kernel's rows of one segment's part of a batch (the caller
  // holds that segment's lock): rows[0..n) made resident together (the cold
  // ones read as FaultMany reads them), then each one's row in out[i],
  // accessed as Row (`write`) or ReadRow would one by one (a hit each, the
  // policy's weight raised to the row's heat, the slot marked dirty when
  // written), but in passes over the batch that prefetch each resident
  // row's slot bookkeeping and first `prefetch_floats` floats, and with the
  // hits counted once. With `freqs`, row rows[i] is hinted with freqs[i]
  // first (Hint). Duplicates are allowed.
  void AccessMany(const uint32_t* rows, size_t n, bool write, float** out, const uint32_t* freqs,
                  int prefetch_floats) const {
    if (n == 0) return;
    // One thread-local access per call (each is a __tls_get_addr call in a
    // shared library).
    thread_local AccessScratch scratch;
    std::vector<uint32_t>& slots = scratch.slots;
    std::vector<uint32_t>& miss = scratch.miss;
    std::vector<uint8_t>& heat = scratch.heat;
    slots.resize(n);
    heat.resize(n);
    miss.clear();
    for (size_t i = 0; i < n; ++i) {
      RowMeta& m = Meta(rows[i]);
      // The heat, kept for the weight below; stored only when it changed
      // (a store dirties the metadata's cache line for every access).
      uint8_t h = m.heat.load(std::memory_order_relaxed);
      if (freqs) {
        const uint8_t f = Policy::HeatOf(freqs[i]);
        if (f != h) m.heat.store(h = f, std::memory_order_relaxed);
      }
      heat[i] = h;
      const uint32_t s = m.slot.load(std::memory_order_acquire);
      slots[i] = s;
      if (s == kNoSlot) {
        miss.push_back(rows[i]);
        continue;
      }
      __builtin_prefetch(&Info(s));
      PrefetchRow(SlotData(s), prefetch_floats);
    }
    if (!miss.empty()) {
      std::sort(miss.begin(), miss.end());
      miss.erase(std::unique(miss.begin(), miss.end()), miss.end());
      const_cast<TieredStore*>(this)->Load(miss);
      for (size_t i = 0; i < n; ++i)
        if (slots[i] == kNoSlot) slots[i] = Meta(rows[i]).slot.load(std::memory_order_acquire);
    }
    for (size_t i = 0; i < n; ++i) {
      SlotInfo& in = Info(slots[i]);
      Policy::OnAccess(in.weight, heat[i]);
      if (write && !in.dirty.load(std::memory_order_relaxed)) in.dirty.store(1, std::memory_order_relaxed);
      out[i] = SlotData(slots[i]);
    }
    CountHits(Meta(rows[0]).owner, static_cast<int64_t>(n));
  }
  // Starts loading row r's metadata into the CPU cache (a batch about to
  // hint or access r).
  void PrefetchMeta(uint32_t r) const { __builtin_prefetch(&Meta(r)); }
  // A row for reading once (a full export, Table::Read, an L2 eviction pass):
  // a resident row in place, a cold one copied into `scratch` from disk
  // without taking a slot, so streaming every row keeps DRAM at the budget.
  static constexpr bool kAllResident = false;
  const float* PeekRow(uint32_t r, float* scratch) const {
    const RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_acquire);
    if (s != kNoSlot) return SlotData(s);
    // No store mutex needed: the location and the record change only under
    // the owner lock held exclusively, which our caller's lock excludes. A
    // reader of the same segment faulting it in meanwhile copies the same record.
    if (m.flags.load(std::memory_order_relaxed) & kOnDisk) {
      file_.Read(m.loc, scratch);
      return scratch;
    }
    std::memset(scratch, 0, stride_ * sizeof(float));  // never written: unspecified, zeros
    return scratch;
  }
  // Rows rows[0..n) (one segment, whose lock the caller holds) copied to
  // out[i * stride]: resident ones from DRAM, cold ones read sorted by disk
  // location (the kernel is told of them all first, so it reads ahead while
  // the copies run), none cached. A full export's read of a segment.
  void PeekMany(const uint32_t* rows, size_t n, float* out) const {
    const size_t rb = static_cast<size_t>(RecordBytes(stride_));
    ColdReads& cold = Cold();
    for (size_t i = 0; i < n; ++i) {
      const RowMeta& m = Meta(rows[i]);
      const uint32_t s = m.slot.load(std::memory_order_acquire);
      float* dst = out + i * stride_;
      if (s != kNoSlot) {
        std::memcpy(dst, SlotData(s), rb);
      } else if (m.flags.load(std::memory_order_relaxed) & kOnDisk) {
        cold.Add(m.loc, dst);
      } else {
        std::memset(dst, 0, rb);  // never written: unspecified, zeros
      }
    }
    if (cold.empty()) return;
    cold.Sort();
    file_.WillNeed(cold.locs.data(), cold.size());
    file_.ReadMany(cold.locs.data(), cold.dsts.data(), cold.size());
  }
  // Rows rows[0..n) (one segment, whose lock the caller holds, shared or
  // not) for a read-only lookup (Table::Find): out[i] points at the resident
  // row, or at a copy of the cold one read from disk into this thread's
  // buffer (valid until this thread's next call), read sorted by disk
  // location. Nothing is cached: no slot taken, nothing evicted or written
  // back (training and serving decide what stays in DRAM). A cold row counts
  // as a miss, a resident one as a hit.
  void PeekRows(const uint32_t* rows, size_t n, const float** out) const {
    thread_local std::vector<float> copies;
    ColdReads& cold = Cold();
    size_t ncold = 0;
    for (size_t i = 0; i < n; ++i) {
      const RowMeta& m = Meta(rows[i]);
      const uint32_t s = m.slot.load(std::memory_order_acquire);
      if (s != kNoSlot) {
        out[i] = SlotData(s);
      } else {
        out[i] = nullptr;
        ++ncold;
      }
    }
    if (n > ncold) CountHits(Meta(rows[0]).owner, static_cast<int64_t>(n - ncold));
    if (ncold == 0) return;
    copies.resize(ncold * stride_);
    size_t c = 0;
    for (size_t i = 0; i < n; ++i) {
      if (out[i]) continue;
      float* dst = copies.data() + (c++) * stride_;
      out[i] = dst;
      const RowMeta& m = Meta(rows[i]);
      if (m.flags.load(std::memory_order_relaxed) & kOnDisk) {
        cold.Add(m.loc, dst);
      } else {
        std::memset(dst, 0, stride_ * sizeof(float));  // never written: unspecified, zeros
      }
    }
    misses_.fetch_add(static_cast<int64_t>(ncold), std::memory_order_relaxed);
    if (cold.empty()) return;
    peek_reads_.fetch_add(cold.Sort(), std::memory_order_relaxed);
    file_.ReadMany(cold.locs.data(), cold.dsts.data(), cold.size());
  }
  // ---- streaming the file in disk order (a full export: Table::ForEachKey) ---
  // While a ColdStream is open no extent is reused (LogSpace::Hold), so a
  // record written before it opened keeps its bytes until it closes: the
  // stream reads long spans of the file holding no lock (ReadSpan), and the
  // reader checks each row afterwards under its owner lock (ColdAt): a row
  // still cold at the same location has exactly those bytes. A widening
  // (Relayout) in between changes layout_epoch(): spans of the old layout
  // are then refused and the reader takes such rows through PeekRow.
  class ColdStream {
   public:
    explicit ColdStream(const TieredStore& s) : s_(s) {
      std::lock_guard<std::mutex> l(s_.mu_);
      const_cast<TieredStore&>(s_).log_.Hold();
    }
    ~ColdStream() {
      std::lock_guard<std::mutex> l(s_.mu_);
      const_cast<TieredStore&>(s_).log_.Unhold();
    }
    ColdStream(const ColdStream&) = delete;
    ColdStream& operator=(const ColdStream&) = delete;
    // Reads records [first, first + n) into dst (n * stride floats of the
    // layout `epoch`) in one read; false, reading nothing, when the layout
    // changed since. Throws std::runtime_error when the disk fails.
    bool ReadSpan(uint64_t epoch, uint32_t first, size_t n, void* dst) const {
      std::shared_lock<std::shared_mutex> l(s_.layout_mu_);
      if (s_.layout_epoch_.load(std::memory_order_relaxed) != epoch) return false;
      s_.file_.ReadSpan(first, n, dst);
      s_.stream_reads_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    // Asks the kernel to start reading records [first, first + n) now.
    void ReadAhead(uint64_t epoch, uint32_t first, size_t n) const {
      std::shared_lock<std::shared_mutex> l(s_.layout_mu_);
      if (s_.layout_epoch_.load(std::memory_order_relaxed) == epoch) s_.file_.WillNeedSpan(first, n);
    }

   private:
    const TieredStore& s_;
  };
  // Under r's owner lock: true, with its record in *loc, when r's only
  // current copy is on disk (not in a DRAM slot).
  bool ColdAt(uint32_t r, uint32_t* loc) const {
    const RowMeta& m = Meta(r);
    if (m.slot.load(std::memory_order_acquire) != kNoSlot || !(m.flags.load(std::memory_order_relaxed) & kOnDisk))
      return false;
    *loc = m.loc;
    return true;
  }
  // The file's layout (record size, locations): changed by each Relayout.
  // Stable under any segment lock (Relayout holds them all).
  uint64_t layout_epoch() const { return layout_epoch_.load(std::memory_order_relaxed); }
  // Spans ColdStream::ReadSpan read so far.
  int64_t stream_reads() const { return stream_reads_.load(std::memory_order_relaxed); }

  int64_t& Version(uint32_t r) const { return Meta(r).version; }
  // Readers of a serving table hint under a shared segment lock (Table::FindEach): the heat is atomic.
  void Hint(uint32_t r, uint32_t freq) const { Meta(r).heat.store(Policy::HeatOf(freq), std::memory_order_relaxed); }
  void Bind(uint32_t r, int segment) {
    Meta(r).owner = static_cast<uint16_t>(segment);
    std::atomic<uint64_t>& w = bound_[segment >> 6];
    const uint64_t bit = uint64_t{1} << (segment & 63);
    if (!(w.load(std::memory_order_relaxed) & bit)) w.fetch_or(bit, std::memory_order_relaxed);
  }
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
  // The table's segment locks: from now on rows can be evicted, and the
  // cleaner thread runs.
  void AttachLocks(SegmentLocks locks) {
    std::lock_guard<std::mutex> l(mu_);
    locks_ = std::move(locks);
    if (locks_ && !cleaner_.joinable()) {
      cleaner_ = std::thread([this] { CleanerLoop(); });
      ::pthread_setname_np(cleaner_.native_handle(), kCleanerName);  // how profilers and benchmarks find it
    }
  }
  // Waits until the cleaner has nothing left to do: the cache is at or below
  // the cleaner's own low mark (CleanerLow) and the cleaner sleeps, so
  // nothing is evicted or written back until a fault takes a slot again.
  // (Above that mark an idle cleaner is only pausing between rounds and
  // evicts again when the pause ends.) Call with no
  // segment lock held: the cleaner needs them. False when it cannot get
  // there (the disk refused a write; every row stays in DRAM) or there is no
  // cleaner (no segment locks).
  bool Settle() const {
    std::unique_lock<std::mutex> l(mu_);
    const int64_t failures = write_failures_.load(std::memory_order_relaxed);
    while (!cleaner_idle_ || resident_ - evicting_ > CleanerLow()) {
      if (!cleaner_.joinable() || write_failures_.load(std::memory_order_relaxed) != failures) return false;
      clean_cv_.notify_one();
      settled_.wait_for(l, std::chrono::milliseconds(5));
    }
    return true;
  }

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
        const uint32_t c = next_ >> kRowChunkShift;
        RowMeta* chunk = c % kMetaSlab == 0
                             ? static_cast<RowMeta*>(AllocLarge(kMetaSlab * kRowChunk * sizeof(RowMeta)))
                             : row_dir_[c - 1] + kRowChunk;
        std::uninitialized_default_construct_n(chunk, kRowChunk);
        row_dir_[c] = chunk;
      }
      out[k] = next_++;
    }
    allocated_since_scan_ += static_cast<int64_t>(n);
  }
  // Called under r's owner lock: the row leaves DRAM and its disk copy is void.
  void Free(uint32_t r) {
    std::lock_guard<std::mutex> l(mu_);
    RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_relaxed);
    if (s != kNoSlot) ReleaseSlot(s);
    if (m.flags.load(std::memory_order_relaxed) & kOnDisk) log_.Kill(m.loc);
    m.slot.store(kNoSlot, std::memory_order_release);
    m.flags.store(0, std::memory_order_relaxed);
    m.heat.store(0, std::memory_order_relaxed);
    m.owner = kNoOwner;
    free_ids_.push_back(r);
  }

  // ---- sizes -----------------------------------------------------------------
  int64_t free_rows() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(free_ids_.size());
  }
  // DRAM held: cache slots (rows + bookkeeping), per-row metadata, the log's
  // per-record bookkeeping, free lists.
  int64_t bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(nslot_chunks_) * kSlotChunk * (stride_ * 4 + sizeof(SlotInfo)) + MetaBytesLocked() +
           static_cast<int64_t>(free_ids_.capacity() + free_slots_.capacity()) * 4;
  }
  // Slots the cache's arrays hold (resident or free): they grow a chunk at a
  // time and are never returned.
  int64_t slots() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(nslot_chunks_) * kSlotChunk;
  }
  // The DRAM cost per key that the tier does not move to disk: per-row
  // metadata (version, slot, disk location, owner, flags, heat) and the log's
  // row id per disk record.
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
    t.write_batches = write_batches_;
    t.compacted = compacted_;
    t.read_calls = read_calls_ + peek_reads_.load(std::memory_order_relaxed);
    t.write_failures = write_failures_.load(std::memory_order_relaxed);
    t.resident = resident_;
    t.budget_rows = budget_;
    t.disk_bytes = file_.disk_bytes();
    t.disk_records = log_.records();
    t.live_records = log_.live();
    t.free_records = log_.free_records();
    t.reserve_records = log_.reserve_records();
    t.grown_by_rewrites = log_.grown_by_rewrites();
    return t;
  }
  // Sets the DRAM budget (a serving table loaded with a small one, then
  // served with the whole: serving_loader/streamed_reload.py). A smaller
  // budget is reached over the faults that follow, as after an overshoot.
  void SetDramBytes(int64_t bytes) {
    if (bytes <= 0) throw std::invalid_argument("tiered storage needs dram_bytes > 0");
    std::lock_guard<std::mutex> l(mu_);
    dram_bytes_ = bytes;
    SetBudget();
    clean_cv_.notify_one();  // the cleaner keeps the new budget
  }
  // Evicts rows (their write-back included) until `n` more fit below the
  // cleaner's mark (a batch short of the budget), or nothing more can be
  // evicted now (EvictUntil), so that the faults and admissions of n rows
  // that follow need no write and wake no cleaner: a serving table makes room
  // for a delta's new keys before its publish takes the write lock. Then the
  // batches still being written (the cleaner's, another fault's) end before
  // it returns: their writes hold their victims' owner locks, which the
  // publish would wait for. The caller holds no segment lock.
  void MakeRoom(int64_t n) {
    std::unique_lock<std::mutex> l(mu_);
    DeliverUnreported();
    const int64_t mark = budget_ - batch_;
    EvictUntil(std::min(n, mark), mark, kNoOwner, l, /*spare_slots=*/false);
    const uint64_t epoch = quiet_epoch_;
    if (evicting_ > 0) WaitForWrites(l, [&] { return quiet_epoch_ != epoch; });
  }
  // Ends a bulk load (ev.load, a restore): every resident row that has no
  // disk copy yet is written now, in runs of adjacent records (kNew: the
  // file grows, its reserve with it), and stays resident and clean. Without
  // this, the load's last rows (up to a cache's worth) were written the first
  // time training evicted them, growing the file then, at a new page-cache
  // page per 4 KiB, where the trained rows' rewrites now take the reserve
  // (log_space.h). A table that fits its budget writes nothing (its rows
  // need no disk). Rows whose segment is busy right now are left to be
  // written when evicted, as before; a write the disk refuses leaves its rows
  // as they were (written when evicted, where a refusal is reported). The
  // scan visits every slot, so it runs only once the row ids allocated since
  // the last one reach an eighth of the slots (kScanShift): a small load (a
  // delta, a short restore) leaves its new rows to eviction, which writes
  // them as before. The caller holds no segment lock.
  void WriteNewRows() {
    std::unique_lock<std::mutex> l(mu_);
    if (!locks_ || static_cast<int64_t>(next_ - free_ids_.size()) <= budget_) return;
    const uint32_t nslots = nslot_chunks_ * kSlotChunk;
    if (allocated_since_scan_ < (int64_t{nslots} >> kScanShift)) return;
    allocated_since_scan_ = 0;
    for (uint32_t s = 0; s < nslots;) {
      HeldLocks held;
      std::vector<uint32_t> batch;
      for (; s < nslots && batch.size() < LogSpace::kExtent; ++s) {
        const SlotInfo& in = Info(s);
        if (in.row == kNoRowId) continue;
        RowMeta& m = Meta(in.row);
        if ((m.flags.load(std::memory_order_relaxed) & kOnDisk) || m.slot.load(std::memory_order_relaxed) != s) continue;
        if (m.owner == kNoOwner || !held.Take(m.owner, locks_)) continue;
        batch.push_back(s);
      }
      if (!batch.empty() && !WriteSlots(batch, nullptr, &l)) return;
    }
  }
  // Message of the most recent write failure (empty if none).
  std::string last_failure() const {
    std::lock_guard<std::mutex> l(mu_);
    return last_failure_;
  }

  // ---- widening (every segment lock held by the caller) ---------------------
  struct Widened {
    uint32_t WaitPrepared() { return 0; }  // nothing is prepared ahead
  };
  std::unique_ptr<Widened> PrepareWiden(int) const { return std::make_unique<Widened>(); }
  // Widening empties the cache: every resident row that needs it is written
  // at the old width, the file is rewritten at the new one (compacted: the
  // live records in disk order, at locations 0..n), and the slots are
  // released (kept, they would hold budget-at-the-old-width rows at the new
  // width: three times the budget when Adam's two slots arrive). Rows fault
  // back in as they are used. Any failed write throws before the stride
  // changes: the table is then unchanged (rows written so far are merely clean).
  void Relayout(int new_stride, const std::vector<float>& tail_init, Widened*) {
    std::unique_lock<std::mutex> l(mu_);
    const size_t tail_bytes = (new_stride - stride_) * sizeof(float);
    std::vector<char> tail(tail_bytes);
    std::memcpy(tail.data(), tail_init.data(), tail_bytes);
    auto fail = [&] {
      throw std::runtime_error("tiered storage: widening rows on disk failed: " +
                               std::string(std::strerror(file_.last_error())));
    };
    const uint32_t nslots = nslot_chunks_ * kSlotChunk;
    std::vector<uint32_t> pending;  // slots whose row needs a write
    for (uint32_t s = 0; s < nslots; ++s) {
      SlotInfo& in = Info(s);
      if (in.row == kNoRowId) continue;
      if (in.dirty.load(std::memory_order_relaxed) || !(Meta(in.row).flags.load(std::memory_order_relaxed) & kOnDisk))
        pending.push_back(s);
    }
    if (!WriteSlots(pending, nullptr)) fail();
    std::vector<std::pair<uint32_t, uint32_t>> recs;  // (location, row) of every disk copy
    for (uint32_t r = 0; r < next_; ++r)
      if (Meta(r).flags.load(std::memory_order_relaxed) & kOnDisk) recs.emplace_back(Meta(r).loc, r);
    std::sort(recs.begin(), recs.end());
    std::unique_lock<std::shared_mutex> layout(layout_mu_);  // no ColdStream span read meanwhile
    if (!file_.Widen(static_cast<size_t>(RecordBytes(new_stride)), static_cast<uint32_t>(recs.size()),
                     [&](uint32_t i) { return recs[i].first; }, tail))
      fail();
    layout_epoch_.fetch_add(1, std::memory_order_relaxed);
    for (uint32_t i = 0; i < recs.size(); ++i) Meta(recs[i].second).loc = i;
    log_.Rebuild(static_cast<uint32_t>(recs.size()), [&](uint32_t i) { return recs[i].second; });
    // The new file is dense: its reserve for the rewrites that follow
    // (log_space.h), written now as a load's would be. Written holding mu_
    // (WriteSlots lets it go for the same write): the caller holds every
    // segment lock, so no lookup could run meanwhile anyway.
    for (uint32_t first, k; (k = log_.ReserveGrowth(&first)) > 0;) {
      file_.WriteZeros(LogSpace::FirstOf(first), size_t{k} * LogSpace::kExtent);
      log_.AddReserve(first, k);
    }
    for (uint32_t s = 0; s < nslots; ++s) {
      SlotInfo& in = Info(s);
      if (in.row != kNoRowId) Meta(in.row).slot.store(kNoSlot, std::memory_order_release);
    }
    FreeSlotChunks();
    free_slots_.clear();
    resident_ = 0;
    hand_ = 0;
    stride_ = new_stride;
    SetBudget();
  }

 private:
  // kLoading: a thread is reading the row into a slot outside the store
  // mutex; another reader of the same segment (shared lock) waits for it.
  enum : uint8_t { kOnDisk = 1, kZero = 2, kLoading = 4 };
  struct RowMeta {
    int64_t version = 0;
    std::atomic<uint32_t> slot{kNoSlot};
    uint32_t loc = 0;  // the disk copy's record (log_space.h), when kOnDisk
    uint16_t owner = kNoOwner;
    std::atomic<uint8_t> flags{0};  // changed under mu_; read under the owner lock
    mutable std::atomic<uint8_t> heat{0};
  };
  static_assert(sizeof(RowMeta) == 24, "per-row DRAM cost of the tier: 24 bytes (docs/guides/tiered-storage.md)");
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "slot ids are read without the store mutex");
  struct SlotInfo {
    uint32_t row = kNoRowId;
    std::atomic<uint8_t> weight{0};
    std::atomic<uint8_t> dirty{0};
    uint8_t second_chance = 0;
  };
  static_assert(sizeof(SlotInfo) == 8, "cache bookkeeping per slot: 8 bytes (docs/guides/tiered-storage.md)");
  struct SlotChunk {
    float* data = nullptr;
    std::unique_ptr<SlotInfo[]> info;
    bool owns = false;  // data is an allocation (the first chunk of its slab)
  };
  static constexpr uint32_t kRowChunkShift = 16;
  static constexpr uint32_t kRowChunk = 1u << kRowChunkShift;
  static constexpr uint32_t kRowChunks = kMaxRowIds >> kRowChunkShift;
  static constexpr uint32_t kSlotChunkShift = 12;
  static constexpr uint32_t kSlotChunk = 1u << kSlotChunkShift;
  static constexpr uint32_t kSlotChunks = 1u << 16;  // 2^28 resident rows at most
  static_assert(static_cast<uint64_t>(kRowChunks) * kRowChunk == kMaxRowIds, "the directory covers every row id");
  // Huge pages (memory.h AllocLarge): every access of a row reads its
  // metadata and its slot, at random over megabytes, as the all-DRAM table
  // reads its rows from huge-page blocks; with 4 KiB pages most of those
  // reads would also miss the TLB. So metadata chunks are allocated in slabs
  // of kMetaSlab chunks, a whole number of 2 MiB pages, and slot chunks in
  // slabs of SlotSlab(stride) chunks when that is a whole number of 2 MiB
  // pages of at most kMaxSlotSlabBytes (else one chunk at a time, cache-line
  // aligned: a 2 MiB rounding of each chunk would add up to a third to the
  // DRAM the budget allows). A slab's later chunks are handed out as the
  // store grows: pages never touched are not resident.
  static constexpr uint32_t kMetaSlab = 4;
  static_assert(kMetaSlab * kRowChunk * sizeof(RowMeta) % (size_t{2} << 20) == 0, "a metadata slab is whole 2 MiB pages");
  static_assert(kRowChunks % kMetaSlab == 0, "slabs tile the directory");
  static constexpr size_t kMaxSlotSlabBytes = size_t{16} << 20;
  static uint32_t SlotSlab(int stride) {
    const size_t chunk = static_cast<size_t>(kSlotChunk) * stride * sizeof(float);
    constexpr size_t kHuge = size_t{2} << 20;
    size_t g = kHuge, b = chunk;  // gcd(chunk, 2 MiB)
    while (b) {
      const size_t t = g % b;
      g = b;
      b = t;
    }
    const size_t m = kHuge / g;  // chunks in the smallest slab of whole 2 MiB pages
    return m * chunk <= kMaxSlotSlabBytes ? static_cast<uint32_t>(m) : 1;
  }
  // Slots the CLOCK hand may visit per victim wanted, under mu_: the bound on
  // one batch's victim search (a hand that finds too few lets the cache
  // overshoot, and the next fault goes on from where it stopped).
  static constexpr uint32_t kSweepPerVictim = 64;
  // What EvictUntil (a fault, MakeRoom) sweeps at most without evicting
  // before it gives up (a fault then takes slots beyond the budget), in turns
  // of the hand over the cache (a sweep takes a unit of weight from each
  // candidate it passes: enough for a cache whose every row has the policy's
  // largest weight and a second chance), and the other threads' batches it
  // waits for at most.
  static constexpr uint64_t kMaxRotations = Policy::kMaxWeight + 2;
  static constexpr int kMaxWaits = 64;
  // Slots ahead of the hand whose candidates' metadata the sweep prefetches.
  static constexpr uint32_t kSweepAhead = 16;
  // WriteNewRows scans the cache only after loads that allocated at least
  // slots >> kScanShift row ids: a scan visits every slot, so many small
  // loads (a server's deltas) would each pay a whole cache's scan to write a
  // few rows that eviction writes anyway.
  static constexpr int kScanShift = 3;
  // Victims one batch takes at most (a cache far over its budget shrinks
  // back over several faults).
  static constexpr int64_t kMaxBatch = 4 * LogSpace::kExtent;

  RowMeta& Meta(uint32_t r) const { return row_dir_[r >> kRowChunkShift][r & (kRowChunk - 1)]; }
  float* SlotData(uint32_t s) const {
    return slot_dir_[s >> kSlotChunkShift].data + static_cast<size_t>(s & (kSlotChunk - 1)) * stride_;
  }
  SlotInfo& Info(uint32_t s) const { return slot_dir_[s >> kSlotChunkShift].info[s & (kSlotChunk - 1)]; }
  int64_t MetaBytesLocked() const {
    return static_cast<int64_t>((next_ + kRowChunk - 1) >> kRowChunkShift) * kRowChunk * sizeof(RowMeta) +
           log_.bytes();
  }
  // Where a woken cleaner evicts down to: up to three batches below its
  // mark (at most a sixteenth of the budget, for small caches).
  int64_t CleanerLow() const { return budget_ - batch_ - std::min<int64_t>(3 * int64_t{batch_}, budget_ / 16); }
  void SetBudget() {
    int64_t per = static_cast<int64_t>(stride_) * 4 + sizeof(SlotInfo);
    budget_ = std::max<int64_t>(1, dram_bytes_ / per);
    batch_ = static_cast<uint32_t>(std::clamp<int64_t>(budget_ / 8, 1, LogSpace::kExtent));
  }

  float* Access(uint32_t r, bool write) const {
    RowMeta& m = Meta(r);
    uint32_t s = m.slot.load(std::memory_order_acquire);
    if (s == kNoSlot) {
      thread_local std::vector<uint32_t> one;
      one.assign(1, r);
      const_cast<TieredStore*>(this)->Load(one);
      s = m.slot.load(std::memory_order_acquire);
    }
    CountHit(m.owner);
    SlotInfo& in = Info(s);
    Policy::OnAccess(in.weight, m.heat.load(std::memory_order_relaxed));
    if (write && !in.dirty.load(std::memory_order_relaxed)) in.dirty.store(1, std::memory_order_relaxed);
    return SlotData(s);
  }

  // The cold rows of one batch (one segment's part: FaultMany's, PeekMany's):
  // each disk record and the buffer it is read into, put in disk order by
  // Sort so that rows written together come back in one preadv per run.
  struct ColdReads {
    std::vector<uint32_t> locs;
    std::vector<void*> dsts;
    std::vector<std::pair<uint32_t, void*>> pairs;
    void Add(uint32_t loc, void* dst) { pairs.emplace_back(loc, dst); }
    bool empty() const { return pairs.empty(); }
    size_t size() const { return pairs.size(); }
    // Fills locs/dsts in ascending location; returns the runs of adjacent records.
    int64_t Sort() {
      std::sort(pairs.begin(), pairs.end());
      locs.resize(pairs.size());
      dsts.resize(pairs.size());
      int64_t runs = 0;
      for (size_t j = 0; j < pairs.size(); ++j) {
        locs[j] = pairs[j].first;
        dsts[j] = pairs[j].second;
        runs += j == 0 || locs[j] != locs[j - 1] + 1;
      }
      return runs;
    }
  };
  // AccessMany's per-thread buffers.
  struct AccessScratch {
    std::vector<uint32_t> slots, miss;
    std::vector<uint8_t> heat;
  };
  // This thread's (emptied) batch of cold reads.
  static ColdReads& Cold() {
    thread_local ColdReads c;
    c.pairs.clear();
    return c;
  }

  // Brings rows (sorted, distinct, one owner segment whose lock the caller
  // holds, shared or not) into slots. The disk I/O (the batch's write-back,
  // the reads) runs outside mu_, so hits, other misses and other segments
  // never wait for it: the slots being filled are not yet published in
  // meta_[r].slot. A row counts as one miss; the access that follows counts
  // a hit, so the miss takes its hit back here.
  void Load(const std::vector<uint32_t>& rows) {
    std::unique_lock<std::mutex> l(mu_);
    thread_local std::vector<uint32_t> mine, others, slots;
    mine.clear();
    others.clear();
    for (uint32_t r : rows) {
      RowMeta& m = Meta(r);
      if (m.slot.load(std::memory_order_acquire) != kNoSlot) continue;
      if (m.flags.load(std::memory_order_relaxed) & kLoading) {
        others.push_back(r);  // another reader of this segment is reading it now
        continue;
      }
      m.flags.fetch_or(kLoading, std::memory_order_relaxed);
      mine.push_back(r);
    }
    if (!mine.empty()) {
      const uint16_t self = Meta(mine[0]).owner;
      misses_.fetch_add(mine.size(), std::memory_order_relaxed);
      hits_[self % kHitStripes].n.fetch_sub(mine.size(), std::memory_order_relaxed);
      auto undo = [&](size_t taken) {
        for (size_t i = 0; i < taken; ++i) ReleaseSlot(slots[i]);
        for (uint32_t r : mine) Meta(r).flags.fetch_and(static_cast<uint8_t>(~kLoading), std::memory_order_relaxed);
        if (waiters_) loaded_.notify_all();
      };
      slots.resize(mine.size());
      try {
        TakeSlots(mine.size(), self, l, slots.data());
      } catch (...) {
        undo(0);
        throw;
      }
      ColdReads& cold = Cold();
      for (size_t i = 0; i < mine.size(); ++i) {
        SlotInfo& in = Info(slots[i]);
        in.row = mine[i];  // pinned: the owner lock is ours, so no evictor takes it
        in.dirty.store(0, std::memory_order_relaxed);
        in.weight.store(0, std::memory_order_relaxed);
        in.second_chance = 0;
        const RowMeta& m = Meta(mine[i]);
        if (m.flags.load(std::memory_order_relaxed) & kOnDisk) cold.Add(m.loc, SlotData(slots[i]));
      }
      if (!cold.empty()) {
        read_calls_ += cold.Sort();
        l.unlock();
        try {
          file_.ReadMany(cold.locs.data(), cold.dsts.data(), cold.size());
        } catch (...) {
          l.lock();
          undo(mine.size());
          throw;
        }
        l.lock();
      }
      for (size_t i = 0; i < mine.size(); ++i) {
        RowMeta& m = Meta(mine[i]);
        m.slot.store(slots[i], std::memory_order_release);
        m.flags.fetch_and(static_cast<uint8_t>(~kLoading), std::memory_order_relaxed);
      }
      if (waiters_) loaded_.notify_all();
    }
    // Rows another reader was loading: wait for them; one whose load failed
    // (still cold, no longer loading) is loaded again by this thread.
    std::vector<uint32_t> retry;
    for (uint32_t r : others) {
      RowMeta& m = Meta(r);
      while (m.slot.load(std::memory_order_acquire) == kNoSlot && (m.flags.load(std::memory_order_relaxed) & kLoading)) {
        ++waiters_;
        loaded_.wait(l);
        --waiters_;
      }
      if (m.slot.load(std::memory_order_acquire) == kNoSlot) retry.push_back(r);
    }
    l.unlock();
    if (!retry.empty()) Load(retry);
  }

  // A refused write-back of an eviction on this thread: to the report open
  // here, else kept for the next fault (the cleaner's: it has none). mu_ held.
  void Refused(const std::string& message) {
    if (WriteBackReport::Deliver(message)) return;
    if (unreported_ == 0) unreported_message_ = message;
    ++unreported_;
  }
  // Refusals no operation was told of (the cleaner's), to the report open on
  // this thread if there is one, once. mu_ held.
  void DeliverUnreported() {
    if (unreported_ && WriteBackReport::Deliver(unreported_message_, unreported_)) unreported_ = 0;
  }

  // `k` slots for rows being faulted in, into out[0..k): free slots within
  // the budget, after evicting when the budget is reached (EvictUntil, which
  // may drop and retake mu_). Slots beyond the budget that the slot arrays do
  // not hold yet (new memory, never returned) are taken only when no row can
  // be evicted now: every candidate pinned (its owner segment busy, or this
  // thread's own) or the disk refused the write (the victims stay). A cleaner
  // short of CPU, or a load's hottest rows filling the cache, otherwise grew
  // a loading table's cache by a part per fault (to twice its budget).
  // mu_ held on entry and on return (`l`).
  void TakeSlots(size_t k, uint16_t self, std::unique_lock<std::mutex>& l, uint32_t* out) {
    EvictUntil(static_cast<int64_t>(k), budget_, self, l, /*spare_slots=*/true);
    DeliverUnreported();
    // Below the cleaner's mark (a batch short of the budget): wake it, so the
    // next faults find free slots instead of evicting.
    if (cleaner_idle_ && resident_ - evicting_ + static_cast<int64_t>(k) > budget_ - batch_) clean_cv_.notify_one();
    for (size_t i = 0; i < k; ++i) {
      if (free_slots_.empty()) GrowSlots();
      out[i] = free_slots_.back();
      free_slots_.pop_back();
      ++resident_;
    }
  }

  // Evicts rows, a batch at a time (EvictBatch), until `n` more fit under
  // `mark`: the resident rows, less the victims of batches being written
  // (their slots come free when the write ends), plus n. `self` is the
  // segment whose lock the caller holds (its rows are pinned for it;
  // kNoOwner: none); when no other segment ever had a row (a one-segment
  // table), it sweeps nothing: it could evict nothing. With `spare_slots`
  // it also stops when the slot arrays hold n free slots (a fault: taking
  // them overshoots the budget but allocates nothing). A batch short of room:
  //   - while another thread's batch is being written, waits for a batch's
  //     write to end, kMaxWaits times at most: that batch's victims' owner
  //     locks are the ones this sweep could not take, and its slots come free;
  //   - else sweeps again (each sweep bounded under mu_, which other threads
  //     get in between): a round of the hand that finds no victim still
  //     takes weight, so rows read more than once need several rounds. Once
  //     the hand has gone round kMaxRotations times without evicting, every
  //     candidate is pinned: it stops.
  // It stops at once when the disk refuses its write (the victims stay in
  // DRAM). mu_ held on entry and on return (`l`).
  void EvictUntil(int64_t n, int64_t mark, uint16_t self, std::unique_lock<std::mutex>& l, bool spare_slots) {
    uint64_t idle = 0;  // slots the hand passed since this call last evicted
    for (int waits = 0;;) {
      const int64_t over = resident_ - evicting_ + n - mark;
      if (over <= 0) return;
      const bool others = locks_ && OthersBound(self);
      Outcome o;
      size_t evicted = 0;
      if (others) {
        evicted = EvictBatch(static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(over, batch_), kMaxBatch)), self,
                             l, &o);
        if (o.refused || resident_ - evicting_ + n <= mark) return;
      }
      if (spare_slots && static_cast<int64_t>(free_slots_.size()) >= n) return;
      if (evicting_ > 0 && waits++ < kMaxWaits) {
        WaitForWrites(l, [] { return true; });
        continue;
      }
      idle = evicted > 0 ? 0 : idle + o.visited;
      if (!others || o.visited == 0 || idle >= kMaxRotations * static_cast<uint64_t>(nslot_chunks_) * kSlotChunk)
        return;
      l.unlock();
      l.lock();
    }
  }
  // Whether a segment other than `self` (kNoOwner: any segment) has ever had a row (Bind).
  bool OthersBound(uint16_t self) const {
    for (uint32_t i = 0; i < kBoundWords; ++i) {
      uint64_t w = bound_[i].load(std::memory_order_relaxed);
      if (i == static_cast<uint32_t>(self >> 6)) w &= ~(uint64_t{1} << (self & 63));
      if (w) return true;
    }
    return false;
  }
  // Waits (mu_ held, through `l`) for the end of a batch's write after which `done()` holds.
  template <typename Done>
  void WaitForWrites(std::unique_lock<std::mutex>& l, Done done) {
    ++write_waiters_;
    do {
      written_.wait(l);
    } while (!done());
    --write_waiters_;
  }

  // The owner segment locks one batch holds (a segment's lock taken once even
  // when several victims share it).
  struct HeldLocks {
    std::vector<uint16_t> owners;
    std::vector<std::unique_lock<std::shared_mutex>> locks;
    bool Has(uint16_t o) const { return std::find(owners.begin(), owners.end(), o) != owners.end(); }
    // True when `o`'s lock is (now) held by this batch.
    bool Take(uint16_t o, const SegmentLocks& seg) {
      if (Has(o)) return true;
      std::shared_mutex& mu = seg(o);
      if (!mu.try_lock()) return false;  // pinned by whoever holds it
      owners.push_back(o);
      locks.emplace_back(mu, std::adopt_lock);
      return true;
    }
  };

  // What one EvictBatch found besides the rows it evicted.
  struct Outcome {
    bool refused = false;  // the disk refused its write (the victims stay)
    uint64_t visited = 0;  // slots its sweep visited
  };
  // Evicts up to `want` rows (at least one batch when it can): victims from
  // a bounded sweep of the hand, their owner locks held; the ones that need
  // it written, with the live cold records of one sparse extent when the log
  // wants compacting, as runs of adjacent records outside mu_; then the
  // victims' slots freed. mu_ held on entry and on return. Returns the rows
  // evicted; in `o`, what else it found.
  size_t EvictBatch(uint32_t want, uint16_t self, std::unique_lock<std::mutex>& l, Outcome* o = nullptr) {
    if (!locks_) return 0;
    HeldLocks held;
    std::vector<uint32_t> victims;  // slots
    PickVictims(self, want, &held, &victims, o);
    if (victims.empty()) return 0;
    size_t evicted = 0;
    std::vector<uint32_t> writes;  // victims (slots) whose row needs a write
    int64_t rewrites = 0;          // of which rows with a disk copy (they take free room)
    for (uint32_t s : victims) {
      SlotInfo& in = Info(s);
      const bool on_disk = Meta(in.row).flags.load(std::memory_order_relaxed) & kOnDisk;
      if (in.dirty.load(std::memory_order_relaxed) || !on_disk) {
        writes.push_back(s);
        rewrites += on_disk;
      }
    }
    // Compaction (log_space.h): while free extents are short, the sparsest
    // extents' live cold records move with this batch, until the dead records
    // freed cover the free room the batch's rewrites take.
    std::vector<uint32_t> moves;     // rows whose live cold record moves
    std::vector<uint32_t> cleaning;  // the extents they leave
    for (int64_t freed = 0; freed < std::max<int64_t>(rewrites, 1);) {
      const uint32_t x = log_.PickToClean();
      if (x == LogSpace::kNone) break;
      cleaning.push_back(x);
      freed += log_.used(x) - log_.live_in(x);
      const uint32_t first = LogSpace::FirstOf(x);
      for (uint32_t loc = first; loc < first + log_.used(x); ++loc) {
        const uint32_t r = log_.row_of(loc);
        if (r >= next_) continue;
        RowMeta& m = Meta(r);
        if (!(m.flags.load(std::memory_order_relaxed) & kOnDisk) || m.loc != loc) continue;  // dead
        if (m.owner == self || m.owner == kNoOwner || !held.Take(m.owner, locks_)) continue;
        if (m.slot.load(std::memory_order_relaxed) != kNoSlot) {
          // Resident: drop the disk copy; the row is written when evicted.
          log_.Kill(loc);
          m.flags.fetch_and(static_cast<uint8_t>(~kOnDisk), std::memory_order_relaxed);
          Info(m.slot.load(std::memory_order_relaxed)).dirty.store(1, std::memory_order_relaxed);
          continue;
        }
        moves.push_back(r);
      }
      if (moves.size() + LogSpace::kMaxCleanLive > LogSpace::kMaxMoves) break;
    }
    evicting_ += victims.size();
    const bool written = WriteSlots(writes, &moves, &l);
    for (uint32_t x : cleaning) log_.DoneCleaning(x);
    if (!written) {
      Refused(last_failure_);
      if (o) o->refused = true;
    } else if (!writes.empty()) {
      unreported_ = 0;  // the disk takes rows again: refusals nobody was told of are past
    }
    evicting_ -= victims.size();
    if (evicting_ == 0) ++quiet_epoch_;
    for (uint32_t s : victims) {
      SlotInfo& in = Info(s);
      RowMeta& vm = Meta(in.row);
      if (in.dirty.load(std::memory_order_relaxed) || !(vm.flags.load(std::memory_order_relaxed) & kOnDisk)) {
        continue;  // its write failed: it stays
      }
      vm.slot.store(kNoSlot, std::memory_order_release);
      ReleaseSlot(s);
      ++evicted;
    }
    if (write_waiters_) written_.notify_all();
    return evicted;
  }

  // The cleaner: one thread per store that keeps a batch of slots free below
  // the budget (resident <= budget - batch_), so a miss usually takes a free
  // slot instead of writing back victims first. Woken when a fault takes the
  // cache above that mark, it evicts down to a lower one (CleanerLow), so
  // that one wake-up, sweep and write serve several batches' misses: woken
  // at the mark itself, it was woken, and took mu_ from the faulting
  // threads, for every batch_ misses. It owns no segment lock, so
  // every row is a candidate (a faulting thread cannot evict rows of the
  // segment it holds: with one segment only the cleaner evicts, between
  // batches). A round that evicts nothing (every candidate's segment busy,
  // or the disk refused the write) retries after a pause that doubles up to
  // 50 ms; faults wake it early.
  void CleanerLoop() {
    std::unique_lock<std::mutex> l(mu_);
    auto pause = std::chrono::microseconds(200);
    while (!stop_) {
      const int64_t excess = resident_ - evicting_ - CleanerLow();
      if (excess <= 0) {
        settled_.notify_all();
        cleaner_idle_ = true;
        clean_cv_.wait(l);
        cleaner_idle_ = false;
        continue;
      }
      const uint32_t want = static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(excess, batch_), kMaxBatch));
      size_t evicted = 0;
      try {
        evicted = EvictBatch(want, kNoOwner, l);
      } catch (const std::exception& e) {  // no slot changed; the next fault reports it
        write_failures_.fetch_add(1, std::memory_order_relaxed);
        last_failure_ = std::string("tiered storage: evicting rows failed: ") + e.what();
        Refused(last_failure_);
      }
      if (evicted > 0) {
        pause = std::chrono::microseconds(200);
        settled_.notify_all();
        continue;
      }
      cleaner_idle_ = true;
      clean_cv_.wait_for(l, pause);
      cleaner_idle_ = false;
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(50));
    }
  }
  void StopCleaner() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
      clean_cv_.notify_all();
    }
    if (cleaner_.joinable()) cleaner_.join();
  }

  // Writes the rows of `slots` and, when given, moves the cold records of
  // rows `moves` (compaction), in runs of adjacent records. Every row written
  // gets its new location and flags (its old record dies) and its slot is
  // marked clean. With `l`, the I/O runs without mu_ (the caller pins the rows:
  // their owner locks are held); without, under it (Relayout). False when the
  // disk refused a write (counted, the message kept; those rows unchanged).
  //
  // Each kind of write goes to its own stream (log_space.h): rows never
  // written (kNew), rows written before (kHot), moved records (kCold). A
  // batch whose first writes grow the live records past the reserve's share
  // also appends the reserve's next chunk, written with zeros in the same
  // unlocked stretch (one large write).
  bool WriteSlots(const std::vector<uint32_t>& victims, std::vector<uint32_t>* moves,
                  std::unique_lock<std::mutex>* l = nullptr) {
    const size_t nw = victims.size(), nm = moves ? moves->size() : 0, n = nw + nm;
    if (n == 0) return true;
    // The victims in stream order: first writes, then rewrites.
    thread_local std::vector<uint32_t> slots;
    slots.clear();
    for (uint32_t s : victims)
      if (!(Meta(Info(s).row).flags.load(std::memory_order_relaxed) & kOnDisk)) slots.push_back(s);
    const size_t nnew = slots.size();
    for (uint32_t s : victims)
      if (Meta(Info(s).row).flags.load(std::memory_order_relaxed) & kOnDisk) slots.push_back(s);
    std::vector<uint32_t> rows(n), locs(n);
    for (size_t i = 0; i < nw; ++i) rows[i] = Info(slots[i]).row;
    for (size_t i = 0; i < nm; ++i) rows[nw + i] = (*moves)[i];
    for (size_t i = 0; i < n;) {  // runs of adjacent records, within one stream each
      const LogSpace::Stream stream = i < nnew ? LogSpace::kNew : i < nw ? LogSpace::kHot : LogSpace::kCold;
      const size_t end = i < nnew ? nnew : i < nw ? nw : n;
      uint32_t first, got;
      try {
        got = log_.AllocRun(stream, rows.data() + i, static_cast<uint32_t>(std::min<size_t>(end - i, LogSpace::kExtent)),
                            &first);
      } catch (const std::length_error& e) {  // the file is full: refused like a full disk, nothing written
        for (size_t j = 0; j < i; ++j) log_.Kill(locs[j]);
        write_failures_.fetch_add(1, std::memory_order_relaxed);
        last_failure_ = std::string(e.what()) + "; every row stays in memory";
        return false;
      }
      for (uint32_t j = 0; j < got; ++j) locs[i + j] = first + j;
      i += got;
    }
    uint32_t reserve_first = 0, reserve_n = 0;
    if (nnew > 0) reserve_n = log_.ReserveGrowth(&reserve_first);
    const size_t rb = static_cast<size_t>(RecordBytes(stride_));
    if (l) l->unlock();
    // The victims' rows are written from their slots (pinned: their owner
    // locks are held), the moved records from one buffer.
    buf_mu_.lock();  // one batch at a time (the moves' buffer, reused)
    buf_.resize(nm * rb);
    std::vector<const void*> src(n);
    for (size_t i = 0; i < nw; ++i) src[i] = SlotData(slots[i]);
    for (size_t i = 0; i < nm; ++i) src[nw + i] = buf_.data() + i * rb;
    bool ok = true;
    int err = 0;
    try {
      if (nm) {
        std::vector<uint32_t> from(nm);
        std::vector<void*> dst(nm);
        for (size_t i = 0; i < nm; ++i) {
          from[i] = Meta((*moves)[i]).loc;
          dst[i] = buf_.data() + i * rb;
        }
        file_.ReadMany(from.data(), dst.data(), nm);  // a few extents, each ascending
      }
    } catch (const std::runtime_error&) {
      ok = false;
      err = EIO;
    }
    size_t written = 0;  // rows [0, written) are on disk at locs
    while (ok && written < n) {
      size_t j = written + 1;
      while (j < n && locs[j] == locs[j - 1] + 1) ++j;
      if (!file_.Write(locs[written], src.data() + written, j - written, &err)) {
        ok = false;
        break;
      }
      written = j;
    }
    std::vector<uint8_t> zero(written);
    for (size_t i = 0; i < written; ++i) zero[i] = IsZeroRow(static_cast<const float*>(src[i]), dim_);
    // The reserve's chunk: free whether or not the disk took the zeros (a
    // write into it later fails, and is refused, as any other would).
    if (reserve_n) file_.WriteZeros(LogSpace::FirstOf(reserve_first), size_t{reserve_n} * LogSpace::kExtent);
    buf_mu_.unlock();
    if (l) l->lock();
    if (reserve_n) log_.AddReserve(reserve_first, reserve_n);
    for (size_t i = 0; i < n; ++i) {
      if (i >= written) {
        log_.Kill(locs[i]);
        continue;
      }
      RowMeta& m = Meta(rows[i]);
      if (m.flags.load(std::memory_order_relaxed) & kOnDisk) log_.Kill(m.loc);
      m.loc = locs[i];
      m.flags.store(static_cast<uint8_t>(kOnDisk | (zero[i] ? kZero : 0)), std::memory_order_relaxed);
      if (i < nw) Info(slots[i]).dirty.store(0, std::memory_order_relaxed);
    }
    writebacks_ += static_cast<int64_t>(std::min(written, nw));
    compacted_ += static_cast<int64_t>(written > nw ? written - nw : 0);
    ++write_batches_;
    if (!ok) {
      write_failures_.fetch_add(1, std::memory_order_relaxed);
      last_failure_ = "tiered storage: writing rows to " + file_.dir() + " failed (" + std::strerror(err) +
                      "); every row stays in memory";
    }
    return ok;
  }

  // Up to `want` victims into `out` (slots): the hand sweeps slots; a slot at
  // zero weight whose owner segment is not `self` and is held or can be
  // locked now is chosen (its lock kept in `held` until the victims are
  // written and unpublished). At most kSweepPerVictim slots visited per
  // victim wanted. mu_ held.
  void PickVictims(uint16_t self, uint32_t want, HeldLocks* held, std::vector<uint32_t>* out,
                   Outcome* o = nullptr) {
    const uint64_t nslots = static_cast<uint64_t>(nslot_chunks_) * kSlotChunk;
    if (nslots == 0) return;
    const uint64_t limit = std::min<uint64_t>(static_cast<uint64_t>(want) * kSweepPerVictim, nslots);
    uint64_t step = 0;
    for (; step < limit && out->size() < want; ++step) {
      uint32_t s = hand_;
      hand_ = (hand_ + 1 == nslots) ? 0 : hand_ + 1;
      {
        // The metadata of a candidate a few slots ahead (its weight is out
        // now), so the visit below finds it in the CPU cache: the sweep runs
        // under mu_.
        const uint64_t a = s + kSweepAhead < nslots ? s + kSweepAhead : s + kSweepAhead - nslots;
        const SlotInfo& ahead = Info(static_cast<uint32_t>(a));
        if (ahead.row != kNoRowId && ahead.weight.load(std::memory_order_relaxed) == 0) PrefetchMeta(ahead.row);
      }
      SlotInfo& in = Info(s);
      if (in.row == kNoRowId) continue;
      // A slot being filled (its row not yet published) is owned by a
      // segment its loader holds: the try-lock below fails (or it is `self`).
      if (!Policy::Pass(in.weight)) continue;
      RowMeta& m = Meta(in.row);
      if (m.owner == self || m.owner == kNoOwner) continue;
      if (!held->Take(m.owner, locks_)) continue;
      if (m.version > newest_) newest_ = m.version;
      if (!in.second_chance && Policy::Recent(m.version, newest_)) {
        in.second_chance = 1;
        continue;
      }
      out->push_back(s);
    }
    if (o) o->visited = step;
  }

  // `chunks` chunks of slots: one slab of whole 2 MiB pages (huge pages,
  // AllocLarge) or, for one chunk that is not, a cache-line aligned block.
  static float* AllocSlots(int stride, uint32_t chunks) {
    const size_t chunk = static_cast<size_t>(kSlotChunk) * stride * sizeof(float);
    if (chunks * chunk % (size_t{2} << 20) == 0) return static_cast<float*>(AllocLarge(chunks * chunk));
    float* p = static_cast<float*>(std::aligned_alloc(64, (chunk + 63) / 64 * 64));
    if (!p) throw std::bad_alloc();
    return p;
  }
  // Frees every slot chunk (no slot in use, or the store ending). mu_ held or no other thread.
  void FreeSlotChunks() {
    for (uint32_t c = 0; c < nslot_chunks_; ++c) {
      if (slot_dir_[c].owns) std::free(slot_dir_[c].data);
      slot_dir_[c].data = nullptr;
      slot_dir_[c].owns = false;
      slot_dir_[c].info.reset();
    }
    nslot_chunks_ = 0;
  }
  void ReleaseSlot(uint32_t s) {  // mu_ held
    Info(s).row = kNoRowId;
    free_slots_.push_back(s);
    --resident_;
  }
  void GrowSlots() {  // mu_ held
    if (nslot_chunks_ >= kSlotChunks) throw std::length_error("tiered storage: too many resident rows");
    SlotChunk& ch = slot_dir_[nslot_chunks_];
    const uint32_t slab = SlotSlab(stride_);
    std::unique_ptr<SlotInfo[]> info(new SlotInfo[kSlotChunk]);
    if (nslot_chunks_ % slab == 0) {
      ch.data = AllocSlots(stride_, slab);
      ch.owns = true;
    } else {
      ch.data = slot_dir_[nslot_chunks_ - 1].data + static_cast<size_t>(kSlotChunk) * stride_;
    }
    ch.info = std::move(info);
    uint32_t base = nslot_chunks_ * kSlotChunk;
    for (uint32_t i = kSlotChunk; i-- > 0;) free_slots_.push_back(base + i);
    ++nslot_chunks_;
  }

  int stride_;
  const int dim_;  // the embedding width: the first stride at construction
  int64_t dram_bytes_ = 0;
  int64_t budget_ = 1;
  uint32_t batch_ = 1;  // rows one eviction batch aims at
  mutable Engine file_;
  LogSpace log_;
  SegmentLocks locks_;
  mutable std::mutex mu_;
  std::condition_variable loaded_;  // a row's kLoading cleared
  int waiters_ = 0;                 // threads waiting on loaded_ (mu_)
  std::condition_variable written_;  // a batch's write ended (evicting_ fell; EvictUntil, MakeRoom)
  int write_waiters_ = 0;            // threads waiting on written_ (mu_)
  mutable std::shared_mutex layout_mu_;           // exclusive: Relayout; shared: a ColdStream span read
  std::atomic<uint64_t> layout_epoch_{0};         // Relayouts so far
  mutable std::atomic<int64_t> stream_reads_{0};  // ColdStream spans read
  std::mutex buf_mu_;               // buf_: one write batch at a time
  std::vector<char> buf_;           // compaction's moved records
  uint32_t next_ = 0;
  std::vector<uint32_t> free_ids_;
  std::unique_ptr<RowMeta*[]> row_dir_;  // chunk -> its metadata (kMetaSlab chunks per allocation)
  std::unique_ptr<SlotChunk[]> slot_dir_;
  uint32_t nslot_chunks_ = 0;
  std::vector<uint32_t> free_slots_;
  int64_t resident_ = 0;
  int64_t allocated_since_scan_ = 0;  // row ids allocated since WriteNewRows last scanned (mu_)
  int64_t evicting_ = 0;  // victims of batches being written now (mu_ released)
  uint64_t quiet_epoch_ = 0;  // times evicting_ fell to 0 (mu_; MakeRoom waits for the next)
  std::thread cleaner_;              // CleanerLoop, from AttachLocks to the destructor
  mutable std::condition_variable clean_cv_;  // wakes the cleaner (mu_)
  mutable std::condition_variable settled_;   // the cleaner finished a round (mu_; Settle)
  bool cleaner_idle_ = false;         // the cleaner waits on clean_cv_ (mu_)
  bool stop_ = false;                 // the destructor asks the cleaner to end (mu_)
  uint32_t hand_ = 0;
  int64_t newest_ = -1;
  // Segments that have had a row (Bind), a bit each: segments_log2 is at most 12.
  static constexpr uint32_t kBoundWords = 4096 / 64;
  std::atomic<uint64_t> bound_[kBoundWords] = {};
  int64_t writebacks_ = 0, write_batches_ = 0, compacted_ = 0, read_calls_ = 0;
  // Hits are counted per owner segment stripe, one cache line each: a single
  // counter bumped by every thread on every row access cost more than the
  // access (the line ping-pongs between cores).
  struct alignas(64) Counter {
    std::atomic<int64_t> n{0};
  };
  static constexpr int kHitStripes = 64;
  mutable Counter hits_[kHitStripes];
  void CountHit(uint16_t owner) const { hits_[owner % kHitStripes].n.fetch_add(1, std::memory_order_relaxed); }
  void CountHits(uint16_t owner, int64_t n) const { hits_[owner % kHitStripes].n.fetch_add(n, std::memory_order_relaxed); }
  mutable std::atomic<int64_t> misses_{0};
  mutable std::atomic<int64_t> peek_reads_{0};  // PeekRows' runs of adjacent records read (no mu_)
  std::atomic<int64_t> write_failures_{0};
  std::string last_failure_;
  int64_t unreported_ = 0;          // refusals kept for the next fault (Refused; mu_)
  std::string unreported_message_;  // the first of them (mu_)
};

static_assert(IsRowStore<TieredStore<>>(), "TieredStore implements the row store contract (row_store.h)");

}  // namespace evstore
