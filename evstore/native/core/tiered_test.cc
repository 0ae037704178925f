// TF-free tests of the tiered row store (tiered_store.h, row_file.h,
// log_space.h, cache_policy.h) under the table. Built and run by
// tests/native/CMakeLists.txt (make test-native: -O3, ASan, TSan). Exits
// non-zero on the first failure.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "export.h"
#include "table.h"
#include "test_check.h"
#include "tiered_store.h"
#include "unique_sum.h"

using namespace evstore;

template <typename K>
using Tiered = Table<K, KeyTraits<K>, TieredStore<>>;

static void TwoThreadFor(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& work) {
  if (total <= 0) return;
  int64_t mid = total / 2;
  std::thread t([&] { if (mid > 0) work(0, mid); });
  work(mid, total);
  t.join();
}
static const ParallelFor kThreads = TwoThreadFor;

static bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
// Each test's tier directory; main removes them all once every test passed
// (a failed run keeps them to look at).
static std::vector<std::string> temp_dirs;
static std::string TempDir() {
  char tmpl[] = "/tmp/evstore-tiered-test-XXXXXX";
  CHECK(::mkdtemp(tmpl) != nullptr);
  temp_dirs.push_back(tmpl);
  return tmpl;
}

// Runs `body` in a child process (so a file-size limit it sets stays there;
// SIGXFSZ is ignored, so a write past it fails instead of killing it) and
// checks that it returned true.
static void InChild(const std::function<bool()>& body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    std::_Exit(body() ? 0 : 3);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
}

static TableConfig Cfg(int dim, uint32_t min_freq = 1) {
  TableConfig c;
  c.dim = dim;
  c.min_freq = min_freq;
  for (int r = 0; r < 37; ++r)
    for (int d = 0; d < dim; ++d) c.bank.push_back(static_cast<float>(r * 10 + d + 1) / 64.f);
  return c;
}
static TableConfig TierCfg(TableConfig c, const std::string& dir, int64_t dram_bytes) {
  c.tier.dram_bytes = dram_bytes;
  c.tier.path = dir;
  return c;
}
// A tiered config in a new temporary directory whose DRAM budget is `rows`
// rows of `c.dim * (1 + slots)` floats and 8 bytes each.
static TableConfig TierRows(const TableConfig& c, int64_t rows, int slots = 0) {
  return TierCfg(c, TempDir(), rows * (c.dim * (1 + slots) * 4 + 8));
}

// Keys a * i + b for i in [0, n).
static std::vector<int64_t> KeysFrom(int64_t n, int64_t a, int64_t b) {
  std::vector<int64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = a * i + b;
  return keys;
}
// keys[lo, hi) looked up, and so inserted, in both tables, `batch` keys a call.
template <typename A, typename B>
static void InsertBoth(A& a, B& b, const std::vector<int64_t>& keys, size_t lo, size_t hi, size_t batch) {
  std::vector<float> out(batch * a.dim());
  for (size_t i = lo; i < hi; i += batch) {
    const size_t n = std::min(batch, hi - i);
    a.FindOrInsert(keys.data() + i, n, out.data(), kThreads);
    b.FindOrInsert(keys.data() + i, n, out.data(), kThreads);
  }
}

// Zipf(1.1) ids over [0, n): what CTR ids look like.
struct Zipf {
  std::vector<double> cdf;
  std::mt19937_64 rng;
  Zipf(int n, double s, uint64_t seed) : rng(seed) {
    double sum = 0;
    for (int i = 1; i <= n; ++i) cdf.push_back(sum += 1.0 / std::pow(i, s));
    for (double& c : cdf) c /= sum;
  }
  int64_t Next() {
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return static_cast<int64_t>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
  }
};

// One training step of `keys` on both tables: a lookup, then SGD with a constant gradient.
template <typename A, typename B>
static void SgdStep(A& a, B& b, const std::vector<int64_t>& keys, int64_t step) {
  const int dim = a.dim();
  std::vector<float> o(keys.size() * dim), g(keys.size() * dim, 0.125f);
  a.FindOrInsert(keys.data(), keys.size(), o.data(), kThreads);
  b.FindOrInsert(keys.data(), keys.size(), o.data(), kThreads);
  a.Apply(keys.data(), g.data(), keys.size(), step, SgdUpdate{0.5f, dim}, kThreads);
  b.Apply(keys.data(), g.data(), keys.size(), step, SgdUpdate{0.5f, dim}, kThreads);
}

// Every key's full state, from the table's own export walk (sorted by key).
struct State {
  bool admitted;
  int64_t version, freq, seen;
  std::vector<float> row;
  bool operator==(const State& o) const {
    return admitted == o.admitted && version == o.version && freq == o.freq && seen == o.seen && row == o.row;
  }
};
template <typename K>
using MapKey = std::conditional_t<std::is_same<K, std::string_view>::value, std::string, K>;
template <typename T>
static auto Dump(const T& t) {
  using K = std::decay_t<decltype(std::declval<ExportedKey<typename T::Idx::Key>>().key)>;
  std::map<MapKey<K>, State> out;
  const int stride = t.stride();
  for (int s = 0; s < t.num_segments(); ++s)
    t.ForEachInSegment(s, [&](const auto& x, const float* row) {
      State st{x.admitted, x.version, x.freq, x.seen, {}};
      if (row) st.row.assign(row, row + stride);
      out[MapKey<K>(x.key)] = st;
    });
  return out;
}

// One training step on both tables: lookup, Adam on the unique keys, and
// every 5th step an eviction by step (and L2 when asked).
template <typename A, typename B, typename K>
static void TrainStep(A& a, B& b, const std::vector<K>& keys, int64_t step, bool l2) {
  const int dim = a.dim();
  std::vector<float> oa(keys.size() * dim), ob(keys.size() * dim);
  a.FindOrInsert(keys.data(), keys.size(), oa.data(), kThreads);
  b.FindOrInsert(keys.data(), keys.size(), ob.data(), kThreads);
  CHECK(oa == ob);
  std::vector<float> g(keys.size() * dim);
  for (size_t i = 0; i < g.size(); ++i) g[i] = oa[i] * 0.01f + static_cast<float>(i % 7) * 0.001f;
  std::vector<K> uk;
  std::vector<float> ug;
  int64_t un = UniqueSum(keys.data(), g.data(), static_cast<int64_t>(keys.size()), dim, &uk, &ug);
  auto offs = a.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  CHECK(offs == b.EnsureSlots({{"m", 0.f}, {"v", 0.f}}));
  AdamUpdate adam{0.01f, 0.9f, 0.999f, 1e-7f, dim, offs[0], offs[1]};
  CHECK_EQ(a.Apply(uk.data(), ug.data(), un, step, adam, kThreads),
           b.Apply(uk.data(), ug.data(), un, step, adam, kThreads));
  if (step % 5 == 0) {
    EvictionPolicies p;
    p.Add(GlobalStepEviction(8));
    if (l2) p.Add(L2WeightEviction(0.05f));
    CHECK_EQ(a.Evict(step, p), b.Evict(step, p));
  }
}

