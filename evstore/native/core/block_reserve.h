// BlockReserve: an arena's next row blocks, allocated and faulted in before
// they are needed, by one background thread per process (the prefaulter).
//
// Why: inserting a key with a new row writes memory the process has never
// touched. The kernel faults and zeroes it on first touch and, for a block
// advised as transparent huge pages (memory.h), may first compact memory to
// find a free 2 MiB page: on a shared VM that is most of an insert's cost
// (perf: clear_page_erms, isolate_freepages_block under the row memcpy), and
// it swings by 50x with the machine's memory state. The prefaulter pays it
// outside the inserting thread, between batches; an insert finds the block
// mapped. If the reserve is empty when a block is needed (the prefaulter fell
// behind), the arena allocates the block itself, exactly as without a reserve.
//
// Layout
//   ReserveState (shared by the arena and the prefaulter through a shared_ptr,
//   so an arena may go away while the prefaulter is faulting a block for it):
//     shape     data_bytes + version_bytes of the blocks wanted (the arena's
//               big-block size at its current stride)
//     depth     how many faulted blocks to keep ready (0..kMaxReserveBlocks)
//     ready     the faulted blocks, each of exactly `shape`
//     closed    the arena is gone: blocks are freed, none are made
//     queued    the state is on the prefaulter's queue (at most once)
//
// Invariants
//  * Every ready block has the current shape; changing the shape (the arena
//    widens its rows) frees the others. ready.size() <= depth.
//  * Nobody faults memory while holding ReserveState::mu: the arena's calls
//    (Take, Want, Close, bytes) only move pointers, never wait for the kernel.
//  * Lock order: the arena's mutex -> ReserveState::mu -> the prefaulter's
//    queue mutex. The prefaulter takes the last two, never both at once.
//  * Reserved bytes are memory the table holds: the arena reports them with
//    its rows (RowArena::bytes()).
#pragma once
#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "first_touch.h"
#include "process_worker.h"
#include "memory.h"

namespace evstore {

inline constexpr int kMaxReserveBlocks = 2;

struct ReservedBlock {
  void* data = nullptr;
  void* versions = nullptr;
  Pages pages = Pages::kHuge;  // where PlaceRows put the data (first_touch.h)
};

struct ReserveState {
  std::mutex mu;
  size_t data_bytes = 0, version_bytes = 0;
  int depth = 0;
  bool closed = false, queued = false;
  std::vector<ReservedBlock> ready;

  // Blocks still to make for the current shape (mu held).
  bool NeedsMore() const { return !closed && depth > 0 && static_cast<int>(ready.size()) < depth; }
  void FreeReady() {  // mu held
    for (ReservedBlock& b : ready) {
      std::free(b.data);
      std::free(b.versions);
    }
    ready.clear();
  }
};

// The process's one prefaulting thread. Started on first use and never
// stopped (it sleeps when no reserve wants blocks); a forked child that
// uses a reserve starts its own.
class Prefaulter {
 public:
  static void Submit(std::shared_ptr<ReserveState> s) {
    Prefaulter& p = Instance();
    {
      std::lock_guard<std::mutex> l(p.mu_);
      p.queue_.push_back(std::move(s));
    }
    p.cv_.notify_one();
  }

 private:
  Prefaulter() : pid_(getpid()) { std::thread([this] { Run(); }).detach(); }

  friend Prefaulter& ProcessWorker<Prefaulter>();
  static Prefaulter& Instance() { return ProcessWorker<Prefaulter>(); }

  void Run() {
    for (;;) {
      std::shared_ptr<ReserveState> s;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return !queue_.empty(); });
        s = std::move(queue_.front());
        queue_.pop_front();
      }
      Fill(*s);
    }
  }

  // Makes blocks until the reserve holds `depth` of the current shape.
  static void Fill(ReserveState& s) {
    for (;;) {
      size_t db, vb;
      {
        std::lock_guard<std::mutex> l(s.mu);
        if (!s.NeedsMore()) {
          s.queued = false;
          return;
        }
        db = s.data_bytes;
        vb = s.version_bytes;
      }
      ReservedBlock b;
      try {
        b.data = AllocLarge(db);
        b.versions = AllocLarge(vb);
      } catch (const std::bad_alloc&) {  // no memory to spare: the arena allocates on demand
        std::free(b.data);
        std::lock_guard<std::mutex> l(s.mu);
        s.queued = false;
        return;
      }
      b.pages = PlaceRows(b.data, db, true);  // huge pages where cheap (first_touch.h), every page mapped
      FaultIn(b.versions, vb);
      std::lock_guard<std::mutex> l(s.mu);
      if (s.NeedsMore() && s.data_bytes == db && s.version_bytes == vb) {
        s.ready.push_back(b);
      } else {
        std::free(b.data);
        std::free(b.versions);
      }
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<ReserveState>> queue_;
};

class BlockReserve {
 public:
  BlockReserve() : s_(std::make_shared<ReserveState>()) {}
  ~BlockReserve() {
    std::lock_guard<std::mutex> l(s_->mu);
    s_->closed = true;
    s_->FreeReady();
  }
  BlockReserve(const BlockReserve&) = delete;
  BlockReserve& operator=(const BlockReserve&) = delete;

  // A ready block of exactly this shape, or false (allocate it yourself).
  bool Take(size_t data_bytes, size_t version_bytes, ReservedBlock* out) {
    std::lock_guard<std::mutex> l(s_->mu);
    if (s_->ready.empty() || s_->data_bytes != data_bytes || s_->version_bytes != version_bytes) return false;
    *out = s_->ready.back();
    s_->ready.pop_back();
    return true;
  }

  // Keep `depth` blocks of this shape ready (blocks of another shape are
  // freed); wakes the prefaulter if blocks are missing. Never waits for it.
  void Want(int depth, size_t data_bytes, size_t version_bytes) {
    depth = depth < 0 ? 0 : (depth > kMaxReserveBlocks ? kMaxReserveBlocks : depth);
    std::lock_guard<std::mutex> l(s_->mu);
    if (s_->data_bytes != data_bytes || s_->version_bytes != version_bytes) {
      s_->FreeReady();
      s_->data_bytes = data_bytes;
      s_->version_bytes = version_bytes;
    }
    s_->depth = depth;
    while (static_cast<int>(s_->ready.size()) > depth) {
      std::free(s_->ready.back().data);
      std::free(s_->ready.back().versions);
      s_->ready.pop_back();
    }
    if (s_->NeedsMore() && !s_->queued) {
      s_->queued = true;
      Prefaulter::Submit(s_);
    }
  }

  // Bytes held in ready blocks: (data, versions).
  std::pair<int64_t, int64_t> bytes() const {
    std::lock_guard<std::mutex> l(s_->mu);
    const int64_t n = static_cast<int64_t>(s_->ready.size());
    return {n * static_cast<int64_t>(s_->data_bytes), n * static_cast<int64_t>(s_->version_bytes)};
  }

 private:
  std::shared_ptr<ReserveState> s_;
};

}  // namespace evstore
