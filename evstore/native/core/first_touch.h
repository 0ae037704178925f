// First touch of new row memory: huge pages where the kernel has them cheap,
// small pages where it does not.
//
// Why: a row block is advised as transparent huge pages (memory.h) because
// finds and applies read rows at random and huge pages spare them TLB misses.
// But the first touch of a huge page is not always cheap. Where no free 2 MiB
// page is at hand, the faulting thread compacts memory first (THP defrag
// "madvise"); in a VM whose balloon takes freed memory back (free page
// reporting works on 2 MiB blocks and larger), a free 2 MiB page is one the
// host must back again, page by page, while small pages come from fragments
// it never gave back. Measured on the benchmark VM (BENCHMARKS.md): huge
// pages faulted at 0.44-2.3 GB/s there against 3 GB/s for small pages, and at
// 20 GB/s when freed memory was at hand; most of a process's first table's
// insert cost was that.
//
// Policy (HugePageGate, one per process, lock-free):
//   * A block of 2 MiB or more is placed by PlaceRows: advised huge, its first
//     2 MiB faulted now (MADV_POPULATE_WRITE) and timed in the faulting
//     thread's CPU time: the probe.
//   * A probe within kCheapNs (1 ms for 2 MiB, 2 GB/s: as fast as small pages
//     fault here) leaves the block huge: its other pages fault as huge pages
//     when first written (or now, when the caller asks for all of them).
//   * A dearer probe places the rest of the block in small pages, all faulted
//     now, and the next kSmallAfterCostly bytes of blocks (64 MiB) in small
//     pages without a probe; then the gate probes again (the machine's memory
//     changes: memory freed a moment ago, by this process or another, makes
//     huge pages cheap again). A costly probe wastes a few milliseconds, so
//     probes cost a small fraction of the small pages placed between them.
//   * A block placed in small pages is advised huge again once every page is
//     mapped: no later fault makes a huge page of it; unless
//     EVSTORE_HUGE_COLLAPSE=0, the arena hands it to the collapser
//     (collapse.h), which makes huge pages of it once the process has placed
//     no row block for a while (khugepaged would too, but at its default
//     pace, 16 MiB every 10 s, not before the table is read).
//   * The gate notes when a row block was last placed (last_place_ns): the
//     collapser's sign that no table is being filled or widened.
// Invariants: the rows' contents are the same either way (only the page size
// differs, never what a reader sees); a block PlaceRows returns is advised
// huge over all of it (VmFlags "hg"); a small-page block has every page
// mapped when PlaceRows returns.
#pragma once
#include <sys/mman.h>
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "memory.h"

namespace evstore {

// A clock's reading in ns; ThreadCpuNs: this thread's CPU time; MonoNs: the monotonic clock
// (the gate's last placement, the collapser's quiet wait).
inline int64_t ClockNs(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}
inline int64_t ThreadCpuNs() { return ClockNs(CLOCK_THREAD_CPUTIME_ID); }
inline int64_t MonoNs() { return ClockNs(CLOCK_MONOTONIC); }

class HugePageGate {
 public:
  static constexpr int64_t kCheapNs = 1000000;  // thread CPU ns for one 2 MiB probe
  static constexpr int64_t kSmallAfterCostly = int64_t{64} << 20;
  static_assert(kCheapNs > 0 && kSmallAfterCostly >= (int64_t{2} << 20), "a probe has a cost bound and a costly one a pause");

  // Whether a block of `bytes` should probe a huge page (else: small pages,
  // counted against the pause after a costly probe).
  bool ShouldProbe(size_t bytes) {
    int64_t s = skip_.load(std::memory_order_relaxed);
    while (s > 0) {
      const int64_t left = s > static_cast<int64_t>(bytes) ? s - static_cast<int64_t>(bytes) : 0;
      if (skip_.compare_exchange_weak(s, left, std::memory_order_relaxed)) return false;
    }
    return true;
  }
  // A probe's cost in thread CPU ns; returns whether the block stays huge.
  bool Record(int64_t probe_ns) {
    if (probe_ns <= kCheapNs) return true;
    skip_.store(kSmallAfterCostly, std::memory_order_relaxed);
    costly_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  int64_t costly_probes() const { return costly_.load(std::memory_order_relaxed); }
  // A row block was placed now (CLOCK_MONOTONIC ns); when the last one was.
  void Placed() { last_place_.store(MonoNs(), std::memory_order_relaxed); }
  int64_t last_place_ns() const { return last_place_.load(std::memory_order_relaxed); }
  // Bytes still to place in small pages before the next probe.
  int64_t bytes_before_probe() const { return skip_.load(std::memory_order_relaxed); }

  static HugePageGate& Process() {
    static HugePageGate gate;
    return gate;
  }

 private:
  std::atomic<int64_t> skip_{0};
  std::atomic<int64_t> costly_{0};
  std::atomic<int64_t> last_place_{0};
};

enum class Pages { kHuge, kSmall };

// Places a block from AllocLarge(bytes) by the gate's policy (above); with
// `all`, every page is mapped when it returns, else at least the probed 2 MiB
// of a huge block. Blocks under 2 MiB are small pages as AllocLarge made them
// (faulted now only with `all`). `probe_ns` (tests) stands for the probe's
// measured cost when >= 0.
inline Pages PlaceRows(void* p, size_t bytes, bool all, HugePageGate& gate = HugePageGate::Process(),
                       int64_t probe_ns = -1) {
  constexpr size_t kHuge = size_t{2} << 20;
  char* c = static_cast<char*>(p);
  struct NotePlaced {
    HugePageGate& g;
    ~NotePlaced() { g.Placed(); }
  } note{gate};
  if (bytes < kHuge) {
    if (all) FaultIn(p, bytes);
    return Pages::kSmall;
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;  // what AllocLarge allocated and advised
  size_t done = 0;
  if (gate.ShouldProbe(rounded)) {
    const int64_t t0 = ThreadCpuNs();
    FaultIn(c, kHuge);
    const int64_t cost = ThreadCpuNs() - t0;
    done = kHuge;
    if (gate.Record(probe_ns >= 0 ? probe_ns : cost)) {
      if (all) FaultIn(c + done, rounded - done);
      return Pages::kHuge;
    }
  }
  if (done < rounded) {
#if defined(MADV_NOHUGEPAGE) && defined(MADV_HUGEPAGE)
    madvise(c + done, rounded - done, MADV_NOHUGEPAGE);
    FaultIn(c + done, rounded - done);
    madvise(c + done, rounded - done, MADV_HUGEPAGE);
#else
    FaultIn(c + done, rounded - done);
#endif
  }
  return Pages::kSmall;
}

}  // namespace evstore