static void test_tiered_table_equals_all_dram_table_bit_for_bit() {
  const int dim = 8;
  // No filter, the counting filter, the Bloom filter; reads through the
  // mapping of the tier file and on the portable preadv path.
  for (int filter : {0, 1, 2}) {
    for (bool l2 : {false, true}) {
      const bool mapped = filter != 1 || l2;
      std::string dir = TempDir();
      TableConfig cfg = Cfg(dim, filter == 0 ? 1 : 2);
      if (filter == 2) cfg.bloom.capacity = 10000;
      Table<int64_t> dram(cfg);
      // About 40 rows of DRAM (dim 8, Adam: 96 bytes a row) for ~2,000 keys.
      TableConfig tcfg = TierCfg(cfg, dir, 40 * 100);
      tcfg.tier.mapped_reads = mapped;
      Tiered<int64_t> tier(tcfg);
      CHECK(tier.store().mapped_reads() == mapped);
      Zipf z(4000, 1.1, 7 + filter);
      for (int64_t step = 1; step <= 40; ++step) {
        std::vector<int64_t> keys;
        for (int i = 0; i < 256; ++i) keys.push_back(z.Next() * 7919 - 3);
        TrainStep(tier, dram, keys, step, l2);
      }
      TierStats ts = tier.tier_stats();
      CHECK(ts.misses > 0 && ts.writebacks > 0);
      CHECK(Dump(tier) == Dump(dram));
      TableStats sa = tier.Stats(), sb = dram.Stats();
      CHECK_EQ(sa.admitted, sb.admitted);
      CHECK_EQ(sa.filtered, sb.filtered);
      CHECK_EQ(sa.zero_rows, sb.zero_rows);
      CHECK_EQ(sa.evicted, sb.evicted);
      // The open dirty / deleted sets (what the next delta carries) agree too.
      auto ea = tier.BeginExport();
      auto eb = dram.BeginExport();
      auto sorted = [](std::vector<int64_t> v) { std::sort(v.begin(), v.end()); return v; };
      CHECK(sorted(ea->dirty) == sorted(eb->dirty));
      CHECK(sorted(ea->deleted) == sorted(eb->deleted));
      tier.Commit(ea->id);
      dram.Commit(eb->id);
    }
  }
}

static void test_resident_rows_stay_near_the_budget() {
  const int dim = 16;
  const int64_t budget_rows = 100;
  Tiered<int64_t> t(TierRows(Cfg(dim), budget_rows));
  CHECK_EQ(t.tier_stats().budget_rows, budget_rows);
  for (int b = 0; b < 50; ++b) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 64; ++i) keys.push_back(b * 64 + i);
    std::vector<float> out(keys.size() * dim);
    t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
    // One batch may overshoot by the rows it pins (64 here), never more.
    CHECK(t.tier_stats().resident <= budget_rows + 64);
  }
  CHECK_EQ(t.size(), 3200);
  CHECK(t.tier_stats().disk_bytes >= (3200 - budget_rows - 64) * dim * 4);
}

// A table of one segment keeps its budget: a faulting thread cannot evict
// rows of the segment it holds (its batch is pinned), so with one segment
// the cleaner thread evicts them between batches. Exact, like any tier.
static void test_one_segment_table_stays_within_its_budget() {
  const int dim = 8;
  TableConfig c = Cfg(dim);
  c.segments_log2 = 0;
  Table<int64_t> dram(c);
  Tiered<int64_t> t(TierRows(c, 200, 2));
  CHECK_EQ(t.num_segments(), 1);
  Zipf z(5000, 1.1, 7);
  for (int64_t step = 1; step <= 40; ++step) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 256; ++i) keys.push_back(z.Next() * 13 + 3);
    TrainStep(t, dram, keys, step, false);
    CHECK(t.store().Settle());
    const TierStats ts = t.tier_stats();
    CHECK_EQ(ts.budget_rows, 200);
    CHECK(ts.resident <= ts.budget_rows);
  }
  CHECK(t.tier_stats().writebacks > 0);
  CHECK(t.tier_stats().misses > 0);
  CHECK(Dump(t) == Dump(dram));
}

static void test_full_walk_streams_cold_rows_without_caching_them() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 50));
  const std::vector<int64_t> keys = KeysFrom(3000, 5, 0);
  InsertBoth(t, dram, keys, 0, keys.size(), keys.size());
  const TierStats before = t.tier_stats();
  CHECK(Dump(t) == Dump(dram));  // every row, through ForEachInSegment
  const TierStats after = t.tier_stats();
  CHECK_EQ(after.misses, before.misses);
  CHECK(after.resident <= before.resident);  // no slot taken (the cleaner may free some meanwhile)
}

// A full export's content, keyed (the order of a tiered export is the tier
// file's): admitted keys' row prefix, version, frequency; filtered keys'
// frequency and last sighting; how many times each key came.
template <typename K>
struct ContentSink : ExportSink<K> {
  std::map<MapKey<K>, State> rows;
  std::map<MapKey<K>, int> times;
  void Rows(const K* keys, const float* r, int stride, const int64_t* v, const int64_t* f, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      rows[MapKey<K>(keys[i])] = State{true, v[i], f[i], -1, std::vector<float>(r + i * stride, r + (i + 1) * stride)};
      ++times[MapKey<K>(keys[i])];
    }
  }
  void Filtered(const K* keys, const int64_t* f, const int64_t* seen, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      rows[MapKey<K>(keys[i])] = State{false, -1, f[i], seen[i], {}};
      ++times[MapKey<K>(keys[i])];
    }
  }
  void Deleted(const K*, int64_t) override {}
  void BloomBlocks(const int64_t*, const uint8_t*, int64_t) override {}
  bool each_once() const {
    return std::all_of(times.begin(), times.end(), [](const auto& kv) { return kv.second == 1; });
  }
};

// A full export of a tiered table reads its cold rows in the tier file's
// order, a few long reads for the whole file (no read per row), caches none
// of them, and holds exactly the all-DRAM export's content.
static void test_full_export_streams_cold_rows_in_file_order_in_long_reads() {
  const int dim = 8;
  TableConfig cfg = Cfg(dim, 2);
  Table<int64_t> dram(cfg);
  Tiered<int64_t> t(TierRows(cfg, 60, 2));
  std::vector<int64_t> all;
  for (int i = 0; i < 3000; ++i) all.push_back(i * 31 + 5);
  TrainStep(t, dram, all, 1, false);  // counted (the filter admits at the second sight)
  TrainStep(t, dram, all, 2, false);  // admitted
  Zipf z(6000, 1.1, 11);
  for (int64_t step = 3; step <= 4; ++step) {  // (no eviction: TrainStep evicts at every 5th step)
    std::vector<int64_t> keys;
    for (int i = 0; i < 512; ++i) keys.push_back(z.Next() * 31 + 5);
    TrainStep(t, dram, keys, step, false);
  }
  const TierStats before = t.tier_stats();
  CHECK(before.live_records > 2000);
  const int64_t reads = t.store().stream_reads();
  ContentSink<int64_t> a, b;
  const ExportCounts ca = ExportFull(t, 2, 1000, &a), cb = ExportFull(dram, 2, 1000, &b);
  CHECK_EQ(ca.rows, cb.rows);
  CHECK_EQ(ca.filtered, cb.filtered);
  CHECK(cb.filtered > 0);
  CHECK(a.rows == b.rows);
  CHECK(a.each_once());
  // 96-byte records: the whole file is one 16 MiB span; gaps of DRAM rows'
  // and dead records are read through, so a handful of reads at most.
  const int64_t spans = t.store().stream_reads() - reads;
  CHECK(spans >= 1 && spans <= 4);
  CHECK_EQ(t.tier_stats().misses, before.misses);
}

