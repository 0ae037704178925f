// RowArena: where embedding rows live (the in-memory row store; the contract
// it implements is in row_store.h).
//
// A row id (uint32) names one fixed-size slot of `stride` floats:
//     [ embedding (dim) | slot 0 (dim) | slot 1 (dim) | ... ]
// plus an int64 `version` kept beside it (global step of the last optimizer
// update, -1 = never updated).
//
// Layout: rows are carved from blocks that are never reallocated, so a row's
// address is stable for its whole life (index growth never touches rows).
// Block 0 holds 256 rows, block b in 1..8 holds 256<<(b-1) rows (doubling, so
// small tables stay small), every later block holds 65,536 rows. Block pointers
// sit in a two-level directory whose entries, once written, never change.
// Once the arena holds kReserveAfter big blocks, the next one or two big
// blocks are kept allocated and faulted in ahead of need by a background
// thread (block_reserve.h): new rows then land in mapped memory, and a batch
// of new keys does not wait for the kernel to fault, zero or compact pages.
//
// Invariants:
//  * A row id handed out by Allocate() stays valid until Free(); its block
//    exists and is published before the id leaves Allocate() (arena mutex).
//  * Freed ids go to a free list and are reused before the arena grows, so a
//    table with a constant live set has a constant arena.
//  * The only operation that moves rows is Relayout() (a new optimizer slot is
//    attached, widening every row once); the Table calls it with every segment
//    lock held, so no reader or writer can observe it.
//  * The arena never reads or writes row contents on its own except in
//    Relayout(); all other row access is done by callers holding the segment
//    lock of the key that owns the row.
//  * bytes() and version_bytes() count the reserve's blocks: memory held for
//    rows is reported whether or not rows live in it yet.
//  * Widening holds at most the new rows + WidenBoundBytes() (`ahead` new
//    big blocks, as many as the memory headroom allows and at least
//    kWidenAhead, and one old one) of row memory at any moment: each old
//    block is freed as soon as its rows are copied (RowMeter counts it).
#pragma once
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "block_reserve.h"
#include "collapse.h"
#include "first_touch.h"
#include "headroom.h"
#include "memory.h"
#include "row_store.h"
#include "zero_rows.h"

