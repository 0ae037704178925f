// Tiered storage benchmark, core only (no TensorFlow): one table
// workload on three row stores, one per process run:
//   dram     Table<int64_t> (RowArena): every row in DRAM, the reference;
//   rowfile  TieredStore<FrequencyClock, RowFile>: the shipped disk engine;
//   rocksdb  TieredStore<FrequencyClock, RocksEngine>: the same DRAM cache over
//            RocksDB (row id -> row bytes), the peer the engine was chosen against.
// Built by bench/tiered/bench_tiered.py:
//   g++ -std=c++17 -O3 -pthread -I evstore/native/core -I <tf include> bench/tiered/tiered_engine_bench.cc \
//       $(pkg-config --cflags --libs rocksdb)
// or, where librocksdb-dev is not installed, with -DEVSTORE_BENCH_NO_ROCKSDB
// (no peer: the dram and rowfile stores only).
// Usage: tiered_engine_bench <store> <keys> <dram_fraction> <dir>
//    or: tiered_engine_bench pair <keys> <dram_fraction> <dir>
// Workload: <keys> int64 keys at dim 64 with Adam's two slots (768 bytes a row),
// the cache budget <dram_fraction> of the rows' bytes; fill every key, then
// training steps of 4,096 Zipf(1.1) ids (lookup + Adam apply, two threads),
// read-only lookups at batch 1 and 1,024 (rate, and CPU per key at 1,024), a full export to a null sink (and
// again with the tier's file dropped from the page cache: cold_export_s),
// and the disk's sequential write and cold read of the rows' bytes
// (seq_write_s, seq_read_s) for the save target.
// `pair`: the dram and rowfile tables in one process, filled alike, then
// trained and looked up in alternation, batch by batch (each batch drawn
// once and given to both), so that a shared machine's load falls on both
// alike: CPU per key of each table's own work (the draws apart) and their
// ratio. A tier's batch ends when its cleaner has caught up (Settle), so the
// write-backs it caused are counted in its own batch.
// Prints one line of `name value` pairs.
#ifndef EVSTORE_BENCH_NO_ROCKSDB
#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#endif

#include <fcntl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "export.h"
#include "table.h"
#include "tiered_store.h"
#include "unique_sum.h"

using namespace evstore;
using Clock = std::chrono::steady_clock;

