// Core benchmark of read-only finds (Table::Find) on a large table, with the
// rows' page size under control. One source compiled against two trees'
// evstore/native/core headers and run alternately:
//   g++ -std=c++17 -O3 -pthread -I <tree>/evstore/native/core -I <tensorflow include> \
//       bench/tables/core_find_bench.cc -o find_<tree>
//   [EVSTORE_HUGE_COLLAPSE=1] ./find_<tree> <keys> <dim> <pages> [batches]
// pages: "small"  every row block placed in small pages (the gate is told
//                 before each fill batch that a huge page was costly, as it
//                 finds on a machine short of free 2 MiB pages);
//        "gate"   the gate decides (first_touch.h), as in a real process.
// Fills the table by FindOrInsert of new keys (batches of 65,536, one thread;
// the build's CPU and wall time), then, while the collapser (collapse.h, on
// with EVSTORE_HUGE_COLLAPSE=1) works, one reader looks up 64 random keys at
// a time and the longest of those lookups is kept; then `batches` (default
// 20) finds of 65,536 random existing keys, each timed in thread CPU and
// wall. The output is 64-byte aligned, as TensorFlow's tensors are. Prints
// one JSON line: build_cpu_s, build_wall_s, huge_mib / rss_mib (AnonHugePages
// and Rss of /proc/self/smaps_rollup) after the fill and before the finds,
// collapse_s / collapse_cpu_s / collapsed_mib, lookups_during_collapse,
// max_lookup_ms_during_collapse, find_cpu_ns_per_key (median batch) and all
// batches' CPU ns per key.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "table.h"

using namespace evstore;

static double Now(clockid_t c) {
  timespec t;
  clock_gettime(c, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static long SmapsKb(const char* field) {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line[n] == ':') return std::atol(line.c_str() + n + 1);
  return -1;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s keys dim small|gate [batches]\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atol(argv[1]);
  const int dim = std::atoi(argv[2]);
  const bool small = std::strcmp(argv[3], "small") == 0;
  const int batches = argc > 4 ? std::atoi(argv[4]) : 20;
  const int B = 65536;
  ParallelFor pf = SerialFor;
  std::vector<int64_t> keys(N);
  for (int64_t i = 0; i < N; ++i) keys[i] = (i * 0x9E3779B97F4A7C15LL) & ((1LL << 62) - 1);
  float* out = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(B) * dim * sizeof(float)));
  std::memset(out, 0, static_cast<size_t>(B) * dim * sizeof(float));

  TableConfig c;
  c.dim = dim;
  Table<int64_t> t(c);
  const double c0 = Now(CLOCK_PROCESS_CPUTIME_ID), w0 = Now(CLOCK_MONOTONIC);
  for (int64_t s = 0; s < N; s += B) {
    if (small) HugePageGate::Process().Record(HugePageGate::kCheapNs + 1);
    t.FindOrInsert(keys.data() + s, std::min<int64_t>(B, N - s), out, pf);
  }
  const double build_cpu = Now(CLOCK_PROCESS_CPUTIME_ID) - c0, build_wall = Now(CLOCK_MONOTONIC) - w0;
  const long huge_fill = SmapsKb("AnonHugePages"), rss_fill = SmapsKb("Rss");

  // The collapse (if on) and one reader beside it: 64 random keys a lookup.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> lookups{0};
  double max_lookup = 0;
  std::thread reader([&] {
    std::vector<int64_t> q(64);
    std::vector<float> o(64 * dim);
    unsigned x = 7;
    while (!stop.load()) {
      for (auto& v : q) {
        x = x * 1664525u + 1013904223u;
        v = keys[(x >> 3) % N];
      }
      const double a = Now(CLOCK_MONOTONIC);
      t.Find(q.data(), 64, o.data(), pf);
      max_lookup = std::max(max_lookup, Now(CLOCK_MONOTONIC) - a);
      lookups.fetch_add(1);
    }
  });
  const double k0 = Now(CLOCK_MONOTONIC);
  const CollapseStats st0 = Collapser::Stats();
  if (Collapser::Enabled()) {
    // Done when nothing was collapsed (or refused) for 3 s, after the quiet wait.
    int64_t seen = -1;
    double since = Now(CLOCK_MONOTONIC);
    while (Now(CLOCK_MONOTONIC) - k0 < 300) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const CollapseStats s = Collapser::Stats();
      const int64_t v = s.collapsed_bytes + s.failed_chunks;
      if (v != seen) {
        seen = v;
        since = Now(CLOCK_MONOTONIC);
      } else if (Now(CLOCK_MONOTONIC) - since > 3.0) {
        break;
      }
    }
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  stop = true;
  reader.join();
  const CollapseStats st1 = Collapser::Stats();
  const double collapse_s = Now(CLOCK_MONOTONIC) - k0;
  const long huge = SmapsKb("AnonHugePages"), rss = SmapsKb("Rss");

  std::vector<int64_t> q(B);
  std::vector<double> ns;
  unsigned x = 1;
  double fw = 0;
  for (int b = 0; b < batches + 2; ++b) {
    for (auto& v : q) {
      x = x * 1664525u + 1013904223u;
      v = keys[(x >> 3) % N];
    }
    const double a = Now(CLOCK_THREAD_CPUTIME_ID), aw = Now(CLOCK_MONOTONIC);
    t.Find(q.data(), B, out, pf);
    const double d = Now(CLOCK_THREAD_CPUTIME_ID) - a;
    if (b >= 2) {  // two warm-up batches
      ns.push_back(d / B * 1e9);
      fw += Now(CLOCK_MONOTONIC) - aw;
    }
  }
  std::vector<double> sorted = ns;
  std::sort(sorted.begin(), sorted.end());
  std::printf("{\"keys\": %ld, \"dim\": %d, \"pages\": \"%s\", \"collapse\": %d, \"build_cpu_s\": %.2f, "
              "\"build_wall_s\": %.2f, \"huge_mib_fill\": %ld, \"rss_mib_fill\": %ld, \"huge_mib\": %ld, "
              "\"rss_mib\": %ld, \"collapse_s\": %.1f, \"collapse_cpu_s\": %.2f, \"collapsed_mib\": %ld, "
              "\"failed_chunks\": %ld, \"lookups_during_collapse\": %ld, \"max_lookup_ms_during_collapse\": %.2f, "
              "\"find_cpu_ns_per_key\": %.1f, \"find_wall_ns_per_key\": %.1f, \"batches_cpu_ns\": [",
              static_cast<long>(N), dim, argv[3], Collapser::Enabled() ? 1 : 0, build_cpu, build_wall,
              huge_fill / 1024, rss_fill / 1024, huge / 1024, rss / 1024, collapse_s,
              (st1.cpu_ns - st0.cpu_ns) * 1e-9, static_cast<long>((st1.collapsed_bytes - st0.collapsed_bytes) >> 20),
              static_cast<long>(st1.failed_chunks - st0.failed_chunks), static_cast<long>(lookups.load()),
              max_lookup * 1e3, sorted[sorted.size() / 2], fw / (batches * static_cast<double>(B)) * 1e9);
  for (size_t i = 0; i < ns.size(); ++i) std::printf("%s%.0f", i ? ", " : "", ns[i]);
  std::printf("]}\n");
  std::free(out);
}
