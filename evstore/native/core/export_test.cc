// TF-free tests of core/export.h (streaming checkpoint readout) and of the
// table's restore entry points (ImportRows slot-major, ImportFiltered demote,
// untracked Erase). Driven by tests/native/CMakeLists.txt (make test-native).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "crc32c.h"
#include "export.h"
#include "test_check.h"

using namespace evstore;

namespace {

struct Row {
  std::vector<float> row;
  int64_t version, freq;
};

// Collects what a checkpoint writer would receive.
template <typename K>
struct VecSink : ExportSink<K> {
  std::map<K, Row> rows;
  std::map<K, int64_t> filtered;
  std::map<K, int64_t> seen;
  std::map<int64_t, std::vector<uint8_t>> bloom;
  std::vector<K> deleted;
  int64_t row_calls = 0, max_chunk = 0;
  void Rows(const K* keys, const float* r, int stride, const int64_t* v, const int64_t* f, int64_t n) override {
    ++row_calls;
    max_chunk = std::max(max_chunk, n);
    for (int64_t i = 0; i < n; ++i) {
      CHECK(rows.count(keys[i]) == 0);  // every key once
      rows[keys[i]] = {std::vector<float>(r + i * stride, r + (i + 1) * stride), v[i], f[i]};
    }
  }
  void Filtered(const K* keys, const int64_t* f, const int64_t* s, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) filtered[keys[i]] = f[i], seen[keys[i]] = s[i];
  }
  void Deleted(const K* keys, int64_t n) override { deleted.insert(deleted.end(), keys, keys + n); }
  void BloomBlocks(const int64_t* ids, const uint8_t* c, int64_t n) override {
    const int64_t B = CountingBloom::kBlock;
    for (int64_t i = 0; i < n; ++i) bloom[ids[i]].assign(c + i * B, c + (i + 1) * B);
  }
};

TableConfig Cfg(int dim, uint32_t min_freq) {
  TableConfig c;
  c.dim = dim;
  c.min_freq = min_freq;
  for (int i = 0; i < 7 * dim; ++i) c.bank.push_back(static_cast<float>(i + 1));
  return c;
}

template <typename K>
void Insert(Table<K>& t, std::vector<K> keys) {
  std::vector<float> out(keys.size() * t.dim());
  t.FindOrInsert(keys.data(), keys.size(), out.data(), SerialFor);
}

template <typename K>
void Train(Table<K>& t, std::vector<K> keys, int64_t step) {
  std::vector<float> g(keys.size() * t.dim(), 0.5f);
  t.Apply(keys.data(), g.data(), keys.size(), step, [&](float* row, const float* grad) {
    for (int d = 0; d < t.dim(); ++d) {
      row[d] -= grad[d];
      row[t.dim() + d] += 1.f;  // the slot
    }
  }, SerialFor);
}

void test_full_export_streams_every_key_in_chunks() {
  Table<int64_t> t(Cfg(3, 2));
  t.EnsureSlots({{"acc", 0.25f}});
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 100; ++k) keys.push_back(k * 7919);
  Insert(t, keys);
  Insert(t, std::vector<int64_t>(keys.begin(), keys.begin() + 60));  // 60 admitted, 40 filtered
  Train(t, std::vector<int64_t>(keys.begin(), keys.begin() + 10), 5);
  VecSink<int64_t> sink;
  ExportCounts c = ExportFull(t, 1, 7, &sink);
  CHECK_EQ(c.rows, 60);
  CHECK_EQ(c.filtered, 40);
  CHECK_EQ(sink.max_chunk, 7);
  CHECK(sink.row_calls >= 60 / 7);
  std::vector<uint8_t> p(1), a(1);
  std::vector<int64_t> v(1), f(1);
  std::vector<float> r(t.stride());
  for (const auto& kv : sink.rows) {
    t.Read(&kv.first, 1, t.stride(), p.data(), a.data(), v.data(), f.data(), r.data());
    CHECK(a[0]);
    CHECK(kv.second.row == r);
    CHECK_EQ(kv.second.version, v[0]);
    CHECK_EQ(kv.second.freq, f[0]);
  }
  CHECK_EQ(sink.rows.at(keys[0]).version, int64_t{5});
  CHECK_EQ(sink.filtered.at(keys[99]), int64_t{1});
}

void test_delta_export_holds_dirty_and_deleted_keys_only() {
  Table<int32_t> t(Cfg(2, 1));
  t.EnsureSlots({{"acc", 0.f}});
  Insert<int32_t>(t, {1, 2, 3, 4, 5});
  t.Commit(t.BeginExport()->id);                 // a full was saved: nothing dirty
  Train<int32_t>(t, {2}, 9);
  Insert<int32_t>(t, {6});
  int32_t gone[] = {4};
  t.Erase(gone, 1);
  auto snap = t.BeginExport();
  int32_t later[] = {6};                          // erased after the seal: skipped
  t.Erase(later, 1);
  VecSink<int32_t> sink;
  ExportCounts c = ExportDelta(t, *snap, 1, 64, &sink);
  t.Commit(snap->id);
  CHECK_EQ(c.rows, 1);
  CHECK(sink.rows.count(2) == 1);
  CHECK_EQ(sink.rows.at(2).version, int64_t{9});
  CHECK(sink.deleted == std::vector<int32_t>{4});
  auto next = t.BeginExport();                    // the next delta deletes key 6
  CHECK(next->deleted == std::vector<int32_t>{6});
}

