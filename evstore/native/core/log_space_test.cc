// TF-free tests of the tier file's layout (log_space.h): streams, the
// reserve, compaction's choice. No I/O: LogSpace is bookkeeping only. Built
// and run by tests/native/CMakeLists.txt (make test-native).
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "log_space.h"
#include "test_check.h"

using namespace evstore;
static constexpr uint32_t E = LogSpace::kExtent;

// Writes rows [from, from + n) to stream s, returning each row's location.
static std::vector<uint32_t> Write(LogSpace& log, LogSpace::Stream s, uint32_t from, uint32_t n) {
  std::vector<uint32_t> locs;
  std::vector<uint32_t> rows(n);
  for (uint32_t i = 0; i < n; ++i) rows[i] = from + i;
  for (uint32_t i = 0; i < n;) {
    uint32_t first;
    const uint32_t got = log.AllocRun(s, rows.data() + i, n - i, &first);
    for (uint32_t j = 0; j < got; ++j) locs.push_back(first + j);
    i += got;
  }
  return locs;
}
// Appends every reserve chunk due now (as the store does after a batch of first writes).
static void GrowReserve(LogSpace& log) {
  for (uint32_t first, k; (k = log.ReserveGrowth(&first)) > 0;) log.AddReserve(first, k);
}

// A load's first writes append extents and, beside them, free extents for
// one record in eight of the live ones; the first writes never take them.
static void test_first_writes_grow_the_file_and_leave_the_reserve_free() {
  LogSpace log;
  const uint32_t n = 400 * E;
  for (uint32_t r = 0; r < n; r += E) {
    Write(log, LogSpace::kNew, r, E);
    GrowReserve(log);
  }
  CHECK_EQ(log.live(), int64_t{n});
  CHECK(log.reserve_records() >= int64_t{n} / 8 - LogSpace::kReserveChunk * E);
  CHECK(log.reserve_records() <= int64_t{n} / 8);
  CHECK_EQ(log.free_records(), log.reserve_records());
  CHECK_EQ(log.records(), int64_t{n} + log.reserve_records());
}

// Rewrites take the reserve's free extents: the file does not grow until
// they are used up.
static void test_rewrites_reuse_free_extents_before_the_file_grows() {
  LogSpace log;
  const uint32_t n = 400 * E;
  std::vector<uint32_t> loc = Write(log, LogSpace::kNew, 0, n);
  GrowReserve(log);
  const int64_t size = log.records(), reserve = log.free_records();
  CHECK(reserve >= 40 * E);
  // Rewrite rows spread over the file (one in every few), kill their old records.
  uint32_t rewritten = 0;
  for (uint32_t r = 0; rewritten + E <= reserve; r += 7 * E + 3, r %= n) {
    std::vector<uint32_t> fresh = Write(log, LogSpace::kHot, r, 1);
    log.Kill(loc[r]);
    loc[r] = fresh[0];
    ++rewritten;
  }
  CHECK_EQ(log.records(), size);
  CHECK_EQ(log.grown_by_rewrites(), int64_t{0});
  CHECK_EQ(log.live(), int64_t{n});
}