// A full export racing writers: every key comes once, with a row it had
// (each imported row is one value repeated, so a torn row would mix two),
// while rows are rewritten, evicted, compacted and keys erased meanwhile.
static void test_full_export_racing_writers_gives_each_key_once_untorn() {
  const int dim = 8;
  Tiered<int64_t> t(TierRows(Cfg(dim), 80));
  const int n = 4000;
  std::vector<int64_t> keys(n);
  for (int i = 0; i < n; ++i) keys[i] = i * 3 + 1;
  auto put = [&](int lo, int hi, float v, int64_t version) {
    std::vector<float> vals(static_cast<size_t>(hi - lo) * dim, v);
    std::vector<int64_t> vers(hi - lo, version), freqs(hi - lo, 1);
    t.ImportRows(keys.data() + lo, hi - lo, vals.data(), dim, nullptr, 0, {}, vers.data(), freqs.data(), false);
  };
  put(0, n, 1.f, 1);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int round = 2; !done.load(); ++round) {
      const int lo = (round * 397) % (n - 300);
      put(lo, lo + 300, static_cast<float>(round), round);
      if (round % 7 == 0) t.Erase(keys.data() + lo, 5);
    }
  });
  for (int e = 0; e < 5; ++e) {
    ContentSink<int64_t> sink;
    ExportFull(t, 0, 500, &sink);
    CHECK(sink.each_once());
    CHECK(sink.rows.size() > static_cast<size_t>(n) / 2);
    for (const auto& kv : sink.rows) {
      const std::vector<float>& r = kv.second.row;
      CHECK(std::all_of(r.begin(), r.end(), [&](float x) { return x == r[0]; }));
    }
  }
  done.store(true);
  writer.join();
  CHECK(t.tier_stats().writebacks > 0);
}

static void test_eviction_by_step_reads_no_cold_row() {
  const int dim = 4;
  Tiered<int64_t> t(TierRows(Cfg(dim), 50));
  std::vector<int64_t> keys;
  for (int i = 0; i < 2000; ++i) keys.push_back(i);
  std::vector<float> out(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  std::vector<float> g(keys.size() * dim, 0.5f);
  t.Apply(keys.data(), g.data(), 1000, 3, SgdUpdate{1.f, dim}, kThreads);  // first half at step 3
  const int64_t misses = t.tier_stats().misses;
  EvictionPolicies p;
  p.Add(GlobalStepEviction(5));
  // The first half (updated at 3) goes; the second (admitted before any step:
  // unknown age) is stamped in its version, which lives in DRAM.
  CHECK_EQ(t.Evict(10, p), 1000);
  CHECK_EQ(t.tier_stats().misses, misses);
  CHECK_EQ(t.size(), 1000);
}

static void test_rows_widen_on_disk_when_slots_are_added() {
  const int dim = 3;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 20));
  const std::vector<int64_t> keys = KeysFrom(500, 13, 0);
  InsertBoth(t, dram, keys, 0, keys.size(), keys.size());
  CHECK(t.tier_stats().writebacks > 0);
  CHECK((t.EnsureSlots({{"acc", 0.25f}}) == std::vector<int>{3}));
  dram.EnsureSlots({{"acc", 0.25f}});
  CHECK_EQ(t.stride(), 6);
  CHECK(Dump(t) == Dump(dram));
}

static void test_string_keys_on_a_tiered_table() {
  const int dim = 4;
  Table<std::string_view, StringKeyTraits> dram(Cfg(dim));
  Table<std::string_view, StringKeyTraits, TieredStore<>> t(TierRows(Cfg(dim), 30));
  std::vector<std::string> owned;
  for (int i = 0; i < 600; ++i) owned.push_back("user-" + std::to_string(i * 7));
  std::vector<std::string_view> keys(owned.begin(), owned.end());
  for (int64_t step = 1; step <= 3; ++step) TrainStep(t, dram, keys, step, false);
  CHECK(t.tier_stats().misses > 0);
  CHECK(Dump(t) == Dump(dram));
}

static void test_private_directory_is_removed_and_stale_ones_cleared() {
  std::string parent = TempDir();
  std::string mine;
  {
    TieredStore<> s(4, TierConfig{1 << 20, parent});
    mine = s.dir();
    CHECK(Exists(mine + "/rows") && Exists(mine + "/lock"));
    // A second store in the same parent does not take the live one for stale.
    TieredStore<> other(4, TierConfig{1 << 20, parent});
    CHECK(Exists(mine) && other.dir() != mine);
  }
  CHECK(!Exists(mine));
  // A killed process's directory: its lock died with it.
  pid_t pid = ::fork();
  if (pid == 0) {
    TieredStore<> s(4, TierConfig{1 << 20, parent});
    std::FILE* f = std::fopen((parent + "/child-dir").c_str(), "w");
    std::fputs(s.dir().c_str(), f);
    std::fclose(f);
    ::kill(::getpid(), SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status));
  char buf[512] = {0};
  std::FILE* f = std::fopen((parent + "/child-dir").c_str(), "r");
  CHECK(f && std::fgets(buf, sizeof buf, f));
  std::fclose(f);
  CHECK(Exists(buf));
  TieredStore<> next(4, TierConfig{1 << 20, parent});
  CHECK(!Exists(buf));
}

// A serving lookup (FindEach: it faults cold rows into the cache) copying
// each row's first dim floats out.
template <typename T>
static void ServeFind(const T& t, const int64_t* keys, size_t n, float* out) {
  const int dim = t.dim();
  t.FindEach(keys, static_cast<int64_t>(n), false, SerialFor, [&](int64_t i, const float* row) {
    CHECK(row != nullptr);
    std::copy(row, row + dim, out + i * dim);
  });
}

// Two threads reading one cold row at once (both hold its segment lock
// shared): one reads it from disk, the other waits for it; both get the row.
static void test_two_readers_missing_the_same_row_both_get_it() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 8));
  const std::vector<int64_t> keys = KeysFrom(400, 11, 1);
  InsertBoth(t, dram, keys, 0, keys.size(), keys.size());
  const int64_t misses_before = t.tier_stats().misses;
  for (int round = 0; round < 200; ++round) {
    const int64_t k = keys[round % keys.size()];
    // Touch other keys so that k's row is on disk only.
    std::vector<int64_t> others;
    for (int i = 1; i <= 40; ++i) others.push_back(keys[(round + i * 7) % keys.size()]);
    others.erase(std::remove(others.begin(), others.end(), k), others.end());
    std::vector<float> o(others.size() * dim);
    ServeFind(t, others.data(), others.size(), o.data());
    std::vector<float> want(dim), a(dim), b(dim);
    dram.Find(&k, 1, want.data(), SerialFor);
    std::atomic<int> ready{0};
    std::thread th([&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      ServeFind(t, &k, 1, a.data());
    });
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
    ServeFind(t, &k, 1, b.data());
    th.join();
    CHECK(a == want);
    CHECK(b == want);
  }
  CHECK(t.tier_stats().misses - misses_before >= 200);
  CHECK(Dump(t) == Dump(dram));
}

// Lookups of one set of keys while another thread trains a disjoint set,
// evicting the first set's rows and faulting rows in: every lookup answers
// the right row, and the trained state equals the all-DRAM table's.
static void test_eviction_racing_lookups_loses_nothing() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 24));
  std::vector<int64_t> read_keys, train_keys;
  for (int i = 0; i < 150; ++i) read_keys.push_back(i * 2);
  for (int i = 0; i < 300; ++i) train_keys.push_back(i * 2 + 1);
  std::vector<float> want(read_keys.size() * dim);
  t.FindOrInsert(read_keys.data(), read_keys.size(), want.data(), kThreads);
  dram.FindOrInsert(read_keys.data(), read_keys.size(), want.data(), kThreads);
  std::atomic<bool> done{false};
  std::atomic<int> wrong{0};
  std::thread reader([&] {
    std::vector<float> got(read_keys.size() * dim);
    while (!done.load()) {
      t.Find(read_keys.data(), read_keys.size(), got.data(), SerialFor);
      if (got != want) wrong.fetch_add(1);
    }
  });
  for (int64_t step = 1; step <= 30; ++step) SgdStep(t, dram, train_keys, step);
  done.store(true);
  reader.join();
  CHECK_EQ(wrong.load(), 0);
  CHECK(t.tier_stats().writebacks > 0);
  CHECK(Dump(t) == Dump(dram));
}

