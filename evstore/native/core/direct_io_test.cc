// Direct I/O (direct_io.h, direct_reader.h, direct_writer.h): bytes read and
// written around the page cache are exactly the file's, aligned or not, at the
// file's end, from several threads; refused direct I/O leaves the caller to
// the page cache. Files live in a directory made in the working directory (a
// disk, where O_DIRECT is taken; /tmp may be a tmpfs, which refused it before
// Linux 6.6).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "direct_io.h"
#include "direct_reader.h"
#include "direct_writer.h"
#include "test_check.h"

using namespace evstore;

namespace {

std::string g_dir;

char Byte(int64_t i) { return static_cast<char>((i * 131 + (i >> 12) * 7) & 0xff); }

// A file of `n` pattern bytes (Byte(i) at offset i), written through the page cache.
std::string PatternFile(const char* name, int64_t n) {
  const std::string path = g_dir + "/" + name;
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  std::vector<char> b(n);
  for (int64_t i = 0; i < n; ++i) b[i] = Byte(i);
  CHECK_EQ(::write(fd, b.data(), n), static_cast<ssize_t>(n));
  CHECK_EQ(::fsync(fd), 0);
  ::close(fd);
  return path;
}

bool SameAsPattern(const char* p, int64_t offset, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != Byte(offset + i)) return false;
  return true;
}

void test_an_aligned_buffer_starts_and_ends_on_a_block() {
  AlignedBuffer<float> b(1000);  // 4,000 bytes: one block
  CHECK(IsDirectAligned(b.data()));
  CHECK_EQ(RoundUpToDirect(4000), kDirectAlign);
  CHECK_EQ(RoundUpToDirect(4097), 2 * kDirectAlign);
  CHECK(AlignedBuffer<char>().data() == nullptr);
}

void test_aligned_reads_take_whole_blocks_and_leave_the_rest_to_the_cache() {
  const int64_t size = 3 * kDirectAlign + 100;
  const std::string path = PatternFile("read", size);
  DirectReader r(path);
  std::printf("  direct reads in %s: %s\n", g_dir.c_str(), r.direct() ? "taken" : "refused by the file system");
  AlignedBuffer<char> buf(4 * kDirectAlign);
  // The whole file asked for: its whole blocks read direct, the 100-byte tail left over.
  const int64_t got = r.Read(0, buf.data(), size);
  if (r.direct()) {
    CHECK_EQ(got, 3 * kDirectAlign);
    CHECK(SameAsPattern(buf.data(), 0, got));
    // A request past the end of the file stops there.
    const int64_t tail = r.Read(3 * kDirectAlign, buf.data(), kDirectAlign);
    CHECK_EQ(tail, int64_t{100});
    CHECK(SameAsPattern(buf.data(), 3 * kDirectAlign, tail));
    CHECK(r.Takes(kDirectAlign) && !r.Takes(kDirectAlign + 1));
  } else {
    CHECK_EQ(got, int64_t{0});
  }
  // Unaligned offsets or buffers, or less than a block: nothing read direct.
  CHECK_EQ(r.Read(1, buf.data(), 2 * kDirectAlign), int64_t{0});
  CHECK_EQ(r.Read(0, buf.data() + 1, 2 * kDirectAlign), int64_t{0});
  CHECK_EQ(r.Read(0, buf.data(), kDirectAlign - 1), int64_t{0});
}