#ifndef EVSTORE_BENCH_NO_ROCKSDB
// RocksDB as a TieredStore engine: record `loc` = value of the 4-byte
// big-endian key loc (the store's log-structured locations, log_space.h). No WAL (the tier is a cache, never durable), no compression (float
// rows do not compress), an 8 MiB block cache (the DRAM budget is the row
// cache's; RocksDB's own cache is kept small, as the row cache is in front).
class RocksEngine {
 public:
  RocksEngine(const std::string& parent, size_t record_bytes, bool = true) : record_bytes_(record_bytes) {
    dir_ = parent + "/rocks-" + std::to_string(::getpid());
    rocksdb::Options o;
    o.create_if_missing = true;
    o.compression = rocksdb::kNoCompression;
    o.write_buffer_size = 64 << 20;
    o.max_background_jobs = 2;
    rocksdb::BlockBasedTableOptions t;
    t.block_cache = rocksdb::NewLRUCache(8 << 20);
    o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
    rocksdb::Status st = rocksdb::DB::Open(o, dir_, &db_);
    if (!st.ok()) throw std::runtime_error("rocksdb open: " + st.ToString());
    wo_.disableWAL = true;
  }
  ~RocksEngine() {
    delete db_;
    rocksdb::DestroyDB(dir_, rocksdb::Options());
  }
  const std::string& dir() const { return dir_; }
  int last_error() const { return EIO; }
  bool Write(uint32_t loc, const void* const* srcs, size_t n, int* err = nullptr) {
    rocksdb::WriteBatch b;
    for (size_t i = 0; i < n; ++i) {
      char k[4];
      Key(loc + static_cast<uint32_t>(i), k);
      b.Put(rocksdb::Slice(k, 4), rocksdb::Slice(static_cast<const char*>(srcs[i]), record_bytes_));
    }
    if (err) *err = EIO;
    return db_->Write(wo_, &b).ok();
  }
  bool WriteZeros(uint32_t, size_t) { return true; }  // free room is the store's own business here
  void Read(uint32_t loc, void* dst) const {
    char k[4];
    Key(loc, k);
    rocksdb::PinnableSlice v;
    rocksdb::Status st = db_->Get(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), rocksdb::Slice(k, 4), &v);
    if (!st.ok() || v.size() != record_bytes_) throw std::runtime_error("rocksdb get: " + st.ToString());
    std::memcpy(dst, v.data(), record_bytes_);
  }
  void ReadMany(const uint32_t* locs, void* const* dsts, size_t n) const {
    for (size_t i = 0; i < n; ++i) Read(locs[i], dsts[i]);
  }
  void WillNeed(const uint32_t*, size_t) const {}
  // A span of records (a full export's stream): the ones that exist; records never written stay as they were.
  void ReadSpan(uint32_t first, size_t n, void* dst) const {
    for (size_t i = 0; i < n; ++i) {
      char k[4];
      Key(first + static_cast<uint32_t>(i), k);
      rocksdb::PinnableSlice v;
      if (db_->Get(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), rocksdb::Slice(k, 4), &v).ok() &&
          v.size() == record_bytes_)
        std::memcpy(static_cast<char*>(dst) + i * record_bytes_, v.data(), record_bytes_);
    }
  }
  void WillNeedSpan(uint32_t, size_t) const {}
  int64_t disk_bytes() const {
    uint64_t sst = 0, mem = 0;
    db_->GetIntProperty("rocksdb.total-sst-files-size", &sst);
    db_->GetIntProperty("rocksdb.cur-size-all-mem-tables", &mem);
    return static_cast<int64_t>(sst + mem);
  }
  template <typename OldLoc>
  bool Widen(size_t new_record_bytes, uint32_t nrecords, const OldLoc&, const std::vector<char>&) {
    if (nrecords != 0) return false;  // the benchmark adds its slots before the first row
    record_bytes_ = new_record_bytes;
    return true;
  }

 private:
  static void Key(uint32_t r, char* k) {
    k[0] = static_cast<char>(r >> 24);
    k[1] = static_cast<char>(r >> 16);
    k[2] = static_cast<char>(r >> 8);
    k[3] = static_cast<char>(r);
  }
  size_t record_bytes_;
  std::string dir_;
  rocksdb::DB* db_ = nullptr;
  rocksdb::WriteOptions wo_;
};
#endif  // EVSTORE_BENCH_NO_ROCKSDB

static void TwoThreads(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& w) {
  int64_t mid = total / 2;
  std::thread t([&] { if (mid > 0) w(0, mid); });
  w(mid, total);
  t.join();
}
struct NullSink : ExportSink<int64_t> {
  int64_t sum = 0;
  void Rows(const int64_t* k, const float* r, int, const int64_t*, const int64_t*, int64_t n) override {
    sum += n + (n ? k[0] + static_cast<int64_t>(r[0]) : 0);
  }
  void Filtered(const int64_t*, const int64_t*, const int64_t*, int64_t n) override { sum += n; }
  void Deleted(const int64_t*, int64_t n) override { sum += n; }
  void BloomBlocks(const int64_t*, const uint8_t*, int64_t n) override { sum += n; }
};
// CPU seconds of the whole process (both threads): the fair measure on a
// shared machine, where wall time includes waiting for a core.
static double CpuSecs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static double Secs(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
static double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}
// A /proc/self/status field in bytes: VmRSS (all resident pages), RssAnon
// (the process's own memory), RssFile (mapped file pages: the tier file's
// pages its reads mapped, which are the page cache's, shared and reclaimable).
static int64_t StatusBytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::stoll(line.substr(n + 1)) * 1024;
  return 0;
}
static int64_t RssBytes() { return StatusBytes("VmRSS"); }
static long MajorFaults() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_majflt;
}

