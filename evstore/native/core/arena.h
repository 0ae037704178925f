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
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "block_reserve.h"
#include "memory.h"
#include "row_store.h"
#include "zero_rows.h"

namespace evstore {

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

  // Widening rows for new optimizer slots happens in two steps so that the
  // expensive part, getting fresh memory from the kernel (page faults and
  // zeroing, most of a widening's cost), runs while lookups and
  // applies continue:
  //   PrepareWiden(new_stride)   no table lock: allocates and pre-faults a
  //                              wider buffer for every existing block;
  //   Relayout(new_stride, ...)  every segment lock held: copies rows into the
  //                              prepared buffers (blocks created since are
  //                              allocated here) and swaps them in.
  struct Widened {
    int stride = 0;
    std::vector<float*> data;  // per block, or empty
    ~Widened() {
      for (float* p : data) std::free(p);
    }
  };
  std::unique_ptr<Widened> PrepareWiden(int new_stride) const {
    uint32_t nblocks;
    {
      std::lock_guard<std::mutex> l(mu_);
      nblocks = nblocks_;
    }
    auto w = std::make_unique<Widened>();
    w->stride = new_stride;
    for (uint32_t b = 0; b < nblocks; ++b) {
      size_t bytes = BlockRows(b) * new_stride * sizeof(float);
      float* p = AllocRows(BlockRows(b), new_stride);
      FaultIn(p, bytes);
      w->data.push_back(p);
    }
    return w;
  }

  // Widens every row from `stride_` to `new_stride` floats: the first
  // `stride_` floats are copied, the rest filled from `tail_init`
  // (new_stride - stride_ values). Caller holds every segment lock.
  void Relayout(int new_stride, const std::vector<float>& tail_init, Widened* prepared) {
    std::lock_guard<std::mutex> l(mu_);
    for (uint32_t b = 0; b < nblocks_; ++b) {
      BlockRec* blk = Block(b);
      size_t n = BlockRows(b);
      float* nd;
      if (prepared && prepared->stride == new_stride && b < prepared->data.size()) {
        nd = prepared->data[b];
        prepared->data[b] = nullptr;
      } else {
        nd = AllocRows(n, new_stride);
      }
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(nd + i * new_stride, blk->data + i * stride_, stride_ * sizeof(float));
        std::memcpy(nd + i * new_stride + stride_, tail_init.data(),
                    (new_stride - stride_) * sizeof(float));
      }
      std::free(blk->data);
      blk->data = nd;
    }
    stride_ = new_stride;
    if (nblocks_ > kFirstBig) RefillReserve();  // frees blocks of the old stride
  }

 private:
  struct BlockRec {
    float* data = nullptr;
    int64_t* versions = nullptr;
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
    } else {
      blk->data = AllocRows(n, stride_);
      blk->versions = static_cast<int64_t*>(AllocLarge(n * sizeof(int64_t)));
    }
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
  // Cache-line aligned (a 16-float row is exactly one line); huge-page
  // backed for large blocks (memory.h).
  static float* AllocRows(size_t n, int stride) {
    return static_cast<float*>(AllocLarge(n * stride * sizeof(float)));
  }
  void ReleaseAll() {
    for (uint32_t b = 0; b < nblocks_; ++b) {
      std::free(Block(b)->data);
      std::free(Block(b)->versions);
    }
  }

  int stride_;
  mutable std::mutex mu_;
  uint32_t next_ = 0;
  uint32_t nblocks_ = 0;
  std::vector<uint32_t> free_;
  std::unique_ptr<BlockRec[]> dir_[kDirTop];
  BlockReserve reserve_;
};

static_assert(IsRowStore<RowArena>(), "RowArena implements the row store contract (row_store.h)");

}  // namespace evstore
