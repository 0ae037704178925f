// Core micro-benchmark: one source compiled against two trees' evstore/native/core headers
// (g++ -std=c++17 -O3 -pthread -I <tree>/evstore/native/core bench/tables/core_seams_bench.cc), run alternately.
// Prints ns per key for insert (find-or-insert of new keys), find, find-or-insert of existing keys, Adam
// apply, and seconds for a full export of 1M x 16 with two slots to a null sink.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include "export.h"
#include "table.h"
using namespace evstore;
using Clock = std::chrono::steady_clock;
static void TwoThreads(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& w) {
  int64_t mid = total / 2;
  std::thread t([&] { if (mid > 0) w(0, mid); });
  w(mid, total);
  t.join();
}
struct NullSink : ExportSink<int64_t> {
  int64_t sum = 0;
  void Rows(const int64_t* k, const float* r, int, const int64_t*, const int64_t*, int64_t n) override { sum += n + (n ? k[0] + (int64_t)r[0] : 0); }
  void Filtered(const int64_t*, const int64_t*, const int64_t*, int64_t n) override { sum += n; }
  void Deleted(const int64_t*, int64_t n) override { sum += n; }
  void BloomBlocks(const int64_t*, const uint8_t*, int64_t n) override { sum += n; }
};
static double Med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main() {
  const int dim = 16, B = 65536, N = 1000000, R = 9;
  ParallelFor pf = TwoThreads;
  TableConfig c; c.dim = dim;
  for (int i = 0; i < 64 * dim; ++i) c.bank.push_back(0.01f * (i % 97));
  Table<int64_t> t(c);
  std::vector<int64_t> keys(N);
  for (int64_t i = 0; i < N; ++i) keys[i] = (i * 0x9E3779B97F4A7C15LL) & ((1LL << 62) - 1);
  std::vector<float> out((size_t)B * dim);
  std::vector<double> ins;
  for (int64_t s = 0; s < N; s += B) {
    int64_t n = std::min<int64_t>(B, N - s);
    auto t0 = Clock::now();
    t.FindOrInsert(keys.data() + s, n, out.data(), pf);
    ins.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
  }
  std::mt19937_64 rng(0);
  std::vector<int64_t> batch(B);
  std::vector<double> fnd, foi, app;
  std::vector<float> g((size_t)B * dim, 0.001f);
  auto off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  for (int r = 0; r < R; ++r) {
    for (auto& k : batch) k = keys[rng() % N];
    std::sort(batch.begin(), batch.end());
    batch.erase(std::unique(batch.begin(), batch.end()), batch.end());
    std::shuffle(batch.begin(), batch.end(), rng);
    int64_t n = batch.size();
    auto t0 = Clock::now(); t.Find(batch.data(), n, out.data(), pf);
    fnd.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
    t0 = Clock::now(); t.FindOrInsert(batch.data(), n, out.data(), pf);
    foi.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
    t0 = Clock::now();
    t.Apply(batch.data(), g.data(), n, r, AdamUpdate{0.001f, 0.9f, 0.999f, 1e-7f, dim, off[0], off[1]}, pf);
    app.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
    batch.resize(B);
  }
  std::vector<double> sav;
  for (int r = 0; r < 3; ++r) {
    NullSink sink;
    auto t0 = Clock::now(); ExportFull(t, 2, 65536, &sink);
    sav.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::printf("insert_ns %.1f find_ns %.1f foi_ns %.1f apply_ns %.1f export_s %.4f\n", Med(ins) * 1e9, Med(fnd) * 1e9,
              Med(foi) * 1e9, Med(app) * 1e9, Med(sav));
}