struct Zipf {  // ranks 1..n with P(k) ~ k^-s, by inverse CDF over a table
  std::vector<double> cdf;
  std::mt19937_64 rng;
  Zipf(int64_t n, double s, uint64_t seed) : rng(seed) {
    cdf.resize(n);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) cdf[i] = sum += std::pow(static_cast<double>(i + 1), -s);
    for (double& c : cdf) c /= sum;
  }
  int64_t Next() {
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
  }
};

template <typename V>
static int64_t Cap(const V& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(typename V::value_type));
}

// Drops a file's pages from the page cache (written back first): its next
// reads come from the disk.
static void DropCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}
// The disk's sequential rate for `bytes` in `dir`: seconds to write them (8 MiB
// writes, then fsync) and to read them back cold (8 MiB reads).
static void SequentialRate(const std::string& dir, int64_t bytes, double* write_s, double* read_s) {
  const std::string path = dir + "/sequential-probe";
  std::vector<char> buf(8 << 20, 1);
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  if (fd < 0) return;
  auto t0 = Clock::now();
  for (int64_t done = 0; done < bytes;) {
    ssize_t n = ::write(fd, buf.data(), static_cast<size_t>(std::min<int64_t>(buf.size(), bytes - done)));
    if (n <= 0) break;
    done += n;
  }
  ::fsync(fd);
  *write_s = Secs(t0);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  t0 = Clock::now();
  for (off_t at = 0;;) {
    ssize_t n = ::pread(fd, buf.data(), buf.size(), at);
    if (n <= 0) break;
    at += n;
  }
  *read_s = Secs(t0);
  ::close(fd);
  ::unlink(path.c_str());
}

static int64_t KeyOf(int64_t rank) { return (rank * 0x9E3779B97F4A7C15LL) & ((1LL << 62) - 1); }
constexpr int kBatch = 4096, kWarmSteps = 50, kSteps = 200;

// One table's workload: the fill, and a training step (lookup, gradient
// sums, Adam) on a given batch of keys.
template <typename T>
struct Trainer {
  T& t;
  const int dim;
  ParallelFor pf = TwoThreads;
  std::vector<int> off;
  std::vector<float> out, g, ug;
  std::vector<int64_t> uk;
  explicit Trainer(T& table) : t(table), dim(table.dim()) {
    off = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    g.resize(static_cast<size_t>(kBatch) * dim);
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.001f * static_cast<float>(i % 13);
  }
  // Every key once (a restore-sized load), batches of 65,536; returns seconds.
  double Fill(int64_t nkeys) {
    const int64_t FB = 65536;
    std::vector<int64_t> keys(FB);
    out.resize(FB * dim);
    auto t0 = Clock::now();
    for (int64_t s = 0; s < nkeys; s += FB) {
      int64_t n = std::min(FB, nkeys - s);
      for (int64_t i = 0; i < n; ++i) keys[i] = KeyOf(s + i);
      t.FindOrInsert(keys.data(), n, out.data(), pf);
    }
    return Secs(t0);
  }
  void Step(const int64_t* batch, int64_t step) {
    t.FindOrInsert(batch, kBatch, out.data(), pf);
    int64_t un = UniqueSum(batch, g.data(), kBatch, dim, &uk, &ug);
    t.Apply(uk.data(), ug.data(), un, step, AdamUpdate{0.001f, 0.9f, 0.999f, 1e-7f, dim, off[0], off[1]}, pf);
  }
  int64_t Bytes() const { return Cap(out) + Cap(g) + Cap(uk) + Cap(ug); }
};