// Once free extents run short, the sparsest closed extent is the one to
// clean; one more than three quarters live is never cleaned.
static void test_compaction_picks_the_sparsest_extent_once_free_room_runs_short() {
  LogSpace log;
  std::vector<uint32_t> loc = Write(log, LogSpace::kNew, 0, 10 * E);
  CHECK_EQ(log.PickToClean(), LogSpace::kNone);  // nothing reserved, nothing sparse
  // Extent 3 loses 200 records, extent 5 loses 100, extent 7 loses 40.
  for (uint32_t i = 0; i < 200; ++i) log.Kill(loc[3 * E + i]);
  for (uint32_t i = 0; i < 100; ++i) log.Kill(loc[5 * E + i]);
  for (uint32_t i = 0; i < 40; ++i) log.Kill(loc[7 * E + i]);
  CHECK_EQ(log.PickToClean(), 3u);
  CHECK_EQ(log.PickToClean(), 5u);  // 3 is being cleaned: the next sparsest
  CHECK_EQ(log.PickToClean(), LogSpace::kNone);  // 7 has 216 of 256 live: too dense
  log.DoneCleaning(5);  // nothing moved: a candidate again
  CHECK_EQ(log.PickToClean(), 5u);
  // Cleaning 3 moves its live records; it is free once they are.
  std::vector<uint32_t> moved = Write(log, LogSpace::kCold, 3 * E + 200, E - 200);
  for (uint32_t i = 200; i < E; ++i) log.Kill(loc[3 * E + i]);
  log.DoneCleaning(3);
  CHECK_EQ(log.free_records(), int64_t{E});
  CHECK(LogSpace::ExtentOf(moved[0]) != 3u);
}

// A file at its cap takes first writes into the reserve rather than refusing
// them; with nothing free left, it refuses.
static void test_a_capped_file_gives_its_reserve_to_first_writes() {
  LogSpace log(200 * E);
  for (uint32_t r = 0; r < 150 * E; r += E) {
    Write(log, LogSpace::kNew, r, E);
    GrowReserve(log);
  }
  const int64_t free_before = log.free_records();
  CHECK(free_before > 0);
  const int64_t room = 200 * int64_t{E} - log.records() + free_before;
  Write(log, LogSpace::kNew, 1 << 20, static_cast<uint32_t>(room));
  CHECK_EQ(log.records(), 200 * int64_t{E});
  CHECK_EQ(log.free_records(), int64_t{0});
  CHECK_THROWS(Write(log, LogSpace::kNew, 1 << 21, 1), std::length_error);
}

// Streams keep separate open extents: rewrites never land in an extent of
// first writes, moves never in one of rewrites.
static void test_each_stream_writes_its_own_extents() {
  LogSpace log;
  std::vector<uint32_t> a = Write(log, LogSpace::kNew, 0, 10);
  std::vector<uint32_t> b = Write(log, LogSpace::kHot, 100, 10);
  std::vector<uint32_t> c = Write(log, LogSpace::kCold, 200, 10);
  CHECK(LogSpace::ExtentOf(a[0]) != LogSpace::ExtentOf(b[0]));
  CHECK(LogSpace::ExtentOf(b[0]) != LogSpace::ExtentOf(c[0]));
  CHECK(LogSpace::ExtentOf(a[0]) != LogSpace::ExtentOf(c[0]));
  CHECK_EQ(log.grown_by_rewrites(), int64_t{2} * E);  // no free extent: both grew the file
  CHECK_EQ(log.row_of(b[3]), 103u);
}

// A held file (an export streaming it) reuses nothing, the reserve included.
static void test_extents_freed_while_held_wait_for_the_last_unhold() {
  LogSpace log;
  std::vector<uint32_t> loc = Write(log, LogSpace::kNew, 0, 3 * E);
  Write(log, LogSpace::kNew, 3 * E, 1);  // extent 3 open: 0..2 closed
  log.Hold();
  for (uint32_t i = 0; i < E; ++i) log.Kill(loc[E + i]);
  CHECK_EQ(log.free_records(), int64_t{0});
  log.Unhold();
  CHECK_EQ(log.free_records(), int64_t{E});
}

int main() {
  RUN(test_first_writes_grow_the_file_and_leave_the_reserve_free);
  RUN(test_rewrites_reuse_free_extents_before_the_file_grows);
  RUN(test_compaction_picks_the_sparsest_extent_once_free_room_runs_short);
  RUN(test_a_capped_file_gives_its_reserve_to_first_writes);
  RUN(test_each_stream_writes_its_own_extents);
  RUN(test_extents_freed_while_held_wait_for_the_last_unhold);
  std::printf("all tests passed\n");
  return 0;
}
