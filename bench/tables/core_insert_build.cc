// Core micro-benchmark: a table built from empty to N keys by FindOrInsert of new keys (batches of
// 65,536, one thread), every batch counted (index growth and first touch of rows included), then
// finds of 10 batches of existing keys. Prints the process's CPU and the wall time per key.
// One source compiled against two trees' evstore/native/core headers and run alternately:
//   g++ -std=c++17 -O3 -pthread -I <tree>/evstore/native/core -I <tensorflow include dir> \
//       bench/tables/core_insert_build.cc -o /tmp/build_<tree>
//   /tmp/build_<tree> <keys> <dim> [tables built, default 3]
// (the TensorFlow include dir: .venv/bin/python -c "import tensorflow as tf; print(tf.sysconfig.get_include())")
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>
#include "table.h"
using namespace evstore;
static double cpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double wall() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  const int64_t N = atol(argv[1]); const int dim = atoi(argv[2]); const int reps = argc > 3 ? atoi(argv[3]) : 3;
  const int B = 65536;
  ParallelFor pf = SerialFor;
  std::vector<int64_t> keys(N);
  for (int64_t i = 0; i < N; ++i) keys[i] = (i * 0x9E3779B97F4A7C15LL) & ((1LL << 62) - 1);
  // 64-byte aligned, as TensorFlow allocates an op's output tensor.
  float* out = static_cast<float*>(std::aligned_alloc(64, (size_t)B * dim * sizeof(float)));
  for (size_t i = 0; i < (size_t)B * dim; ++i) out[i] = 1.f;
  for (int r = 0; r < reps; ++r) {
    TableConfig c; c.dim = dim;
    for (int i = 0; i < 64 * dim; ++i) c.bank.push_back(0.01f * (i % 97));
    auto* t = new Table<int64_t>(c);
    double c0 = cpu(), w0 = wall();
    for (int64_t s = 0; s < N; s += B) t->FindOrInsert(keys.data() + s, std::min<int64_t>(B, N - s), out, pf);
    double c1 = cpu(), w1 = wall();
    // finds after
    std::vector<int64_t> q(B); unsigned x = 1;
    double f0 = cpu();
    for (int k = 0; k < 10; ++k) { for (auto& v : q) { x = x * 1664525u + 1013904223u; v = keys[(x >> 3) % N]; } t->Find(q.data(), B, out, pf); }
    double f1 = cpu();
    printf("build %ldx%d: cpu %.0f ns/key wall %.0f ns/key; find cpu %.1f ns/key (incl key gen)\n", (long)N, dim, (c1 - c0) / N * 1e9, (w1 - w0) / N * 1e9, (f1 - f0) / (10.0 * B) * 1e9);
    delete t;
  }
}