template <typename T>
static void Run(T& t, int64_t nkeys, const char* store, int64_t rss_base, const std::string& dir) {
  const int dim = t.dim();
  ParallelFor pf = TwoThreads;
  Trainer<T> tr(t);
  const double fill_s = tr.Fill(nkeys);
  std::vector<float>& out = tr.out;
  // Training: Zipf(1.1) batches of 4,096, lookup + Adam (the draws counted in).
  Zipf z(nkeys, 1.1, 42);
  const int B = kBatch, steps = kSteps;
  std::vector<int64_t> batch(B);
  auto one_step = [&](int64_t step) {
    for (auto& k : batch) k = KeyOf(z.Next());
    tr.Step(batch.data(), step);
  };
  for (int s = 0; s < kWarmSteps; ++s) one_step(s);  // warm the cache
  TierStats ts0 = t.tier_stats();
  auto t0 = Clock::now();
  const double cpu0 = CpuSecs();
  const long majflt0 = MajorFaults();
  for (int s = kWarmSteps; s < kWarmSteps + steps; ++s) one_step(s);
  const double train_s = Secs(t0);
  // Page faults that read the disk while training: the tier file's pages
  // were not in the page cache (reclaimed under memory pressure), so the
  // run measured the disk as well as the engine.
  const long train_majflt = MajorFaults() - majflt0;
  const double train_cpu_ns = (CpuSecs() - cpu0) / (static_cast<double>(steps) * B) * 1e9;
  TierStats ts1 = t.tier_stats();
  const double accesses = static_cast<double>((ts1.hits - ts0.hits) + (ts1.misses - ts0.misses));
  const double hit = accesses > 0 ? (ts1.hits - ts0.hits) / accesses : 1.0;
  // Read-only lookups: batch 1 and batch 1,024 (Zipf ids).
  std::vector<double> lat1, lat1k;
  std::vector<float> o1(dim);
  for (int i = 0; i < 5000; ++i) {
    int64_t k = KeyOf(z.Next());
    auto a = Clock::now();
    t.Find(&k, 1, o1.data(), SerialFor);
    lat1.push_back(Secs(a));
  }
  double sum1k = 0;
  const double cpu_find = CpuSecs();
  for (int i = 0; i < 200; ++i) {
    for (int j = 0; j < 1024; ++j) batch[j] = KeyOf(z.Next());
    auto a = Clock::now();
    t.Find(batch.data(), 1024, out.data(), pf);
    double d = Secs(a);
    lat1k.push_back(d);
    sum1k += d;
  }
  const double find1k_cpu_ns = (CpuSecs() - cpu_find) / (200.0 * 1024) * 1e9;
  // Full export to a null sink.
  NullSink sink;
  t0 = Clock::now();
  const double cpu1 = CpuSecs();
  ExportFull(t, 2, 65536, &sink);
  const double export_s = Secs(t0);
  const double export_cpu_s = CpuSecs() - cpu1;
  // The same export with the tier's file out of the page cache (as in a
  // table larger than memory), and the disk's sequential rate for the rows'
  // bytes, measured now.
  double cold_export_s = export_s, seq_write_s = 0, seq_read_s = 0;
  if constexpr (!std::decay_t<decltype(t.store())>::kAllResident) {
    DropCache(t.store().dir() + "/rows");
    t0 = Clock::now();
    ExportFull(t, 2, 65536, &sink);
    cold_export_s = Secs(t0);
  }
  SequentialRate(dir, nkeys * static_cast<int64_t>(t.stride()) * 4, &seq_write_s, &seq_read_s);
  TableStats st = t.Stats();
  // Memory the table does not report: the process's own pages (RssAnon)
  // minus those before the table existed, the benchmark's own buffers and
  // the table's index, meta and row bytes (what is left is allocator and
  // thread overhead). RSS also counts mapped file pages (rss_file_mb: the
  // binary, and the tier file's pages that reads mapped, row_file.h).
  const int64_t rss = RssBytes(), rss_anon = StatusBytes("RssAnon"), rss_file = StatusBytes("RssFile");
  const int64_t buffers = tr.Bytes() + Cap(batch) + Cap(z.cdf) + Cap(lat1) + Cap(lat1k) + Cap(o1);
  const double other_mb = (rss_anon - rss_base - buffers - st.index_bytes - st.meta_bytes - st.row_bytes) / 1048576.0;
  std::printf(
      "store %s keys %lld fill_s %.3f train_keys_per_s %.0f train_cpu_ns_per_key %.1f hit_rate %.4f train_majflt %ld find1_keys_per_s %.0f find1_p99_us %.1f "
      "find1k_keys_per_s %.0f find1k_cpu_ns_per_key %.1f find1k_p99_ms %.3f export_s %.3f export_cpu_s %.3f cold_export_s %.3f seq_write_s %.3f "
      "seq_read_s %.3f rss_mb %.1f rss_anon_mb %.1f rss_file_mb %.1f index_mb %.1f meta_mb %.1f row_mb %.1f "
      "cache_rows %lld disk_mb %.1f writebacks %lld write_batches %lld compacted %lld misses %lld read_calls %lld "
      "disk_records %lld live_records %lld rss_base_mb %.1f bench_buffers_mb %.1f rss_other_mb %.1f\n",
      store, static_cast<long long>(nkeys), fill_s, steps * B / train_s, train_cpu_ns, hit, train_majflt, lat1.size() / [&] {
        double s = 0;
        for (double x : lat1) s += x;
        return s;
      }(), Pct(lat1, 0.99) * 1e6, 200 * 1024 / sum1k, find1k_cpu_ns, Pct(lat1k, 0.99) * 1e3, export_s, export_cpu_s, cold_export_s, seq_write_s, seq_read_s, rss / 1048576.0, rss_anon / 1048576.0, rss_file / 1048576.0,
      st.index_bytes / 1048576.0, st.meta_bytes / 1048576.0, st.row_bytes / 1048576.0,
      static_cast<long long>(ts1.resident), ts1.disk_bytes / 1048576.0, static_cast<long long>(ts1.writebacks - ts0.writebacks),
      static_cast<long long>(ts1.write_batches - ts0.write_batches), static_cast<long long>(ts1.compacted - ts0.compacted),
      static_cast<long long>(ts1.misses - ts0.misses), static_cast<long long>(ts1.read_calls - ts0.read_calls),
      static_cast<long long>(ts1.disk_records), static_cast<long long>(ts1.live_records), rss_base / 1048576.0, buffers / 1048576.0,
      other_mb);
}

