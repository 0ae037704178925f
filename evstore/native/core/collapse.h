// Small-page row blocks turned into huge pages later, off the insert path.
//
// Why: the gate (first_touch.h) places a row block in small pages when a
// huge-page first touch is costly on this machine at that moment, which keeps
// the inserting threads fast; but finds and applies then read those rows
// through small pages, 10-28% dearer at 10M x 64 (BENCHMARKS.md), and the
// kernel's khugepaged collapses them far too slowly to matter (4,096 pages
// every 10 s by default). The Collapser asks the kernel to collapse them now
// (madvise MADV_COLLAPSE, Linux 6.1+: it allocates a huge page, copies the
// 512 small pages into it and maps it in their place; contents never change)
// from a background thread of its own, once no row block has been placed in
// the process for kQuietNs: a table being filled (or widened) is left alone,
// and a filled table gets its huge pages before it is read for long.
//
// Layout
//   CollapseList (one per arena, shared by the arena's RowMeter and the
//   collapser through a shared_ptr, so either may go first):
//     blocks    small-page blocks still to collapse: [start, end) and how far
//               the collapser has come
//     busy      the 2 MiB the collapser is collapsing now (mutex released)
//     closed    the arena is going: nothing more is collapsed
//     queued    the list is on the collapser's queue
//   Collapser: the process's one collapsing thread, started on first use,
//   never stopped (it sleeps while no list has blocks), nice +10 so that the
//   process's own lookups and inserts come first when both cores are busy.
//
// Invariants
//  * Only a range a list holds is collapsed, and a block's memory is freed
//    only after Forget() (or Close()) has returned: Forget waits for a busy
//    chunk inside the block, so the collapser never touches freed memory.
//  * Nobody waits for the kernel while holding CollapseList::mu; Forget and
//    Close wait (on the condition variable) for at most one 2 MiB collapse.
//  * Lock order: CollapseList::mu -> Collapser's queue mutex is never held
//    together: the arena submits after releasing the list's mutex.
//  * The rows' contents are the same before, during and after a collapse (the
//    kernel keeps readers and writers of the 2 MiB out while it copies); only
//    the page size changes.
//  * On unless EVSTORE_HUGE_COLLAPSE=0 is set in the process's environment
//    (BENCHMARKS.md: finds of rows left in small pages 14-33% cheaper, a
//    lookup stall of up to ~16 ms once after a fill on a quiet machine). Where
//    the kernel lacks MADV_COLLAPSE (EINVAL), nothing is collapsed
//    (khugepaged may still do it, slowly).
#pragma once
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "first_touch.h"
#include "process_worker.h"

namespace evstore {

#ifdef MADV_COLLAPSE
inline constexpr int kMadvCollapse = MADV_COLLAPSE;
#elif defined(__linux__)
inline constexpr int kMadvCollapse = 25;  // <asm-generic/mman-common.h>; glibc 2.36 lacks it
#else
inline constexpr int kMadvCollapse = -1;
#endif

struct CollapseList {
  struct Range {
    char* start;
    char* end;
    char* next;  // [start, next) done
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Range> blocks;
  char* busy = nullptr;  // start of the 2 MiB being collapsed, or null
  bool closed = false, queued = false;

  // A block placed in small pages (2 MiB aligned, whole 2 MiB pages). Returns
  // whether the list must be submitted to the collapser (it was not queued).
  bool Add(void* p, size_t bytes) {
    std::lock_guard<std::mutex> l(mu);
    if (closed) return false;
    char* c = static_cast<char*>(p);
    blocks.push_back(Range{c, c + bytes, c});
    if (queued) return false;
    queued = true;
    return true;
  }
  // The block at `p` is about to be freed: drop it, and wait out a collapse
  // inside it.
  void Forget(void* p, size_t bytes) {
    char* c = static_cast<char*>(p);
    std::unique_lock<std::mutex> l(mu);
    for (auto it = blocks.begin(); it != blocks.end();) {
      if (it->start < c + bytes && c < it->end) {
        it = blocks.erase(it);
      } else {
        ++it;
      }
    }
    cv.wait(l, [&] { return !(busy && busy < c + bytes && c < busy + kHugePage); });
  }
  // The arena is going: nothing more is collapsed; waits out a busy chunk.
  void Close() {
    std::unique_lock<std::mutex> l(mu);
    closed = true;
    blocks.clear();
    cv.wait(l, [&] { return busy == nullptr; });
  }
  int64_t pending_bytes() {
    std::lock_guard<std::mutex> l(mu);
    int64_t n = 0;
    for (const Range& r : blocks) n += r.end - r.next;
    return n;
  }

