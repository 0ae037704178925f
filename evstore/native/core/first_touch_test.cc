// TF-free tests of core/first_touch.h (how new row memory is first touched:
// huge pages where cheap, small pages where not). Driven by
// tests/native/CMakeLists.txt (make test-native). No timing: each placement's
// probe cost is given, and what is checked is the policy's outcome (pages
// mapped, the huge-page advice on the block, the rows' contents).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "first_touch.h"
#include "table.h"
#include "test_check.h"

using namespace evstore;

namespace {

constexpr size_t kHuge = size_t{2} << 20;

// Pages of [p, p + bytes) mapped now (mincore).
size_t MappedPages(void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((bytes + page - 1) / page);
  CHECK(mincore(p, bytes, v.data()) == 0);
  size_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

// The VmFlags of the mapping holding address `a` (/proc/self/smaps).
std::string VmFlagsAt(const void* a) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  const uintptr_t x = reinterpret_cast<uintptr_t>(a);
  while (std::getline(f, line)) {
    unsigned long lo, hi;
    char dash;
    std::istringstream head(line);
    if (line.find(':') > line.find(' ') && (head >> std::hex >> lo >> dash >> hi) && dash == '-') {
      in = lo <= x && x < hi;
      continue;
    }
    if (in && line.rfind("VmFlags:", 0) == 0) return line + " ";
  }
  return "";
}

void test_a_costly_probe_sends_the_next_blocks_to_small_pages_then_probes_again() {
  HugePageGate gate;
  const size_t block = 16 * kHuge;
  CHECK(gate.ShouldProbe(block));
  CHECK(gate.Record(HugePageGate::kCheapNs));  // at the bound: still cheap
  CHECK(gate.ShouldProbe(block));
  CHECK(!gate.Record(HugePageGate::kCheapNs + 1));
  CHECK_EQ(gate.costly_probes(), int64_t{1});
  for (int64_t placed = 0; placed < HugePageGate::kSmallAfterCostly; placed += block)
    CHECK(!gate.ShouldProbe(block));
  CHECK_EQ(gate.bytes_before_probe(), int64_t{0});
  CHECK(gate.ShouldProbe(block));
}

void test_a_block_after_a_costly_probe_is_small_pages_all_mapped_and_advised_huge() {
  const size_t bytes = 4 * kHuge;
  for (bool all : {false, true}) {
    HugePageGate gate;
    void* p = AllocLarge(bytes);
    CHECK(PlaceRows(p, bytes, all, gate, HugePageGate::kCheapNs + 1) == Pages::kSmall);
    CHECK_EQ(MappedPages(p, bytes), bytes / static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    for (size_t off : {size_t{0}, bytes - 1}) {
      const std::string flags = VmFlagsAt(static_cast<char*>(p) + off);
      CHECK(flags.find(" hg ") != std::string::npos);  // khugepaged may collapse it later
      CHECK(flags.find(" nh ") == std::string::npos);
    }
    // The next block goes to small pages without a probe, mapped in full too.
    void* q = AllocLarge(bytes);
    CHECK(PlaceRows(q, bytes, false, gate, 0) == Pages::kSmall);
    CHECK_EQ(MappedPages(q, bytes), bytes / static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    std::free(p);
    std::free(q);
  }
}

void test_a_block_after_a_cheap_probe_stays_huge_with_its_probe_mapped() {
  const size_t bytes = 4 * kHuge;
  const size_t pages = bytes / static_cast<size_t>(sysconf(_SC_PAGESIZE));
  HugePageGate gate;
  void* p = AllocLarge(bytes);
  CHECK(PlaceRows(p, bytes, false, gate, 0) == Pages::kHuge);
  CHECK(MappedPages(p, kHuge) == kHuge / static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  CHECK(VmFlagsAt(static_cast<char*>(p) + bytes - 1).find(" hg ") != std::string::npos);
  void* q = AllocLarge(bytes);
  CHECK(PlaceRows(q, bytes, true, gate, 0) == Pages::kHuge);
  CHECK_EQ(MappedPages(q, bytes), pages);
  std::free(p);
  std::free(q);
}

void test_rows_in_small_page_blocks_read_back_exactly() {
  // Every block of this table lands in small pages (the process's gate
  // made to find huge pages costly before each block).
  TableConfig c;
  c.dim = 16;
  for (int i = 0; i < 4 * c.dim; ++i) c.bank.push_back(0.25f * static_cast<float>(i % 13));
  Table<int64_t> t(c);
  const int64_t n = 300000, batch = 50000;
  std::vector<int64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = i * 7919 + 11;
  std::vector<float> out(static_cast<size_t>(batch) * c.dim);
  HugePageGate& gate = HugePageGate::Process();
  int64_t small_bytes = 0;
  for (int64_t s = 0; s < n; s += batch) {
    gate.Record(HugePageGate::kCheapNs + 1);
    t.FindOrInsert(keys.data() + s, batch, out.data(), SerialFor);
    small_bytes += HugePageGate::kSmallAfterCostly - gate.bytes_before_probe();
  }
  // 300,000 rows: block 8 (2 MiB) and four blocks of 65,536 rows (4 MiB) placed by the gate.
  CHECK_EQ(small_bytes, int64_t{18} << 20);
  for (int64_t s = 0; s < n; s += batch) {
    std::fill(out.begin(), out.end(), -1.f);
    t.Find(keys.data() + s, batch, out.data(), SerialFor);
    for (int64_t i = 0; i < batch; ++i) {
      const float* r = out.data() + i * c.dim;
      bool is_bank_row = false;
      for (int b = 0; b < 4 && !is_bank_row; ++b)
        is_bank_row = std::memcmp(r, c.bank.data() + b * c.dim, c.dim * sizeof(float)) == 0;
      CHECK(is_bank_row);
    }
  }
}

}  // namespace

TEST_MAIN(
  RUN(test_a_costly_probe_sends_the_next_blocks_to_small_pages_then_probes_again);
  RUN(test_a_block_after_a_costly_probe_is_small_pages_all_mapped_and_advised_huge);
  RUN(test_a_block_after_a_cheap_probe_stays_huge_with_its_probe_mapped);
  RUN(test_rows_in_small_page_blocks_read_back_exactly);
)