// A disk that refuses writes (RLIMIT_FSIZE, in a child so the limit stays
// there): every write-back fails, rows stay in DRAM, nothing is lost.
static void test_full_disk_keeps_rows_in_dram_and_counts_failures() {
  const std::string dir = TempDir();  // made here, so main removes it
  InChild([&] {
    struct rlimit rl = {4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    const int dim = 8;
    Table<int64_t> dram(Cfg(dim));
    Tiered<int64_t> t(TierCfg(Cfg(dim), dir, 10 * (dim * 4 + 8)));
    t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    dram.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
    for (int64_t step = 1; step <= 4; ++step) {
      std::vector<int64_t> keys;
      for (int i = 0; i < 300; ++i) keys.push_back(i * 3 + step);
      TrainStep(t, dram, keys, step, false);
    }
    TierStats ts = t.tier_stats();
    bool ok = ts.write_failures > 0 && ts.resident > 200 && Dump(t) == Dump(dram) &&
              t.store().last_failure().find("stays in memory") != std::string::npos;
    if (!ok) return false;
    // Widening rows on a full disk: a clear error, the table unchanged.
    auto before = Dump(t);
    bool thrown = false;
    try {
      t.EnsureSlots({{"m", 0.f}, {"v", 0.f}, {"extra", 1.f}});
    } catch (const std::runtime_error& e) {
      thrown = std::string(e.what()).find("widening rows on disk failed") != std::string::npos;
    }
    return thrown && t.stride() == 3 * dim && Dump(t) == before;
  });
}

// A tier file at its record cap refuses the write-back as a full disk does:
// the rows stay in DRAM, the table equals the all-DRAM one, the failure says
// the file is full, and making room returns instead of waiting on a batch
// that never ends.
static void test_a_tier_file_at_its_record_cap_keeps_rows_in_dram_and_says_so() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  TableConfig c = TierRows(Cfg(dim), 10, 2);
  c.tier.max_disk_records = 2 * LogSpace::kExtent;
  Tiered<int64_t> t(c);
  for (int64_t step = 1; step <= 4; ++step) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 400; ++i) keys.push_back(i * 3 + step);
    TrainStep(t, dram, keys, step, false);
  }
  const TierStats ts = t.tier_stats();
  CHECK(ts.write_failures > 0);
  CHECK(ts.disk_records <= 2 * static_cast<int64_t>(LogSpace::kExtent));
  CHECK(ts.resident > ts.budget_rows);
  CHECK(Dump(t) == Dump(dram));
  CHECK(t.store().last_failure().find("the tier file is full (512 records); every row stays in memory") !=
        std::string::npos);
  t.store().MakeRoom(50);
  CHECK(Dump(t) == Dump(dram));
}

// A refused write-back goes to the operation whose eviction it was: of two
// operations running at once on a disk that refuses every write, the one
// that evicts reports it and the one whose rows are all in DRAM (hits only,
// no fault) does not, whenever its report was open. In a child, for the limit.
static void test_a_refused_write_back_goes_to_the_op_whose_eviction_it_was() {
  std::string dir = TempDir();
  InChild([&] {
    const int dim = 8;
    TableConfig c = Cfg(dim);
    c.segments_log2 = 3;
    Tiered<int64_t> t(TierCfg(c, dir, 256 * (dim * 4 + 8)));
    std::vector<int64_t> mine, theirs;
    for (int i = 0; i < 64; ++i) mine.push_back(i * 7 + 1);
    for (int i = 0; i < 2000; ++i) theirs.push_back(100000 + i);
    std::vector<float> out(theirs.size() * dim);
    t.FindOrInsert(mine.data(), mine.size(), out.data(), SerialFor);  // resident: within the budget
    struct rlimit rl = {0, 0};  // from here every write-back is refused: no row ever leaves DRAM
    ::setrlimit(RLIMIT_FSIZE, &rl);
    std::mutex mu;
    std::condition_variable cv;
    int stage = 0;  // 1: the hits-only op's report is open; 2: the evicting op has finished
    auto wait_for = [&](int s) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return stage >= s; });
    };
    auto reach = [&](int s) {
      std::lock_guard<std::mutex> l(mu);
      stage = s;
      cv.notify_all();
    };
    int64_t hits_only = -1, evicting = -1;
    std::string message;
    std::thread reader([&] {
      WriteBackReport report;
      reach(1);
      wait_for(2);
      std::vector<float> o(mine.size() * dim);
      t.FindOrInsert(mine.data(), mine.size(), o.data(), SerialFor);
      hits_only = report.failures();
    });
    wait_for(1);
    {
      WriteBackReport report;
      t.FindOrInsert(theirs.data(), theirs.size(), out.data(), SerialFor);
      evicting = report.failures();
      message = report.message();
    }
    reach(2);
    reader.join();
    const bool ok = evicting > 0 && message.find("stays in memory") != std::string::npos && hits_only == 0 &&
                    t.tier_stats().resident >= static_cast<int64_t>(mine.size() + theirs.size());
    return ok;
  });
}

// A write-back the cleaner thread fails (it serves no operation) goes to the
// next fault made with a report open, once: not to the operation running
// while it failed (a one-segment table: the cleaner alone evicts, between
// batches), not to a read, not to the fault after. The disk keeps refusing;
// the rows beyond the budget are erased so that the cleaner has nothing left
// to try. In a child, for the limit.
static void test_a_refused_write_back_of_the_cleaner_goes_to_the_next_fault_once() {
  std::string dir = TempDir();
  InChild([&] {
    const int dim = 8;
    TableConfig c = Cfg(dim);
    c.segments_log2 = 0;
    Tiered<int64_t> t(TierCfg(c, dir, 100 * (dim * 4 + 8)));
    struct rlimit rl = {0, 0};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    std::vector<int64_t> keys;
    for (int i = 0; i < 300; ++i) keys.push_back(i * 3 + 2);
    std::vector<float> out(keys.size() * dim);
    int64_t during = -1, read = -1, next = -1, after = -1;
    std::string message;
    {
      WriteBackReport report;  // one lock hold: the cleaner cannot evict while it runs
      t.FindOrInsert(keys.data(), keys.size(), out.data(), SerialFor);
      during = report.failures();
    }
    const bool failed = !t.store().Settle();  // the cleaner tries the rows beyond the budget: refused
    t.Erase(keys.data() + 40, keys.size() - 40, false);
    while (!t.store().Settle()) {
    }  // within the cleaner's mark: it sleeps, and tries nothing more
    {
      WriteBackReport report;
      t.Find(keys.data(), 40, out.data(), SerialFor);
      read = report.failures();
    }
    int64_t k = 1000001;
    {
      WriteBackReport report;
      t.FindOrInsert(&k, 1, out.data(), SerialFor);  // a new key: a fault within the budget
      next = report.failures();
      message = report.message();
    }
    k = 1000002;
    {
      WriteBackReport report;
      t.FindOrInsert(&k, 1, out.data(), SerialFor);
      after = report.failures();
    }
    const bool ok = failed && during == 0 && read == 0 && next > 0 && after == 0 &&
                    message.find("stays in memory") != std::string::npos;
    if (!ok)
      std::fprintf(stderr, "failed %d during %lld read %lld next %lld after %lld\n", failed, (long long)during,
                   (long long)read, (long long)next, (long long)after);
    return ok;
  });
}