// A restore (Clear, then import) after the saving process died mid-export:
// the dead writer's snapshot goes, the next export starts a new one.
void test_clear_drops_an_export_in_flight() {
  Table<int32_t> t(Cfg(2, 1));
  Insert<int32_t>(t, {1, 2, 3});
  auto dead = t.BeginExport();                    // its writer never commits nor aborts
  CHECK(t.export_in_flight());
  t.Clear();
  CHECK(!t.export_in_flight());
  Insert<int32_t>(t, {7});
  auto next = t.BeginExport();
  CHECK(next->id != dead->id);
  t.Commit(next->id);
}

void test_export_during_concurrent_training_sees_whole_rows() {
  Table<int64_t> t(Cfg(8, 1));
  t.EnsureSlots({{"acc", 0.f}});
  std::vector<int64_t> keys(5000);
  for (int64_t i = 0; i < 5000; ++i) keys[i] = i;
  Insert(t, keys);
  // Each apply sets row[1..7] to one new value: a torn row would mix two.
  std::vector<float> g(keys.size() * 8, 1.f);
  auto apply = [&](int64_t step) {
    t.Apply(keys.data(), g.data(), keys.size(), step, [](float* row, const float* grad) {
      for (int d = 1; d < 8; ++d) row[d] = row[0] + grad[d] * static_cast<float>(d > 0);
      row[0] += 1.f;
    }, SerialFor);
  };
  apply(0);
  std::atomic<bool> stop{false};
  std::thread trainer([&] {
    for (int64_t step = 1; !stop; ++step) apply(step);
  });
  for (int round = 0; round < 5; ++round) {
    VecSink<int64_t> sink;
    ExportFull(t, 1, 333, &sink);
    CHECK_EQ(static_cast<int64_t>(sink.rows.size()), int64_t{5000});
    for (const auto& kv : sink.rows)
      for (int d = 1; d < 8; ++d) CHECK(kv.second.row[d] == kv.second.row[1]);
  }
  stop = true;
  trainer.join();
}

void test_import_rows_reads_slot_major_chunks() {
  Table<int64_t> t(Cfg(2, 1));
  auto offs = t.EnsureSlots({{"m", 0.f}, {"v", 0.f}});
  int64_t keys[] = {10, 20, 30};
  float values[] = {1, 2, 3, 4, 5, 6};
  // slot-major: m rows of all keys, then v rows
  float slots[] = {11, 12, 13, 14, 15, 16, 21, 22, 23, 24, 25, 26};
  int64_t vers[] = {1, 2, 3}, freqs[] = {4, 5, 6};
  t.ImportRows(keys, 3, values, 2, slots, 2, 3 * 2, offs, vers, freqs, false);
  std::vector<uint8_t> p(1), a(1);
  std::vector<int64_t> v(1), f(1);
  std::vector<float> r(t.stride());
  t.Read(&keys[1], 1, t.stride(), p.data(), a.data(), v.data(), f.data(), r.data());
  CHECK((r == std::vector<float>{3, 4, 13, 14, 23, 24}));
  CHECK_EQ(v[0], int64_t{2});
  CHECK_EQ(t.Stats().dirty, int64_t{0});
}

void test_import_filtered_demote_frees_the_row_and_untracked_erase_leaves_no_deletion() {
  Table<int64_t> t(Cfg(2, 1));
  Insert<int64_t>(t, {1, 2});
  t.Commit(t.BeginExport()->id);
  int64_t k1 = 1, f1 = 3;
  t.ImportFiltered(&k1, 1, &f1, false, /*demote=*/true);
  TableStats st = t.Stats();
  CHECK_EQ(st.admitted, int64_t{1});
  CHECK_EQ(st.filtered, int64_t{1});
  CHECK_EQ(st.free_rows, int64_t{1});
  int64_t k2 = 2;
  CHECK_EQ(t.Erase(&k2, 1, /*track_deleted=*/false), int64_t{1});
  CHECK_EQ(t.Stats().deleted, int64_t{0});
  CHECK_EQ(t.Stats().dirty, int64_t{0});
}