void test_a_file_not_opened_direct_leaves_every_read_and_write_to_the_cache() {
  DirectReader r(g_dir + "/no-such-file");
  AlignedBuffer<char> buf(kDirectAlign);
  CHECK(!r.direct() && !r.Takes(0));
  CHECK_EQ(r.Read(0, buf.data(), kDirectAlign), int64_t{0});
  const int fd = ::open((g_dir + "/refused").c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  DirectWriter w(g_dir + "/no-such-dir/refused", fd);
  CHECK(!w.direct());
  ::close(fd);
}

void test_concurrent_reads_through_one_reader_each_get_their_own_blocks() {
  const int64_t blocks = 64;
  const std::string path = PatternFile("concurrent", blocks * kDirectAlign);
  DirectReader r(path);
  std::vector<std::thread> ts;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      AlignedBuffer<char> buf(2 * kDirectAlign);
      bool all = true;
      for (int64_t b = t; b + 1 < blocks; b += 4) {
        int64_t got = r.Read(b * kDirectAlign, buf.data(), 2 * kDirectAlign);
        if (got < 0) all = false;
        for (int64_t more; got >= 0 && got < 2 * kDirectAlign; got += more) {  // the rest through the cache
          const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
          more = ::pread(fd, buf.data() + got, 2 * kDirectAlign - got, b * kDirectAlign + got);
          ::close(fd);
          if (more <= 0) break;
        }
        all = all && SameAsPattern(buf.data(), b * kDirectAlign, 2 * kDirectAlign);
      }
      ok[t] = all;
    });
  }
  for (auto& t : ts) t.join();
  for (int t = 0; t < 4; ++t) CHECK(ok[t]);
}

// Writes `n` pattern bytes through a DirectWriter as OutFile does (full
// buffers submitted front to back, the tail at Finish); returns the file.
std::string WriteThroughWriter(const char* name, int64_t n, bool* direct) {
  const std::string path = g_dir + "/" + name;
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  CHECK(fd >= 0);
  {
    DirectWriter w(path, fd);
    *direct = w.direct();
    if (!w.direct()) {  // the file system refuses: the caller writes through the cache
      std::vector<char> b(n);
      for (int64_t i = 0; i < n; ++i) b[i] = Byte(i);
      CHECK_EQ(::write(fd, b.data(), n), static_cast<ssize_t>(n));
    } else {
      int64_t at = 0;
      size_t used = 0;
      for (int64_t i = 0; i < n; ++i) {
        w.buffer()[used++] = Byte(i);  // fills one buffer while the other one's write runs
        if (used == w.capacity()) {
          CHECK_EQ(w.Submit(at), 0);
          at += static_cast<int64_t>(used);
          used = 0;
        }
      }
      CHECK_EQ(w.Finish(used, at), 0);
    }
  }
  CHECK_EQ(::fsync(fd), 0);
  ::close(fd);
  return path;
}

void test_written_buffers_and_the_tail_make_exactly_the_bytes_written() {
  const int64_t n = 3 * static_cast<int64_t>(DirectWriter::kBufferBytes) + 12345;
  bool direct = false;
  const std::string path = WriteThroughWriter("write", n, &direct);
  std::printf("  direct writes in %s: %s\n", g_dir.c_str(), direct ? "taken" : "refused by the file system");
  struct stat st;
  CHECK_EQ(::stat(path.c_str(), &st), 0);
  CHECK_EQ(static_cast<int64_t>(st.st_size), n);
  std::vector<char> back(n);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK_EQ(::pread(fd, back.data(), n, 0), static_cast<ssize_t>(n));
  ::close(fd);
  CHECK(SameAsPattern(back.data(), 0, n));
}

void test_a_write_of_whole_buffers_only_has_an_empty_tail() {
  const int64_t n = 2 * static_cast<int64_t>(DirectWriter::kBufferBytes);
  bool direct = false;
  const std::string path = WriteThroughWriter("whole", n, &direct);
  struct stat st;
  CHECK_EQ(::stat(path.c_str(), &st), 0);
  CHECK_EQ(static_cast<int64_t>(st.st_size), n);
}

}  // namespace

// In the working directory (the build tree, on a disk): O_DIRECT is refused on a tmpfs.
TEST_MAIN(const ScratchDir dir("evstore-direct-io-test-"); g_dir = dir.path();
          RUN(test_an_aligned_buffer_starts_and_ends_on_a_block);
          RUN(test_aligned_reads_take_whole_blocks_and_leave_the_rest_to_the_cache);
          RUN(test_a_file_not_opened_direct_leaves_every_read_and_write_to_the_cache);
          RUN(test_concurrent_reads_through_one_reader_each_get_their_own_blocks);
          RUN(test_written_buffers_and_the_tail_make_exactly_the_bytes_written);
          RUN(test_a_write_of_whole_buffers_only_has_an_empty_tail);)