// A load of more rows than the budget, every one of them hot (the policy's
// largest weight, so a bounded sweep finds no victim until the hand has
// passed the cache many times): the cache's slot arrays, which are never
// returned, stay within the budget plus one batch being written (the
// cleaner's), one part and a chunk of rounding, however the cleaner runs.
static void test_a_load_of_hot_rows_keeps_the_cache_within_its_budget() {
  const int dim = 8;
  std::string dir = TempDir();
  TableConfig c = Cfg(dim);
  c.segments_log2 = 4;
  const int64_t slot = dim * 4 + 8, budget = 200000, piece = 4096, n = 100 * piece;
  Tiered<int64_t> t(TierCfg(c, dir, budget * slot));
  CHECK_EQ(t.tier_stats().budget_rows, budget);
  std::vector<int64_t> keys(piece), versions(piece, 1), freqs(piece, int64_t{1} << 20);
  std::vector<float> vals(piece * dim, 0.5f);
  for (int64_t lo = 0; lo < n; lo += piece) {
    for (int64_t i = 0; i < piece; ++i) keys[i] = lo + i;
    t.ImportRows(keys.data(), piece, vals.data(), dim, nullptr, 0, {}, versions.data(), freqs.data(), false);
  }
  CHECK_EQ(t.size(), n);
  // The batch being written is the cleaner's (at most four extents); a part is at most the piece.
  const int64_t bound = (budget + 4 * LogSpace::kExtent + piece + 4095) / 4096 * 4096;
  if (t.store().slots() > bound)
    std::fprintf(stderr, "slot arrays of %lld slots, more than %lld\n", static_cast<long long>(t.store().slots()),
                 static_cast<long long>(bound));
  CHECK(t.store().slots() <= bound);
  CHECK(t.tier_stats().writebacks > 0);
}

// Rows evicted together are written together: one write per batch of
// victims (a run of adjacent records), not one per row.
static void test_evicted_rows_are_written_in_batches() {
  const int dim = 8;
  Tiered<int64_t> t(TierRows(Cfg(dim), 512));
  std::vector<int64_t> keys;
  for (int i = 0; i < 20000; ++i) keys.push_back(i * 3 + 1);
  std::vector<float> out(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  CHECK(t.store().Settle());  // the cleaner's last batch written: `resident` is final
  const TierStats ts = t.tier_stats();
  CHECK(ts.writebacks >= 19000);
  CHECK(ts.write_batches * 16 <= ts.writebacks);  // batches of budget/8 = 64 rows
  CHECK(ts.resident <= ts.budget_rows + 64);
}

// Misses of one lookup batch are read sorted by disk location, adjacent
// records in one read: rows that were evicted together come back in runs.
static void test_misses_of_one_batch_are_read_in_runs() {
  const int dim = 8;
  TableConfig c = Cfg(dim);
  c.segments_log2 = 1;  // two segments: a batch's victims are the other segment's rows
  Table<int64_t> dram(c);
  Tiered<int64_t> t(TierRows(c, 256));
  std::vector<int64_t> keys;
  for (int i = 0; i < 6000; ++i) keys.push_back(i * 7 + 2);
  std::vector<float> out(keys.size() * dim), want(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), SerialFor);
  dram.FindOrInsert(keys.data(), keys.size(), want.data(), SerialFor);
  CHECK(t.store().Settle());  // the cleaner has evicted what the batch took beyond the budget
  const TierStats before = t.tier_stats();
  t.Find(keys.data(), keys.size(), out.data(), SerialFor);
  CHECK(out == want);
  const TierStats after = t.tier_stats();
  const int64_t misses = after.misses - before.misses, reads = after.read_calls - before.read_calls;
  CHECK(misses > 4000);
  CHECK(reads * 4 < misses);
}

// An import (a restore's chunk, a serving table's delta) writes a segment's
// part of its batch under one lock: the part's cold rows are read together,
// in runs of adjacent records, instead of one read per row; the table ends
// exactly as the all-DRAM table given the same imports, and within its
// budget once the cleaner has caught up.
static void test_an_import_reads_the_cold_rows_of_a_segment_together() {
  const int dim = 8;
  TableConfig c = Cfg(dim);
  c.segments_log2 = 1;
  Table<int64_t> dram(c);
  Tiered<int64_t> t(TierRows(c, 256));
  const int64_t n = 6000;
  std::vector<int64_t> keys, ver(n), freq(n);
  std::vector<float> vals(n * dim);
  for (int64_t i = 0; i < n; ++i) keys.push_back(i * 7 + 2);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < n; ++i) {
      ver[i] = pass * n + i;
      freq[i] = 1 + i % 5;
      for (int d = 0; d < dim; ++d) vals[i * dim + d] = static_cast<float>(pass * 1000 + i) / 8.f + d;
    }
    const TierStats before = t.tier_stats();
    t.ImportRows(keys.data(), n, vals.data(), dim, nullptr, 0, {}, ver.data(), freq.data(), false, kThreads);
    dram.ImportRows(keys.data(), n, vals.data(), dim, nullptr, 0, {}, ver.data(), freq.data(), false);
    const TierStats after = t.tier_stats();
    if (pass == 1) {  // the second import rewrites rows that are mostly on disk
      const int64_t misses = after.misses - before.misses, reads = after.read_calls - before.read_calls;
      CHECK(misses > n / 2);
      CHECK(reads * 4 < misses);
    }
    CHECK(t.store().Settle());
    CHECK(t.tier_stats().resident <= t.tier_stats().budget_rows);
  }
  CHECK(Dump(t) == Dump(dram));
}

// A read-only lookup (Find) of cold rows reads them from disk without
// caching them: no slot is taken, nothing is evicted or written back, and
// it answers what the all-DRAM table answers.
static void test_a_read_only_lookup_caches_nothing_and_writes_nothing_back() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 128));
  std::vector<int64_t> keys;
  for (int i = 0; i < 3000; ++i) keys.push_back(i * 5 + 3);
  std::vector<float> out(keys.size() * dim), want(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  dram.FindOrInsert(keys.data(), keys.size(), want.data(), kThreads);
  CHECK(t.store().Settle());
  const TierStats before = t.tier_stats();
  t.Find(keys.data(), keys.size(), out.data(), kThreads);
  dram.Find(keys.data(), keys.size(), want.data(), kThreads);
  CHECK(out == want);
  const TierStats after = t.tier_stats();
  CHECK(after.misses - before.misses >= 2000);
  CHECK_EQ(after.writebacks, before.writebacks);
  CHECK_EQ(after.resident, before.resident);
}

// Rows rewritten again and again (Zipf training with a small cache) leave
// dead records behind; compaction moves the live ones out of sparse extents,
// so the file stays within about twice its live records, and every row stays
// exact.
static void test_compaction_keeps_the_file_near_its_live_rows() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 300));
  Zipf z(6000, 1.1, 11);
  for (int64_t step = 1; step <= 120; ++step) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 512; ++i) keys.push_back(z.Next() * 31 + 5);
    TrainStep(t, dram, keys, step, false);
  }
  const TierStats ts = t.tier_stats();
  CHECK(ts.compacted > 0);
  CHECK(ts.disk_records <= 2 * ts.live_records + 8 * static_cast<int64_t>(LogSpace::kExtent));
  CHECK(Dump(t) == Dump(dram));
}

// A bulk load leaves free room in the tier file (log_space.h: the reserve,
// one record in eight of the live ones, written with the load); training
// that rewrites rows evicted again fills that room before the file grows,
// and every row stays exact.
static void test_a_load_leaves_a_reserve_that_rewrites_fill_before_the_file_grows() {
  const int dim = 4;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 256));
  const std::vector<int64_t> keys = KeysFrom(100000, 7, 3);
  InsertBoth(t, dram, keys, 0, keys.size(), 8192);  // a load in batches
  t.WriteNewRows();  // the load's end (ev.load, a restore)
  CHECK(t.store().Settle());
  const TierStats loaded = t.tier_stats();
  CHECK_EQ(loaded.live_records, static_cast<int64_t>(keys.size()));
  CHECK(loaded.reserve_records >= loaded.live_records / 8 - LogSpace::kReserveChunk * LogSpace::kExtent);
  CHECK(loaded.reserve_records <= loaded.live_records / 8);
  CHECK_EQ(loaded.free_records, loaded.reserve_records);
  // Rewrites of rows spread over the file, fewer than the reserve holds.
  std::mt19937_64 rng(5);
  for (int64_t step = 1; step <= 10; ++step) {
    std::vector<int64_t> batch;
    for (int i = 0; i < 400; ++i) batch.push_back(keys[rng() % keys.size()]);
    SgdStep(t, dram, batch, step);
  }
  CHECK(t.store().Settle());
  const TierStats trained = t.tier_stats();
  CHECK(trained.writebacks - loaded.writebacks >= 2000);
  CHECK_EQ(trained.grown_by_rewrites, int64_t{0});
  CHECK_EQ(trained.disk_records, loaded.disk_records);
  CHECK(trained.free_records < loaded.free_records);
  CHECK(Dump(t) == Dump(dram));
}