void test_reserved_table_imports_a_full_export_in_table_order() {
  Table<int64_t> src(Cfg(2, 1));
  std::vector<int64_t> keys(20000);
  for (int64_t i = 0; i < 20000; ++i) keys[i] = i * 2654435761LL;
  Insert(src, keys);
  VecSink<int64_t> sink;
  ExportFull(src, 0, 4096, &sink);
  // Re-import in the order a checkpoint holds them (table order, i.e. hash order).
  std::vector<int64_t> order;
  Table<int64_t> src2(Cfg(2, 1));
  struct Ordered : ExportSink<int64_t> {
    std::vector<int64_t>* out;
    void Rows(const int64_t* k, const float*, int, const int64_t*, const int64_t*, int64_t n) override {
      out->insert(out->end(), k, k + n);
    }
    void Filtered(const int64_t*, const int64_t*, const int64_t*, int64_t) override {}
    void Deleted(const int64_t*, int64_t) override {}
    void BloomBlocks(const int64_t*, const uint8_t*, int64_t) override {}
  } ordered;
  ordered.out = &order;
  ExportFull(src, 0, 4096, &ordered);
  Table<int64_t> dst(Cfg(2, 1));
  dst.Reserve(static_cast<int64_t>(order.size()));
  std::vector<float> vals(order.size() * 2, 1.f);
  std::vector<int64_t> vers(order.size(), 3), freqs(order.size(), 1);
  dst.ImportRows(order.data(), order.size(), vals.data(), 2, nullptr, 0, {}, vers.data(), freqs.data(), false);
  CHECK_EQ(dst.Stats().admitted, int64_t{20000});
  std::vector<float> out(order.size() * 2);
  dst.Find(order.data(), order.size(), out.data(), SerialFor);
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 1.f; }));
}

void test_crc32c_matches_the_standard_check_value_in_any_split() {
  const char* check = "123456789";
  CHECK_EQ(Crc32cExtend(0, check, 9), 0xE3069283u);
  std::vector<uint8_t> buf(100003);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
  uint32_t whole = Crc32cExtend(0, buf.data(), buf.size());
  uint32_t split = Crc32cExtend(Crc32cExtend(0, buf.data(), 13), buf.data() + 13, buf.size() - 13);
  CHECK_EQ(whole, split);
  CHECK_EQ(whole, ~crc32c_internal::Software(~0u, buf.data(), buf.size()));
}


void test_filter_state_last_seen_steps_and_bloom_blocks_are_exported() {
  // CounterFilter: a filtered key's last-seen step goes with its count.
  Table<int64_t> t(Cfg(2, 3));
  t.AdvanceClock(7);
  Insert(t, std::vector<int64_t>{5});
  VecSink<int64_t> full;
  ExportFull(t, 0, 16, &full);
  CHECK_EQ(full.seen.at(5), int64_t{7});
  Table<int64_t> back(Cfg(2, 3));
  int64_t k = 5, f = 1, seen = 7;
  back.ImportFiltered(&k, 1, &f, false, true, &seen);
  back.AdvanceClock(20);
  back.Evict(12, EvictionPolicies().Add(GlobalStepEviction(4)));  // 12 - 7 > 4: evicted by its restored age
  CHECK_EQ(back.Stats().size, int64_t{0});
  // BloomFilter: counters go out in blocks; a delta carries only raised blocks.
  TableConfig c = Cfg(2, 3);
  c.bloom.capacity = 100000;
  Table<int64_t> b(c);
  auto s0 = b.BeginExport();
  b.Commit(s0->id);
  Insert(b, std::vector<int64_t>{11});
  auto s1 = b.BeginExport();
  CHECK(!s1->bloom_blocks.empty() && s1->bloom_blocks.size() <= 30);
  VecSink<int64_t> delta;
  ExportDelta(b, *s1, 0, 16, &delta);
  CHECK_EQ(delta.bloom.size(), s1->bloom_blocks.size());
  b.Abort(s1->id);  // a failed export's blocks go out with the next one
  auto s2 = b.BeginExport();
  CHECK_EQ(s2->bloom_blocks.size(), s1->bloom_blocks.size());
  b.Commit(s2->id);
  Table<int64_t> r(c);
  for (const auto& kv : delta.bloom) r.WriteBloomBlock(kv.first, kv.second.data());
  Insert(r, std::vector<int64_t>{11, 11});  // count 1 restored + 2 = 3: admitted
  CHECK_EQ(r.Stats().admitted, int64_t{1});
  VecSink<int64_t> rf;
  ExportFull(r, 0, 16, &rf);
  CHECK(!rf.bloom.empty());
}

}  // namespace


TEST_MAIN(
  RUN(test_full_export_streams_every_key_in_chunks);
  RUN(test_delta_export_holds_dirty_and_deleted_keys_only);
  RUN(test_clear_drops_an_export_in_flight);
  RUN(test_export_during_concurrent_training_sees_whole_rows);
  RUN(test_import_rows_reads_slot_major_chunks);
  RUN(test_import_filtered_demote_frees_the_row_and_untracked_erase_leaves_no_deletion);
  RUN(test_reserved_table_imports_a_full_export_in_table_order);
  RUN(test_crc32c_matches_the_standard_check_value_in_any_split);
  RUN(test_filter_state_last_seen_steps_and_bloom_blocks_are_exported);
)