namespace evstore {

// Row memory an arena holds (the data and version arrays it allocated) and
// its high-water mark; shared with a widening's helper thread (which
// allocates blocks for it) so that each outlives the other safely.
class RowMeter {
 public:
  // Cache-line aligned (a 16-float row is exactly one line); huge-page
  // backed for large blocks where the kernel has huge pages cheap, else
  // small pages (memory.h, first_touch.h PlaceRows; with `all`, every page is
  // mapped on return). Throws std::bad_alloc.
  // With `zero`, every float of the block is +0.0 on return: a block of
  // 2 MiB or more (page-aligned, AllocLarge) is handed back to the kernel
  // first, since MADV_DONTNEED makes an anonymous private range read as zero
  // whatever the allocator reused and costs next to nothing on fresh memory
  // (no pages yet); where that fails, and for smaller blocks, it is cleared.
  float* Alloc(size_t n, int stride, bool all = false, bool zero = false) {
    const size_t bytes = n * stride * sizeof(float);
    float* p = static_cast<float*>(AllocLarge(bytes));
    if (zero) {
      constexpr size_t kHuge = size_t{2} << 20;
      const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;  // what AllocLarge allocated
      if (bytes < kHuge || madvise(p, rounded, MADV_DONTNEED) != 0) std::memset(p, 0, bytes);
    }
    const Pages pages = PlaceRows(p, bytes, all);
    Add(static_cast<int64_t>(bytes));
    Placed(p, bytes, pages);
    return p;
  }
  float* Alloc(size_t n, int stride, std::nothrow_t, bool all = false, bool zero = false) {
    try {
      return Alloc(n, stride, all, zero);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  // Alloc(..., nothrow, all) of a block whose every float is +0.0.
  float* AllocZero(size_t n, int stride, std::nothrow_t, bool all) { return Alloc(n, stride, std::nothrow, all, true); }
  void Add(int64_t bytes) {
    const int64_t now = held_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t top = peak_.load(std::memory_order_relaxed);
    while (now > top && !peak_.compare_exchange_weak(top, now, std::memory_order_relaxed)) {
    }
  }
  // A block of rows placed in `pages` (PlaceRows): a small-page one of 2 MiB
  // or more goes to the collapser (collapse.h), to become huge pages once the
  // process stops placing blocks.
  void Placed(void* p, size_t bytes, Pages pages) {
    constexpr size_t kHuge = CollapseList::kHugePage;
    if (pages != Pages::kSmall || bytes < kHuge || !Collapser::Enabled()) return;
    if (collapse_->Add(p, (bytes + kHuge - 1) / kHuge * kHuge)) Collapser::Submit(collapse_);
  }
  // Row memory is going away: nothing more of it is collapsed (waits out a
  // collapse in progress, at most one 2 MiB).
  void CloseCollapse() { collapse_->Close(); }
  int64_t collapse_pending_bytes() const { return collapse_->pending_bytes(); }
  void Free(void* p, size_t bytes) {
    collapse_->Forget(p, bytes);
    std::free(p);
    held_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }
  int64_t held() const { return held_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void ResetPeak() { peak_.store(held(), std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> held_{0}, peak_{0};
  std::shared_ptr<CollapseList> collapse_ = std::make_shared<CollapseList>();
};

class RowArena {
 public:
  static constexpr uint32_t kNoRow = kNoRowId;
  static constexpr uint32_t kMaxRows = kMaxRowIds;

  explicit RowArena(int stride) : stride_(stride) {}
  ~RowArena() { ReleaseAll(); }
  RowArena(const RowArena&) = delete;
  RowArena& operator=(const RowArena&) = delete;

  int stride() const { return stride_; }

  // Prefetches every cache line of a row's first `floats` floats. (Read
  // prefetches only: write-intent prefetch needs -mprfchw, which a portable
  // build lacks, and GCC then drops the instruction silently.)
  static void PrefetchRow(const float* row, int floats) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int off = 0; off < floats * 4; off += 64) __builtin_prefetch(p + off);
  }

  float* Row(uint32_t r) const {
    uint32_t b, off;
    Locate(r, &b, &off);
    return Block(b)->data + static_cast<size_t>(off) * stride_;
  }
  static constexpr bool kAllResident = true;
  const float* ReadRow(uint32_t r) const { return Row(r); }
  const float* PeekRow(uint32_t r, float*) const { return Row(r); }
  void FaultMany(const uint32_t*, size_t) const {}
  void PeekMany(const uint32_t* rows, size_t n, float* out) const {
    for (size_t i = 0; i < n; ++i) std::memcpy(out + i * stride_, Row(rows[i]), stride_ * sizeof(float));
  }
  // All rows are resident: no owner, hint or lock is needed (no-ops).
  void Bind(uint32_t, int) {}
  void Hint(uint32_t, uint32_t) const {}
  void AttachLocks(SegmentLocks) {}
  TierStats tier_stats() const { return TierStats{}; }
  bool RowIsZero(uint32_t r, int dim) const { return IsZeroRow(Row(r), dim); }
  int64_t& Version(uint32_t r) const {
    uint32_t b, off;
    Locate(r, &b, &off);
    return Block(b)->versions[off];
  }

  // Returns a fresh or recycled row id. Contents are unspecified; the caller
  // initialises the row (under its segment lock) before publishing the key.
  uint32_t Allocate() {
    uint32_t r;
    AllocateMany(1, &r);
    return r;
  }

  // n row ids under one lock acquisition: recycled ids first, then fresh ones.
  void AllocateMany(size_t n, uint32_t* out) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t k = 0; k < n; ++k) {
      if (!free_.empty()) {
        out[k] = free_.back();
        free_.pop_back();
        continue;
      }
      // Row ids stay below 2^31: entries use the ids above for filtered
      // keys' last-seen steps (evict_policy.h).
      if (next_ >= kMaxRows) throw std::length_error("table is full (2^31 rows)");
      uint32_t b, off;
      Locate(next_, &b, &off);
      if (off == 0) EnsureBlock(b);
      out[k] = next_++;
    }
  }

  void Free(uint32_t r) {
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(r);
  }

  int64_t free_rows() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(free_.size());
  }
  int64_t rows_in_use() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(next_) - static_cast<int64_t>(free_.size());
  }
  // Bytes held by row storage (data + versions) and by the free list.
  int64_t bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    int64_t total = static_cast<int64_t>(free_.capacity()) * 4;
    for (uint32_t b = 0; b < nblocks_; ++b)
      total += static_cast<int64_t>(BlockRows(b)) * (stride_ * 4 + 8);
    const auto reserved = reserve_.bytes();
    return total + reserved.first + reserved.second;
  }
  // Row bytes only (embedding + slots) vs metadata bytes (versions), for the
  // memory report: metadata counts towards "bytes per key".
  int64_t version_bytes() const {
    std::lock_guard<std::mutex> l(mu_);
    int64_t total = reserve_.bytes().second;
    for (uint32_t b = 0; b < nblocks_; ++b) total += static_cast<int64_t>(BlockRows(b)) * 8;
    return total;
  }

  // Widening rows for new optimizer slots (a one-time relayout), in bounded
  // extra memory. Each block's rows are copied into a new block of the new
  // stride, and the old block is freed as soon as they are; new blocks are
  // allocated and faulted in (the kernel's page faults and zeroing, most of a
  // widening's cost) by a helper thread at most `ahead` blocks ahead of the
  // copy, where `ahead` is every block that fits in the memory headroom
  // PrepareWiden is given (headroom.h: what the machine and the cgroup have
  // free, less a margin), never fewer than kWidenAhead. So the arena's rows
  // never hold more than
  //     new rows + WidenBoundBytes(old, new, ahead) = `ahead` new big blocks
  //                                                   + one old big block
  // (checked by held_bytes()'s high-water mark), and never more than old +
  // new rows.
  //   PrepareWiden(new_stride[, headroom_bytes])
  //                              no table lock: starts the helper, which
  //                              prepares the first `ahead` blocks (with
  //                              ample memory: every block); the table waits
  //                              for them (Widened::WaitPrepared) before it
  //                              takes its segment locks;
  //   Relayout(new_stride, ...)  every segment lock held: copies block by
  //                              block, the helper faulting the next blocks
  //                              meanwhile (a block the helper has not begun
  //                              is allocated by the copying thread itself;
  //                              blocks created since PrepareWiden too).
  // The trade, only where memory is short: blocks past the first `ahead` are
  // faulted while the locks are held, beside the copy.
  static constexpr uint32_t kWidenAhead = 4;
  static int64_t WidenBoundBytes(int old_stride, int new_stride, uint32_t ahead = kWidenAhead) {
    return static_cast<int64_t>(ahead) * (int64_t{1} << kBigShift) * new_stride * 4 +
           (int64_t{1} << kBigShift) * old_stride * 4;
  }
  // Blocks to prepare ahead of the copy: every block when all the new rows
  // fit in `headroom_bytes`, else as many new big blocks as fit (any window
  // of that many blocks fits: small blocks are smaller), at least
  // kWidenAhead, at most nblocks.
  static uint32_t WidenAhead(uint32_t nblocks, int new_stride, int64_t headroom_bytes) {
    int64_t all = 0;
    for (uint32_t b = 0; b < nblocks; ++b) all += static_cast<int64_t>(BlockRows(b)) * new_stride * 4;
    if (all <= headroom_bytes) return nblocks;
    const int64_t big = (int64_t{1} << kBigShift) * new_stride * 4;
    const int64_t fit = std::max<int64_t>(0, headroom_bytes) / big;
    return static_cast<uint32_t>(std::min<int64_t>(nblocks, std::max<int64_t>(fit, kWidenAhead)));
  }

  class Widened {
   public:
    Widened(int stride, uint32_t nblocks, uint32_t ahead, std::shared_ptr<RowMeter> meter)
        : stride_(stride),
          nblocks_(nblocks),
          ahead_(std::max(ahead, kWidenAhead)),
          meter_(std::move(meter)),
          data_(nblocks, nullptr),
          ready_(nblocks, 0) {
      if (nblocks_ > 0) helper_ = std::thread([this] { Run(); });
    }
    ~Widened() {
      {
        std::lock_guard<std::mutex> l(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      if (helper_.joinable()) helper_.join();
      for (uint32_t b = 0; b < nblocks_; ++b)
        if (data_[b]) meter_->Free(data_[b], BlockRows(b) * stride_ * sizeof(float));
    }
    Widened(const Widened&) = delete;
    Widened& operator=(const Widened&) = delete;
    int stride() const { return stride_; }
    // Blocks prepared ahead of the copy at most (WidenAhead).
    uint32_t ahead() const { return ahead_; }
    // Blocks the helper has prepared that Relayout has not taken yet: it
    // stops at ahead() (or every block) until Relayout takes some.
    uint32_t ready() const {
      std::lock_guard<std::mutex> l(mu_);
      uint32_t n = 0;
      for (uint32_t b = taken_; b < claimed_; ++b) n += ready_[b];
      return n;
    }
    // Waits until the helper has done all it may before Relayout takes a
    // block (min(ahead(), blocks) prepared, or tried); returns ready().
    uint32_t WaitPrepared() {
      std::unique_lock<std::mutex> l(mu_);
      const uint32_t want = std::min(nblocks_, ahead_);
      cv_.wait(l, [&] {
        if (taken_ > 0) return true;
        if (claimed_ < want) return false;
        for (uint32_t b = 0; b < want; ++b)
          if (!ready_[b]) return false;
        return true;
      });
      uint32_t n = 0;
      for (uint32_t b = taken_; b < claimed_; ++b) n += ready_[b];
      return n;
    }
    // Blocks Relayout had to allocate itself, under the locks (not prepared).
    uint32_t allocated_in_copy() const {
      std::lock_guard<std::mutex> l(mu_);
      return in_copy_;
    }

    // Block b's new memory, prepared or (the helper has not begun it, could
    // not allocate it, or it is a block created since) allocated here, every
    // float +0.0 (RowMeter::AllocZero); null only when the allocation fails.
    // Blocks are taken in ascending order.
    float* Take(uint32_t b) {
      float* p = nullptr;
      if (b >= nblocks_) {
        {
          std::lock_guard<std::mutex> l(mu_);
          ++in_copy_;
        }
        return meter_->AllocZero(BlockRows(b), stride_, std::nothrow, false);
      }
      {
        std::unique_lock<std::mutex> l(mu_);
        if (b >= claimed_) {
          claimed_ = b + 1;  // the helper skips it
        } else {
          cv_.wait(l, [&] { return ready_[b] != 0; });
          p = data_[b];
          data_[b] = nullptr;
        }
        taken_ = b + 1;
        if (!p) ++in_copy_;
      }
      cv_.notify_all();
      return p ? p : meter_->AllocZero(BlockRows(b), stride_, std::nothrow, false);
    }

   private:
    // The helper: claims blocks in order while fewer than ahead_ are
    // claimed and not taken; allocates and faults each outside the mutex.
    void Run() {
      for (;;) {
        uint32_t b;
        {
          std::unique_lock<std::mutex> l(mu_);
          cv_.wait(l, [&] { return stop_ || claimed_ >= nblocks_ || claimed_ < taken_ + ahead_; });
          if (stop_ || claimed_ >= nblocks_) return;
          b = claimed_++;
        }
        // Every page mapped now; no memory: Take() finds null and tries itself.
        float* p = meter_->AllocZero(BlockRows(b), stride_, std::nothrow, true);
        {
          std::lock_guard<std::mutex> l(mu_);
          data_[b] = p;
          ready_[b] = 1;
        }
        cv_.notify_all();
      }
    }

    const int stride_;
    const uint32_t nblocks_;  // blocks when PrepareWiden ran
    const uint32_t ahead_;    // blocks prepared ahead of the copy at most
    std::shared_ptr<RowMeter> meter_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<float*> data_;   // per block: prepared and not yet taken
    std::vector<uint8_t> ready_;  // per block: the helper is done with it
    uint32_t claimed_ = 0;       // blocks [0, claimed_) begun by the helper or Take
    uint32_t taken_ = 0;         // blocks [0, taken_) handed to Relayout
    uint32_t in_copy_ = 0;       // blocks Take allocated itself
    bool stop_ = false;
    std::thread helper_;
  };
  // `headroom_bytes`: memory the widening may take beyond what the arena
  // holds (the table passes none: MemoryHeadroomBytes(), read now).
  std::unique_ptr<Widened> PrepareWiden(int new_stride) const {
    return PrepareWiden(new_stride, MemoryHeadroomBytes());
  }
  std::unique_ptr<Widened> PrepareWiden(int new_stride, int64_t headroom_bytes) const {
    uint32_t nblocks;
    {
      std::lock_guard<std::mutex> l(mu_);
      nblocks = nblocks_;
    }
    return std::make_unique<Widened>(new_stride, nblocks, WidenAhead(nblocks, new_stride, headroom_bytes), meter_);
  }

  // Widens every row from `stride_` to `new_stride` floats: the first
  // `stride_` floats are copied, the rest filled from `tail_init`
  // (new_stride - stride_ values; a tail of +0.0, Adam's m and v, is
  // already there: Take's blocks come zeroed, so the copy under the locks
  // writes the old floats only, a third of the bytes at two slots). Caller
  // holds every segment lock. Throws
  // std::bad_alloc when a block's new memory cannot be had; the rows are then
  // as before, at the old stride (blocks already widened are narrowed back in
  // place and keep their wider memory until the next widening or the end).
  void Relayout(int new_stride, const std::vector<float>& tail_init, Widened* prepared) {
    std::lock_guard<std::mutex> l(mu_);
    std::unique_ptr<Widened> own;
    if (!prepared || prepared->stride() != new_stride) {
      own = std::make_unique<Widened>(new_stride, 0, 0, meter_);
      prepared = own.get();
    }
    reserve_.Want(0, 0, 0);  // blocks of the old stride are of no use now
    const size_t tail_bytes = (new_stride - stride_) * sizeof(float);
    const bool zero_tail = std::all_of(tail_init.begin(), tail_init.end(), [](float x) {
      uint32_t u;
      std::memcpy(&u, &x, sizeof u);
      return u == 0;  // +0.0 exactly (-0.0 is written)
    });
    for (uint32_t b = 0; b < nblocks_; ++b) {
      BlockRec* blk = Block(b);
      const size_t n = BlockRows(b);
      float* nd = prepared->Take(b);
      if (!nd) {
        Narrow(b, new_stride);
        throw std::bad_alloc();
      }
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(nd + i * new_stride, blk->data + i * stride_, stride_ * sizeof(float));
        if (!zero_tail) std::memcpy(nd + i * new_stride + stride_, tail_init.data(), tail_bytes);
      }
      meter_->Free(blk->data, n * blk->alloc_stride * sizeof(float));
      blk->data = nd;
      blk->alloc_stride = new_stride;
    }
    stride_ = new_stride;
    if (nblocks_ > kFirstBig) RefillReserve();
  }

  // Bytes of row memory (data and versions) the arena holds now, not counting
  // the reserve's blocks (bytes() does) but counting a widening's prepared
  // blocks; and its high-water mark since ResetHeldPeak().
  int64_t held_bytes() const { return meter_->held(); }
  // Bytes of small-page row blocks still waiting for the collapser (collapse.h).
  int64_t collapse_pending_bytes() const { return meter_->collapse_pending_bytes(); }
  int64_t held_peak() const { return meter_->peak(); }
  void ResetHeldPeak() { meter_->ResetPeak(); }

 private:
  struct BlockRec {
    float* data = nullptr;
    int64_t* versions = nullptr;
    int alloc_stride = 0;  // floats per row the data was allocated for (>= stride_)
  };
  static constexpr uint32_t kSmall = 256;           // rows in block 0
  static constexpr uint32_t kBigShift = 16;         // later blocks: 65,536 rows
  static constexpr uint32_t kBigStart = 1u << 16;   // first row of block 9
  static constexpr uint32_t kFirstBig = 9;
  static constexpr uint32_t kDirFanout = 1024;
  static constexpr uint32_t kDirTop = 70;           // 70 * 1024 blocks > 2^32 rows
  static constexpr uint32_t kReserveAfter = 8;      // big blocks per reserved block
  static_assert(kReserveAfter >= 8, "the reserve holds at most an eighth of the arena's big blocks' bytes");

  static void Locate(uint32_t r, uint32_t* b, uint32_t* off) {
    if (r < kSmall) {
      *b = 0;
      *off = r;
    } else if (r < kBigStart) {
      uint32_t lg = 31 - __builtin_clz(r);  // r in [2^lg, 2^(lg+1)), lg >= 8
      *b = lg - 7;
      *off = r - (1u << lg);
    } else {
      *b = kFirstBig + ((r - kBigStart) >> kBigShift);
      *off = (r - kBigStart) & ((1u << kBigShift) - 1);
    }
  }
  static size_t BlockRows(uint32_t b) {
    if (b == 0) return kSmall;
    if (b < kFirstBig) return static_cast<size_t>(kSmall) << (b - 1);
    return static_cast<size_t>(1) << kBigShift;
  }
  BlockRec* Block(uint32_t b) const { return &dir_[b / kDirFanout][b % kDirFanout]; }

  void EnsureBlock(uint32_t b) {  // mu_ held
    if (!dir_[b / kDirFanout]) dir_[b / kDirFanout].reset(new BlockRec[kDirFanout]);
    BlockRec* blk = Block(b);
    size_t n = BlockRows(b);
    ReservedBlock r;
    if (b >= kFirstBig && reserve_.Take(BigDataBytes(), BigVersionBytes(), &r)) {
      blk->data = static_cast<float*>(r.data);
      blk->versions = static_cast<int64_t*>(r.versions);
      meter_->Add(static_cast<int64_t>(BigDataBytes() + BigVersionBytes()));
      meter_->Placed(r.data, BigDataBytes(), r.pages);
    } else {
      blk->data = meter_->Alloc(n, stride_);
      try {
        blk->versions = static_cast<int64_t*>(AllocLarge(n * sizeof(int64_t)));
      } catch (const std::bad_alloc&) {
        meter_->Free(blk->data, n * stride_ * sizeof(float));
        blk->data = nullptr;
        throw;
      }
      meter_->Add(static_cast<int64_t>(n * sizeof(int64_t)));
    }
    blk->alloc_stride = stride_;
    nblocks_ = b + 1;
    if (b >= kFirstBig) RefillReserve();
  }
  // Big blocks to keep ready: none while the arena has fewer than
  // kReserveAfter big blocks, then one per kReserveAfter, at most
  // kMaxReserveBlocks.
  void RefillReserve() {  // mu_ held
    reserve_.Want(static_cast<int>((nblocks_ - kFirstBig) / kReserveAfter), BigDataBytes(), BigVersionBytes());
  }
  size_t BigDataBytes() const { return (size_t{1} << kBigShift) * stride_ * sizeof(float); }
  static size_t BigVersionBytes() { return (size_t{1} << kBigShift) * sizeof(int64_t); }
  // Undoes a Relayout that widened blocks [0, upto) to `wide` floats a row
  // and then failed: their rows are narrowed back to stride_ in place (row i
  // moves from i * wide to i * stride_, never forward). mu_ held.
  void Narrow(uint32_t upto, int wide) {
    for (uint32_t b = 0; b < upto; ++b) {
      float* d = Block(b)->data;
      for (size_t i = 1; i < BlockRows(b); ++i)
        std::memmove(d + i * stride_, d + i * wide, stride_ * sizeof(float));
    }
  }
  void ReleaseAll() {
    meter_->CloseCollapse();
    for (uint32_t b = 0; b < nblocks_; ++b) {
      std::free(Block(b)->data);
      std::free(Block(b)->versions);
    }
  }

  int stride_;
  std::shared_ptr<RowMeter> meter_ = std::make_shared<RowMeter>();
  mutable std::mutex mu_;
  uint32_t next_ = 0;
  uint32_t nblocks_ = 0;
  std::vector<uint32_t> free_;
  std::unique_ptr<BlockRec[]> dir_[kDirTop];
  BlockReserve reserve_;
};

static_assert(IsRowStore<RowArena>(), "RowArena implements the row store contract (row_store.h)");

}  // namespace evstore