// The end of a bulk load writes the rows the cache holds that have no disk
// copy yet (they stay resident, clean): every row is then on disk once, so
// training's write-backs are rewrites (into the reserve), and evicting an
// unchanged row writes nothing. A table within its budget writes nothing.
static void test_the_end_of_a_load_writes_the_rows_held_in_dram_only() {
  const int dim = 4;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 512));
  const std::vector<int64_t> keys = KeysFrom(20000, 3, 2);
  InsertBoth(t, dram, keys, 0, keys.size(), keys.size());
  CHECK(t.store().Settle());
  const TierStats before = t.tier_stats();
  CHECK(before.live_records < static_cast<int64_t>(keys.size()));
  t.WriteNewRows();
  const TierStats after = t.tier_stats();
  CHECK_EQ(after.live_records, static_cast<int64_t>(keys.size()));
  CHECK_EQ(after.resident, before.resident);
  CHECK_EQ(after.writebacks - before.writebacks, static_cast<int64_t>(keys.size()) - before.live_records);
  // Reading every row back (evicting the clean ones) writes nothing more.
  InsertBoth(t, dram, keys, 0, keys.size(), 1000);
  CHECK(t.store().Settle());
  CHECK_EQ(t.tier_stats().writebacks, after.writebacks);
  CHECK(Dump(t) == Dump(dram));

  Tiered<int64_t> small(TierRows(Cfg(dim), 4096));
  std::vector<float> out(1000 * dim);
  small.FindOrInsert(keys.data(), 1000, out.data(), kThreads);
  small.WriteNewRows();
  CHECK_EQ(small.tier_stats().writebacks, int64_t{0});
}

// The end of a load scans the whole cache, so it runs only after loads that
// allocated an eighth of the cache's slots in new rows since the last scan:
// a smaller load's new rows stay in DRAM only, and are written when evicted,
// as any other row. Exact either way.
static void test_a_load_too_small_to_pay_for_the_scan_leaves_its_rows_to_eviction() {
  const int dim = 4;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 4096));
  const std::vector<int64_t> keys = KeysFrom(30000, 3, 2);
  InsertBoth(t, dram, keys, 0, 20000, 1000);
  CHECK(t.store().Settle());  // the cleaner holds no segment lock: the scan can write every row
  t.WriteNewRows();  // a large load: every row on disk once
  const TierStats loaded = t.tier_stats();
  CHECK_EQ(loaded.live_records, int64_t{20000});
  const int64_t slots = t.store().slots();
  const int64_t small = slots / 8 - 1;
  CHECK(small > 0);
  InsertBoth(t, dram, keys, 20000, 20000 + small, small);
  CHECK(t.store().Settle());
  const TierStats before = t.tier_stats();
  t.WriteNewRows();  // a small load: no scan, nothing written
  const TierStats after = t.tier_stats();
  CHECK_EQ(after.writebacks, before.writebacks);
  CHECK_EQ(after.live_records, before.live_records);
  CHECK(after.live_records < 20000 + small);
  // Eviction writes them: reading the other rows back pushes them out.
  InsertBoth(t, dram, keys, 0, 20000, 1000);
  CHECK(t.store().Settle());
  CHECK(t.tier_stats().live_records > after.live_records);
  CHECK(Dump(t) == Dump(dram));
}

// Widening rewrites the file dense (every record live, in disk order) and
// appends the new file's reserve with it: the training that follows the
// first Adam apply rewrites rows into free room, as after a load.
static void test_a_widened_file_has_its_reserve() {
  const int dim = 4;
  Tiered<int64_t> t(TierRows(Cfg(dim), 256));
  std::vector<int64_t> keys;
  for (int i = 0; i < 60000; ++i) keys.push_back(i);
  std::vector<float> out(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  const TierStats ts = t.tier_stats();
  CHECK(ts.live_records >= 59000);
  CHECK(ts.reserve_records >= ts.live_records / 8 - LogSpace::kReserveChunk * LogSpace::kExtent);
  CHECK_EQ(ts.free_records, ts.reserve_records);
  CHECK(ts.disk_records <= ts.live_records + ts.reserve_records + LogSpace::kExtent);
}

// Long Zipf training with a small cache rewrites every warm row many times
// over: once the reserve is used up, compaction frees extents by moving the
// live records of sparse ones, so rewrites keep reusing the file instead of
// growing it, and every row stays exact.
static void test_compaction_keeps_rewrites_inside_the_file() {
  const int dim = 4;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 512));
  const std::vector<int64_t> all = KeysFrom(30000, 5, 1);
  InsertBoth(t, dram, all, 0, all.size(), all.size());
  Zipf z(30000, 1.1, 3);
  for (int64_t step = 1; step <= 150; ++step) {
    std::vector<int64_t> keys;
    for (int i = 0; i < 512; ++i) keys.push_back(all[(z.Next() * 7919) % all.size()]);
    SgdStep(t, dram, keys, step);
  }
  CHECK(t.store().Settle());
  const TierStats ts = t.tier_stats();
  CHECK(ts.writebacks - 30000 > 4 * ts.reserve_records);  // far more rewrites than the reserve holds
  CHECK(ts.compacted > 0);
  CHECK(ts.grown_by_rewrites * 4 < ts.writebacks - 30000);
  CHECK(ts.disk_records <= 2 * ts.live_records);
  CHECK(Dump(t) == Dump(dram));
}

// Two threads train disjoint keys of one tiered table (evicting each other's
// rows, compacting) while a third looks keys up: the result equals the
// all-DRAM table trained the same way, bit for bit. The ThreadSanitizer
// build runs this.
static void test_concurrent_training_and_lookups_equal_all_dram() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 64));
  auto offs = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  dram.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  AdamUpdate adam{0.01f, 0.9f, 0.999f, 1e-7f, dim, offs[0], offs[1]};
  auto train = [&](auto& table, int who) {
    Zipf z(1500, 1.1, 100 + who);
    std::vector<float> out(200 * dim), g(200 * dim);
    for (int64_t step = 1; step <= 25; ++step) {
      std::vector<int64_t> keys;
      for (int i = 0; i < 200; ++i) keys.push_back(z.Next() * 2 + who);  // disjoint: odd / even
      table.FindOrInsert(keys.data(), keys.size(), out.data(), SerialFor);
      for (size_t i = 0; i < g.size(); ++i) g[i] = out[i] * 0.01f + static_cast<float>(i % 5) * 0.001f;
      std::vector<int64_t> uk;
      std::vector<float> ug;
      int64_t un = UniqueSum(keys.data(), g.data(), static_cast<int64_t>(keys.size()), dim, &uk, &ug);
      table.Apply(uk.data(), ug.data(), un, step, adam, SerialFor);
    }
  };
  std::atomic<bool> done{false};
  std::thread reader([&] {
    std::vector<int64_t> keys;
    for (int i = 0; i < 300; ++i) keys.push_back(i);
    std::vector<float> out(keys.size() * dim);
    while (!done.load()) t.Find(keys.data(), keys.size(), out.data(), SerialFor);
  });
  std::thread a([&] { train(t, 0); });
  std::thread b([&] { train(t, 1); });
  a.join();
  b.join();
  done.store(true);
  reader.join();
  train(dram, 0);
  train(dram, 1);
  CHECK(t.tier_stats().writebacks > 0);
  CHECK(Dump(t) == Dump(dram));
}

