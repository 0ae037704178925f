// TF-free tests of core/collapse.h (row blocks placed in small pages are
// collapsed into huge pages by a background thread once the process stops
// placing blocks). Driven by tests/native/CMakeLists.txt (make test-native).
// No timing thresholds: waits are for an outcome, bounded only so that a
// broken collapser fails instead of hanging. Where the kernel has no
// MADV_COLLAPSE (before Linux 6.1) or THP is off, the page-size checks are
// skipped and the rest (contents, lifetimes) still run.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"
#include "collapse.h"
#include "first_touch.h"
#include "test_check.h"

using namespace evstore;

// The collapser is off by default (collapse.h): these tests switch it on
// before its first use in this process.
static const int kCollapseOn = setenv("EVSTORE_HUGE_COLLAPSE", "1", 1);

namespace {

constexpr size_t kHuge = size_t{2} << 20;

// kB of AnonHugePages in the mappings overlapping [p, p + bytes) (/proc/self/smaps).
long HugeKbOver(const void* p, size_t bytes) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  long kb = 0;
  const uintptr_t lo_x = reinterpret_cast<uintptr_t>(p), hi_x = lo_x + bytes;
  while (std::getline(f, line)) {
    unsigned long lo, hi;
    char dash;
    std::istringstream head(line);
    if (line.find(':') > line.find(' ') && (head >> std::hex >> lo >> dash >> hi) && dash == '-') {
      in = lo < hi_x && lo_x < hi;
      continue;
    }
    if (in && line.rfind("AnonHugePages:", 0) == 0) kb += std::atol(line.c_str() + 14);
  }
  return kb;
}

// Whether this kernel collapses a 2 MiB small-page range on request.
bool KernelCollapses() {
  void* p = AllocLarge(kHuge);
  madvise(p, kHuge, MADV_NOHUGEPAGE);
  FaultIn(p, kHuge);
  madvise(p, kHuge, MADV_HUGEPAGE);
  const bool ok = kMadvCollapse >= 0 && madvise(p, kHuge, kMadvCollapse) == 0;
  std::free(p);
  return ok;
}

// Makes the process's gate send the next 64 MiB of row blocks to small pages.
void NextBlocksSmall() { HugePageGate::Process().Record(HugePageGate::kCheapNs + 1); }

float RowValue(uint32_t r, int j) { return static_cast<float>(r) * 0.5f + static_cast<float>(j); }

void FillRows(RowArena& a, const std::vector<uint32_t>& ids) {
  for (uint32_t r : ids)
    for (int j = 0; j < a.stride(); ++j) a.Row(r)[j] = RowValue(r, j);
}

bool RowsExact(const RowArena& a, const std::vector<uint32_t>& ids) {
  for (uint32_t r : ids)
    for (int j = 0; j < a.stride(); ++j)
      if (a.Row(r)[j] != RowValue(r, j)) return false;
  return true;
}

// Waits until the arena has no small-page bytes waiting (at most a minute).
bool WaitCollapsed(const RowArena& a) {
  for (int i = 0; i < 600 && a.collapse_pending_bytes() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return a.collapse_pending_bytes() == 0;
}

void test_small_page_row_blocks_become_huge_pages_once_blocks_stop_being_placed() {
  const bool kernel = KernelCollapses();
  RowArena a(16);  // big blocks of 65,536 rows x 64 bytes = 4 MiB
  NextBlocksSmall();
  std::vector<uint32_t> ids(65536 + 4 * 65536);
  a.AllocateMany(ids.size(), ids.data());
  FillRows(a, ids);
  const uint32_t last = ids.back();
  const float* big = a.Row(last - 65535);  // the start of the last big block
  if (!kernel) {
    std::printf("  (no MADV_COLLAPSE here: page sizes not checked)\n");
    CHECK(RowsExact(a, ids));
    return;
  }
  CHECK(WaitCollapsed(a));
  CHECK(HugeKbOver(big, 2 * kHuge) >= 4096);  // the 4 MiB block is huge pages now
  CHECK(Collapser::Stats().collapsed_bytes >= int64_t{4} << 20);
  CHECK(RowsExact(a, ids));
}

void test_rows_read_back_exactly_while_their_blocks_are_collapsed() {
  RowArena a(64);  // 16 MiB big blocks
  NextBlocksSmall();
  std::vector<uint32_t> ids(3 * 65536);
  a.AllocateMany(ids.size(), ids.data());
  FillRows(a, ids);
  std::atomic<bool> stop{false}, wrong{false};
  std::thread reader([&] {
    while (!stop.load()) {
      if (!RowsExact(a, ids)) wrong = true;
    }
  });
  WaitCollapsed(a);
  stop = true;
  reader.join();
  CHECK(!wrong.load());
  CHECK(RowsExact(a, ids));
}

void test_an_arena_freed_before_its_blocks_are_collapsed_leaves_nothing_to_collapse() {
  for (int round = 0; round < 3; ++round) {
    RowArena a(64);
    NextBlocksSmall();
    std::vector<uint32_t> ids(2 * 65536);
    a.AllocateMany(ids.size(), ids.data());
  }  // each arena freed before or while its blocks are collapsed
  const int64_t after_free = Collapser::Stats().collapsed_bytes;
  std::this_thread::sleep_for(std::chrono::nanoseconds(2 * Collapser::kQuietNs));
  CHECK_EQ(Collapser::Stats().collapsed_bytes, after_free);
}

void test_widening_rows_forgets_the_old_blocks_and_collapses_the_new() {
  const bool kernel = KernelCollapses();
  RowArena a(16);
  NextBlocksSmall();
  std::vector<uint32_t> ids(3 * 65536);
  a.AllocateMany(ids.size(), ids.data());
  FillRows(a, ids);
  NextBlocksSmall();
  const std::vector<float> tail(16, 7.f);
  a.Relayout(32, tail, nullptr);  // frees every old block, places new ones (small pages)
  CHECK(WaitCollapsed(a));
  for (uint32_t r : ids) {
    for (int j = 0; j < 16; ++j) CHECK(a.Row(r)[j] == RowValue(r, j));
    for (int j = 16; j < 32; ++j) CHECK(a.Row(r)[j] == 7.f);
  }
  if (kernel) CHECK(HugeKbOver(a.Row(ids.back() - 65535), 4 * kHuge) >= 8192);
}

}  // namespace

TEST_MAIN(
  RUN(test_small_page_row_blocks_become_huge_pages_once_blocks_stop_being_placed);
  RUN(test_rows_read_back_exactly_while_their_blocks_are_collapsed);
  RUN(test_an_arena_freed_before_its_blocks_are_collapsed_leaves_nothing_to_collapse);
  RUN(test_widening_rows_forgets_the_old_blocks_and_collapses_the_new);
)