// `pair`: both tables in one process, each batch drawn once and run on the
// all-DRAM table, then on the tier (its cleaner settled inside its window).
// CPU per key of each table's own work; the draws' CPU apart (the single-store
// runs' train_cpu_ns_per_key includes them).
template <typename D, typename R>
static void Pair(D& dram, R& tier, int64_t nkeys) {
  Trainer<D> a(dram);
  Trainer<R> b(tier);
  const double fill_dram_s = a.Fill(nkeys), fill_tier_s = b.Fill(nkeys);
  tier.store().Settle();
  Zipf z(nkeys, 1.1, 42);
  std::vector<int64_t> batch(kBatch);
  double draw = 0, cpu_a = 0, cpu_b = 0;
  auto settled_step = [&](int64_t step) {
    b.Step(batch.data(), step);
    tier.store().Settle();
  };
  TierStats ts0;
  long majflt0 = 0;
  for (int s = 0; s < kWarmSteps + kSteps; ++s) {
    if (s == kWarmSteps) {
      ts0 = tier.tier_stats();
      majflt0 = MajorFaults();
      draw = cpu_a = cpu_b = 0;
    }
    double c0 = CpuSecs();
    for (auto& k : batch) k = KeyOf(z.Next());
    double c1 = CpuSecs();
    a.Step(batch.data(), s);
    double c2 = CpuSecs();
    settled_step(s);
    double c3 = CpuSecs();
    draw += c1 - c0;
    cpu_a += c2 - c1;
    cpu_b += c3 - c2;
  }
  const long majflt = MajorFaults() - majflt0;
  const TierStats ts1 = tier.tier_stats();
  const double hits = static_cast<double>(ts1.hits - ts0.hits), misses = static_cast<double>(ts1.misses - ts0.misses);
  // Read-only lookups at batch 1,024, alternating likewise.
  double find_a = 0, find_b = 0;
  std::vector<float> out(static_cast<size_t>(1024) * dram.dim());
  for (int i = 0; i < 200; ++i) {
    for (int j = 0; j < 1024; ++j) batch[j] = KeyOf(z.Next());
    double c0 = CpuSecs();
    dram.Find(batch.data(), 1024, out.data(), TwoThreads);
    double c1 = CpuSecs();
    tier.Find(batch.data(), 1024, out.data(), TwoThreads);
    find_a += c1 - c0;
    find_b += CpuSecs() - c1;
  }
  const double keys = static_cast<double>(kSteps) * kBatch, fkeys = 200.0 * 1024;
  std::printf(
      "store pair keys %lld fill_dram_s %.3f fill_tier_s %.3f draw_cpu_ns_per_key %.1f dram_train_cpu_ns_per_key %.1f "
      "tier_train_cpu_ns_per_key %.1f train_ratio %.3f train_ratio_with_draws %.3f dram_find1k_cpu_ns_per_key %.1f "
      "tier_find1k_cpu_ns_per_key %.1f find1k_ratio %.3f hit_rate %.4f train_majflt %ld misses %lld writebacks %lld "
      "write_batches %lld\n",
      static_cast<long long>(nkeys), fill_dram_s, fill_tier_s, draw / keys * 1e9, cpu_a / keys * 1e9, cpu_b / keys * 1e9,
      cpu_a / cpu_b, (cpu_a + draw) / (cpu_b + draw), find_a / fkeys * 1e9, find_b / fkeys * 1e9, find_a / find_b,
      hits / (hits + misses), majflt, static_cast<long long>(ts1.misses - ts0.misses),
      static_cast<long long>(ts1.writebacks - ts0.writebacks), static_cast<long long>(ts1.write_batches - ts0.write_batches));
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s dram|rowfile|rocksdb|pair <keys> <dram_fraction> <dir>\n", argv[0]);
    return 2;
  }
  const std::string store = argv[1];
  const int64_t nkeys = std::atoll(argv[2]);
  const double frac = std::atof(argv[3]);
  const int dim = 64;
  const int64_t rss_base = StatusBytes("RssAnon");
  TableConfig c;
  c.dim = dim;
  for (int i = 0; i < 64 * dim; ++i) c.bank.push_back(0.01f * (i % 97));
  c.tier.path = argv[4];
  c.tier.dram_bytes = static_cast<int64_t>(frac * nkeys * dim * 3 * 4);
  if (store == "dram") {
    Table<int64_t> t(c);
    Run(t, nkeys, "dram", rss_base, argv[4]);
  } else if (store == "pair") {
    Table<int64_t> d(c);
    Table<int64_t, KeyTraits<int64_t>, TieredStore<FrequencyClock, RowFile>> t(c);
    Pair(d, t, nkeys);
  } else if (store == "rowfile") {
    Table<int64_t, KeyTraits<int64_t>, TieredStore<FrequencyClock, RowFile>> t(c);
    Run(t, nkeys, "rowfile", rss_base, argv[4]);
#ifndef EVSTORE_BENCH_NO_ROCKSDB
  } else if (store == "rocksdb") {
    Table<int64_t, KeyTraits<int64_t>, TieredStore<FrequencyClock, RocksEngine>> t(c);
    Run(t, nkeys, "rocksdb", rss_base, argv[4]);
#endif
  } else {
    std::fprintf(stderr, "unknown store %s\n", store.c_str());
    return 2;
  }
  return 0;
}