  static constexpr size_t kHugePage = size_t{2} << 20;
};

struct CollapseStats {
  int64_t collapsed_bytes = 0;  // 2 MiB chunks the kernel collapsed
  int64_t failed_chunks = 0;    // chunks it refused (no huge page to be had, ...)
  int64_t cpu_ns = 0;           // the collapsing thread's CPU time in madvise
};

class Collapser {
 public:
  // No row block placed in the process for this long: collapse.
  static constexpr int64_t kQuietNs = 500 * 1000000LL;
  // After a refused chunk, wait this long before the next.
  static constexpr int64_t kBackoffNs = 1000 * 1000000LL;

  // Whether collapsing is on in this process (kernel and environment).
  static bool Enabled() {
    if (kMadvCollapse < 0) return false;
    static const bool on = [] {
      const char* e = std::getenv("EVSTORE_HUGE_COLLAPSE");
      return !(e && std::strcmp(e, "0") == 0);
    }();
    return on && !Instance().unsupported_.load(std::memory_order_relaxed);
  }

  static void Submit(std::shared_ptr<CollapseList> list) {
    Collapser& c = Instance();
    {
      std::lock_guard<std::mutex> l(c.mu_);
      c.queue_.push_back(std::move(list));
    }
    c.cv_.notify_one();
  }

  static CollapseStats Stats() {
    Collapser& c = Instance();
    CollapseStats s;
    s.collapsed_bytes = c.collapsed_.load(std::memory_order_relaxed);
    s.failed_chunks = c.failed_.load(std::memory_order_relaxed);
    s.cpu_ns = c.cpu_ns_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  Collapser() : pid_(getpid()) { std::thread([this] { Run(); }).detach(); }

  friend Collapser& ProcessWorker<Collapser>();
  static Collapser& Instance() { return ProcessWorker<Collapser>(); }

  void Run() {
#ifdef __linux__
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);  // this thread only
    pthread_setname_np(pthread_self(), "ev-collapse");  // at most 15 characters
#endif
    for (;;) {
      std::shared_ptr<CollapseList> list;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return !queue_.empty(); });
        list = queue_.front();
      }
      // Wait for the process's row blocks to stop being placed.
      const int64_t idle = MonoNs() - HugePageGate::Process().last_place_ns();
      if (idle < kQuietNs) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(kQuietNs - idle));
        continue;
      }
      char* chunk = nullptr;
      {
        std::lock_guard<std::mutex> l(list->mu);
        if (!list->closed && !list->blocks.empty() && !unsupported_.load(std::memory_order_relaxed)) {
          chunk = list->blocks.front().next;
          list->busy = chunk;
        } else {
          list->queued = false;
          list->blocks.clear();
        }
      }
      if (!chunk) {
        std::lock_guard<std::mutex> l(mu_);
        queue_.pop_front();
        continue;
      }
      const int64_t t0 = ThreadCpuNs();
      const int rc = madvise(chunk, CollapseList::kHugePage, kMadvCollapse);
      const int err = rc == 0 ? 0 : errno;
      cpu_ns_.fetch_add(ThreadCpuNs() - t0, std::memory_order_relaxed);
      if (rc == 0) {
        collapsed_.fetch_add(static_cast<int64_t>(CollapseList::kHugePage), std::memory_order_relaxed);
      } else if (err == EINVAL) {
        unsupported_.store(true, std::memory_order_relaxed);  // no MADV_COLLAPSE in this kernel
      } else {
        failed_.fetch_add(1, std::memory_order_relaxed);
      }
      {
        std::lock_guard<std::mutex> l(list->mu);
        list->busy = nullptr;
        // The block may have been forgotten meanwhile: advance it only if it is still the front.
        if (!list->blocks.empty() && list->blocks.front().next == chunk) {
          CollapseList::Range& r = list->blocks.front();
          r.next += CollapseList::kHugePage;
          if (r.next >= r.end) list->blocks.pop_front();
        }
      }
      list->cv.notify_all();
      if (rc != 0 && err != EINVAL) std::this_thread::sleep_for(std::chrono::nanoseconds(kBackoffNs));
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<CollapseList>> queue_;
  std::atomic<bool> unsupported_{false};
  std::atomic<int64_t> collapsed_{0}, failed_{0}, cpu_ns_{0};
};

}  // namespace evstore