// The record file reads back what it wrote, through its mapping (records in
// several windows, one past a window's end, a hole in between) and on the
// portable preadv path alike.
static void test_record_file_reads_records_across_mapped_windows_and_without_the_mapping() {
  for (bool mapped : {true, false}) {
    std::string dir = TempDir();
    RowFile f(dir, sizeof(uint32_t), mapped);
    const uint32_t w = RowFile::kWindowRecords;
    std::vector<uint32_t> locs = {0, 1, w - 1, w, w + 1, 3 * w + 5};
    for (uint32_t loc : locs) {
      const uint32_t v = loc * 3 + 1;
      const void* src = &v;
      CHECK(f.Write(loc, &src, 1));
    }
    std::vector<uint32_t> got(locs.size());
    std::vector<void*> dsts;
    for (uint32_t& g : got) dsts.push_back(&g);
    f.ReadMany(locs.data(), dsts.data(), locs.size());
    for (size_t i = 0; i < locs.size(); ++i) CHECK_EQ(got[i], locs[i] * 3 + 1);
    uint32_t one = 0;
    f.Read(2 * w, &one);  // a hole inside the file: zeros
    CHECK_EQ(one, 0u);
    CHECK(f.mapped_reads() == mapped);
  }
}

// A directory on the file system holding the working directory (the
// repository, under CTest), not /tmp: the test below needs a file system
// whose pages the kernel drops on request, which a tmpfs /tmp is not.
static std::string DiskDir() {
  char tmpl[] = "evstore-tiered-test-XXXXXX";
  CHECK(::mkdtemp(tmpl) != nullptr);
  temp_dirs.push_back(std::filesystem::absolute(tmpl));
  return temp_dirs.back();
}

// Mapped reads of pages that are not in the page cache fault them in from
// disk one at a time; after a batch that took such faults, the next batches
// ask the kernel for all their records first, and read the same bytes.
static void test_mapped_reads_after_major_faults_ask_the_kernel_for_the_batch_first() {
  const size_t rb = 768;  // a dim-64 Adam row
  RowFile f(DiskDir(), rb);
  const uint32_t n = 2048;  // 1.5 MiB, 384 pages
  // Written through a descriptor of the test's own (RowFile::Write would also
  // map the pages, and POSIX_FADV_DONTNEED leaves mapped pages cached), written back,
  // then dropped from the page cache.
  const std::string path = f.dir() + "/rows";
  const int fd = ::open(path.c_str(), O_RDWR);
  CHECK(fd >= 0);
  std::vector<char> rec(rb);
  for (uint32_t loc = 0; loc < n; ++loc) {
    std::memset(rec.data(), static_cast<int>(loc * 7 + 1), rb);
    CHECK_EQ(::pwrite(fd, rec.data(), rb, static_cast<off_t>(loc) * rb), static_cast<ssize_t>(rb));
  }
  CHECK_EQ(::fdatasync(fd), 0);
  CHECK_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  auto read_batch = [&](uint32_t first) {  // every 16th record: a page of its own each
    std::vector<uint32_t> locs;
    for (uint32_t loc = first; loc < n; loc += 16) locs.push_back(loc);
    std::vector<std::vector<char>> got(locs.size(), std::vector<char>(rb));
    std::vector<void*> dsts;
    for (auto& g : got) dsts.push_back(g.data());
    f.ReadMany(locs.data(), dsts.data(), locs.size());
    for (size_t i = 0; i < locs.size(); ++i)
      for (size_t b = 0; b < rb; ++b) CHECK_EQ(got[i][b], static_cast<char>(locs[i] * 7 + 1));
  };
  read_batch(0);  // from the disk, a fault per page
  CHECK_EQ(f.hinted_batches(), 0);
  read_batch(8);  // other pages: asked for together first
  CHECK_EQ(f.hinted_batches(), 1);
  read_batch(8);  // the same pages again: still within the hinted batches
  CHECK_EQ(f.hinted_batches(), 2);
}

// This thread's page faults that read nothing from disk (the kernel mapped a
// page it had).
static long MinorFaults() {
  rusage ru;
  ::getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_minflt;
}
#if defined(__SANITIZE_THREAD__)
static constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
static constexpr bool kThreadSanitizer = true;
#else
static constexpr bool kThreadSanitizer = false;
#endif
#else
static constexpr bool kThreadSanitizer = false;
#endif
// Whether the running kernel is at least major.minor (uname).
static bool KernelAtLeast(int major, int minor) {
  utsname u;
  CHECK_EQ(::uname(&u), 0);
  int a = 0, b = 0;
  std::sscanf(u.release, "%d.%d", &a, &b);
  return a > major || (a == major && b >= minor);
}

// Records are mapped as they are written (MADV_POPULATE_READ, Linux 5.14):
// reading them back through the mapping takes no page fault, where each
// first touch of a page took one.
static void test_records_written_are_mapped_at_once_and_read_without_a_page_fault() {
  const size_t rb = 768;  // a dim-64 Adam row
  RowFile f(TempDir(), rb);
  const uint32_t n = 2048;  // 384 pages, written as one run
  std::vector<char> rows(n * rb);
  std::vector<const void*> srcs(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::memset(rows.data() + i * rb, static_cast<int>(i * 7 + 1), rb);
    srcs[i] = rows.data() + i * rb;
  }
  CHECK(f.Write(0, srcs.data(), n));
  CHECK(f.populating() == KernelAtLeast(5, 14));
  std::vector<uint32_t> locs;
  for (uint32_t loc = 0; loc < n; loc += 5) locs.push_back(loc);  // a record on every page
  std::vector<char> got(locs.size() * rb, 0);  // touched now: its own pages take no fault below
  std::vector<void*> dsts;
  for (size_t i = 0; i < locs.size(); ++i) dsts.push_back(got.data() + i * rb);
  const long before = MinorFaults();
  f.ReadMany(locs.data(), dsts.data(), locs.size());
  const long faults = MinorFaults() - before;
  for (size_t i = 0; i < locs.size(); ++i)
    for (size_t b = 0; b < rb; ++b) CHECK_EQ(got[i * rb + b], static_cast<char>(locs[i] * 7 + 1));
  // ThreadSanitizer's shadow of the mapping's addresses takes faults of its
  // own on the first read through them: that build checks the bytes only.
  if (f.populating() && !kThreadSanitizer) CHECK_EQ(faults, 0);
}

// stats() counts the tier's per-key DRAM cost: 24 bytes of metadata per row
// id (allocated in chunks of 65,536) and 4 bytes per disk record.
static void test_stats_count_the_per_key_dram_cost() {
  const int dim = 4;
  Tiered<int64_t> t(TierRows(Cfg(dim), 64));
  std::vector<int64_t> keys;
  for (int i = 0; i < 5000; ++i) keys.push_back(i);
  std::vector<float> out(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  const TableStats st = t.Stats();
  const TierStats ts = t.tier_stats();
  CHECK(ts.disk_records >= 4000);
  CHECK(st.meta_bytes >= 65536 * 24 + ts.disk_records * 4);
  CHECK(st.meta_bytes <= 65536 * 24 + ts.disk_records * 4 + 64 * 1024);  // + the log's extent table
}

// The cleaner thread carries a name (what profilers show, and what the EV
// benchmark reads to give its CPU to the tiered side), one per tiered table.
static int CleanerThreads() {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::FILE* f = std::fopen((task.path() / "comm").c_str(), "r");
    if (!f) continue;
    char name[32] = {};
    if (std::fgets(name, sizeof(name), f)) n += std::string_view(name).substr(0, 15) == TieredStore<>::kCleanerName;
    std::fclose(f);
  }
  return n;
}
static void test_each_tiered_table_has_one_cleaner_thread_named_evstore_cleaner() {
  const int before = CleanerThreads();
  {
    Tiered<int64_t> t(TierRows(Cfg(4), 64));
    CHECK_EQ(CleanerThreads(), before + 1);
  }
  CHECK_EQ(CleanerThreads(), before);
}

