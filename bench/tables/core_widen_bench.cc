// Core benchmark of the one-time widening of every row when Adam's two slots
// arrive (Table::EnsureSlots -> RowArena::PrepareWiden/Relayout). One source
// compiled against two trees' evstore/native/core headers and run alternately:
//   g++ -std=c++17 -O3 -pthread -I <tree>/evstore/native/core -I <tensorflow include>
//       bench/tables/core_widen_bench.cc -o widen
//   ./widen [keys] [dim] [readers]
// Builds a table of `keys` x `dim` (default 1M x 64), then widens it while
// `readers` threads (default 1; 0: none, as in a training process's first
// apply, where nothing else uses the table) look up 64 random keys at a time,
// and prints one JSON line:
//   widen_s          the EnsureSlots call, wall time
//   stall_ms         the longest single lookup during it (the segment locks'
//                    hold, as a lookup sees it), and stall_p50_ms its median
//   rss_before_mib   VmRSS before; rss_after_mib after
//   peak_over_mib    VmHWM during the widening (reset before it through
//                    /proc/self/clear_refs) minus the RSS after: the memory
//                    the widening held beyond the widened table
//   huge_pages_mib   AnonHugePages after it (rows in transparent huge pages)
//   widen_user_s, widen_sys_s, widen_minflt
//                    the process's CPU time (all threads: with no readers,
//                    the widening's own) and minor faults during it
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <sys/resource.h>
#include <vector>
#include "table.h"
using namespace evstore;
using Clock = std::chrono::steady_clock;

// Every op of this benchmark runs on its calling thread.
static void OnCaller(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& w) { w(0, total); }
static double StatusMib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::atof(line.c_str() + std::strlen(field)) / 1024.0;
  return -1;
}
static double HugeMib() {  // transparent huge pages the process maps
  std::ifstream f("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("AnonHugePages:", 0) == 0) return std::atof(line.c_str() + 14) / 1024.0;
  return -1;
}
static void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }
static rusage Usage() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u;
}
static double Sec(const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; }
static double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 1000000;
  const int dim = argc > 2 ? std::atoi(argv[2]) : 64;
  const int readers = argc > 3 ? std::atoi(argv[3]) : 1;
  const int64_t B = 65536;
  ParallelFor pf = OnCaller;
  TableConfig c;
  c.dim = dim;
  for (int i = 0; i < 64 * dim; ++i) c.bank.push_back(0.01f * (i % 97));
  Table<int64_t> t(c);
  std::vector<int64_t> keys(N);
  for (int64_t i = 0; i < N; ++i) keys[i] = (i * 0x9E3779B97F4A7C15LL) & ((1LL << 62) - 1);
  {
    std::vector<float> out(B * dim);
    for (int64_t s = 0; s < N; s += B) t.FindOrInsert(keys.data() + s, std::min(B, N - s), out.data(), pf);
  }
  std::atomic<bool> stop{false};
  std::vector<std::pair<Clock::time_point, Clock::time_point>> spans;  // each lookup's start and end
  std::vector<std::vector<std::pair<Clock::time_point, Clock::time_point>>> per(readers);
  std::vector<std::thread> threads;
  for (int r = 0; r < readers; ++r)
    threads.emplace_back([&, r] {
      std::vector<int64_t> b(64);
      std::vector<float> out(64 * dim);
      uint64_t x = 88172645463325252ull + r;
      while (!stop.load()) {
        for (auto& k : b) k = keys[(x ^= x << 13, x ^= x >> 7, x ^= x << 17) % N];
        auto t0 = Clock::now();
        t.Find(b.data(), 64, out.data(), pf);
        per[r].emplace_back(t0, Clock::now());
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double rss_before = StatusMib("VmRSS:");
  ResetPeakRss();
  const rusage u0 = Usage();
  auto t0 = Clock::now();
  t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  auto t1 = Clock::now();
  const rusage u1 = Usage();
  const double widen_ms = Ms(t1 - t0);
  const double hwm = StatusMib("VmHWM:"), rss_after = StatusMib("VmRSS:");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the lookup blocked by the widening ends
  stop.store(true);
  for (std::thread& th : threads) th.join();
  for (const auto& p : per) spans.insert(spans.end(), p.begin(), p.end());
  std::vector<double> lat;  // lookups that overlapped the widening
  for (const auto& s : spans)
    if (s.second >= t0 && s.first <= t1) lat.push_back(Ms(s.second - s.first));
  std::sort(lat.begin(), lat.end());
  std::printf("{\"keys\": %lld, \"dim\": %d, \"readers\": %d, \"widen_s\": %.3f, \"stall_ms\": %.1f, \"stall_p50_ms\": %.3f, "
              "\"lookups\": %zu, \"rss_before_mib\": %.0f, \"rss_after_mib\": %.0f, \"peak_over_mib\": %.0f, \"huge_pages_mib\": %.0f, "
              "\"widen_user_s\": %.3f, \"widen_sys_s\": %.3f, \"widen_minflt\": %ld}\n",
              (long long)N, dim, readers, widen_ms / 1e3, lat.empty() ? 0.0 : lat.back(),
              lat.empty() ? 0.0 : lat[lat.size() / 2], lat.size(), rss_before, rss_after, hwm - rss_after, HugeMib(),
              Sec(u1.ru_utime) - Sec(u0.ru_utime), Sec(u1.ru_stime) - Sec(u0.ru_stime), u1.ru_minflt - u0.ru_minflt);
  return 0;
}