static void test_bad_config_is_refused() {
  CHECK_THROWS((TieredStore<>(4, TierConfig{0, "/tmp"})), std::invalid_argument);
  CHECK_THROWS((TieredStore<>(4, TierConfig{1024, ""})), std::invalid_argument);
  CHECK_THROWS((TieredStore<>(4, TierConfig{1024, "/proc/evstore-no-such/dir"})), std::runtime_error);
  CHECK_THROWS((TieredStore<>(4, TierConfig{1024, "/tmp", true, -1})), std::invalid_argument);
}

static void test_frequency_clock_weights() {
  CHECK_EQ(FrequencyClock::HeatOf(0), 1);
  CHECK_EQ(FrequencyClock::HeatOf(1), 1);
  CHECK_EQ(FrequencyClock::HeatOf(1000), 10);
  CHECK_EQ(FrequencyClock::HeatOf(0x7FFFFFFF), FrequencyClock::kMaxWeight);
  std::atomic<uint8_t> w{0};
  FrequencyClock::OnAccess(w, 3);
  CHECK(!FrequencyClock::Pass(w) && !FrequencyClock::Pass(w) && !FrequencyClock::Pass(w) && FrequencyClock::Pass(w));
}

// Making room before a publish (MakeRoom, EvServeWarm) evicts even when
// every resident row is heavy: a round of the CLOCK hand that finds no
// victim only takes weight, so one empty round is no reason to stop. The
// rows that follow then fit without a write.
static void test_making_room_evicts_rows_the_hand_needs_several_rounds_for() {
  const int dim = 8;
  Tiered<int64_t> t(TierRows(Cfg(dim), 128));
  std::vector<int64_t> keys;
  for (int i = 0; i < 3000; ++i) keys.push_back(i * 5 + 3);
  std::vector<float> out(keys.size() * dim);
  t.FindOrInsert(keys.data(), keys.size(), out.data(), kThreads);
  std::vector<int64_t> hot(keys.begin(), keys.begin() + 100);
  for (int i = 0; i < 16; ++i) t.FindOrInsert(hot.data(), hot.size(), out.data(), kThreads);  // weight 5 each
  CHECK(t.store().Settle());
  const TierStats before = t.tier_stats();
  CHECK(before.resident + 50 > before.budget_rows);
  t.store().MakeRoom(50);
  const TierStats after = t.tier_stats();
  CHECK(after.resident + 50 <= after.budget_rows);
  CHECK(after.resident < before.resident);  // evicted: a row already on disk leaves without a write-back
  std::vector<int64_t> fresh;
  for (int i = 0; i < 50; ++i) fresh.push_back(1000000 + i);
  t.FindOrInsert(fresh.data(), fresh.size(), out.data(), kThreads);
  CHECK_EQ(t.tier_stats().writebacks, after.writebacks);
}

// Making room (MakeRoom) while two threads train and the cleaner evicts:
// four evictors share the eviction routine and its wake-up (a fault waiting
// for a batch, MakeRoom for the batches still being written). Every call
// returns, the trained state equals the all-DRAM table's, and once training
// has stopped making room leaves n rows of room under the cleaner's mark.
static void test_making_room_racing_training_loses_nothing() {
  const int dim = 8;
  Table<int64_t> dram(Cfg(dim));
  Tiered<int64_t> t(TierRows(Cfg(dim), 64));
  std::vector<int64_t> keys;
  for (int i = 0; i < 600; ++i) keys.push_back(i * 3 + 2);
  std::atomic<bool> done{false};
  std::atomic<int> calls{0};
  std::thread warm([&] {
    do {
      t.store().MakeRoom(16);
      calls.fetch_add(1);
    } while (!done.load());
  });
  for (int64_t step = 1; step <= 20; ++step) SgdStep(t, dram, keys, step);
  done.store(true);
  warm.join();
  CHECK(calls.load() > 0);
  CHECK(t.tier_stats().writebacks > 0);
  CHECK(Dump(t) == Dump(dram));
  t.store().MakeRoom(16);
  const TierStats ts = t.tier_stats();
  CHECK(ts.resident + 16 <= ts.budget_rows - ts.budget_rows / 8);
}

int main() {
  RUN(test_frequency_clock_weights);
  RUN(test_bad_config_is_refused);
  RUN(test_tiered_table_equals_all_dram_table_bit_for_bit);
  RUN(test_resident_rows_stay_near_the_budget);
  RUN(test_one_segment_table_stays_within_its_budget);
  RUN(test_full_walk_streams_cold_rows_without_caching_them);
  RUN(test_full_export_streams_cold_rows_in_file_order_in_long_reads);
  RUN(test_full_export_racing_writers_gives_each_key_once_untorn);
  RUN(test_eviction_by_step_reads_no_cold_row);
  RUN(test_rows_widen_on_disk_when_slots_are_added);
  RUN(test_string_keys_on_a_tiered_table);
  RUN(test_private_directory_is_removed_and_stale_ones_cleared);
  RUN(test_full_disk_keeps_rows_in_dram_and_counts_failures);
  RUN(test_a_refused_write_back_goes_to_the_op_whose_eviction_it_was);
  RUN(test_a_refused_write_back_of_the_cleaner_goes_to_the_next_fault_once);
  RUN(test_a_load_of_hot_rows_keeps_the_cache_within_its_budget);
  RUN(test_two_readers_missing_the_same_row_both_get_it);
  RUN(test_eviction_racing_lookups_loses_nothing);
  RUN(test_evicted_rows_are_written_in_batches);
  RUN(test_misses_of_one_batch_are_read_in_runs);
  RUN(test_an_import_reads_the_cold_rows_of_a_segment_together);
  RUN(test_a_read_only_lookup_caches_nothing_and_writes_nothing_back);
  RUN(test_making_room_evicts_rows_the_hand_needs_several_rounds_for);
  RUN(test_a_tier_file_at_its_record_cap_keeps_rows_in_dram_and_says_so);
  RUN(test_making_room_racing_training_loses_nothing);
  RUN(test_compaction_keeps_the_file_near_its_live_rows);
  RUN(test_a_load_leaves_a_reserve_that_rewrites_fill_before_the_file_grows);
  RUN(test_the_end_of_a_load_writes_the_rows_held_in_dram_only);
  RUN(test_a_load_too_small_to_pay_for_the_scan_leaves_its_rows_to_eviction);
  RUN(test_a_widened_file_has_its_reserve);
  RUN(test_compaction_keeps_rewrites_inside_the_file);
  RUN(test_concurrent_training_and_lookups_equal_all_dram);
  RUN(test_stats_count_the_per_key_dram_cost);
  RUN(test_each_tiered_table_has_one_cleaner_thread_named_evstore_cleaner);
  RUN(test_record_file_reads_records_across_mapped_windows_and_without_the_mapping);
  RUN(test_mapped_reads_after_major_faults_ask_the_kernel_for_the_batch_first);
  RUN(test_records_written_are_mapped_at_once_and_read_without_a_page_fault);
  for (const std::string& d : temp_dirs) std::filesystem::remove_all(d);
  std::printf("all tests passed\n");
  return 0;
}
