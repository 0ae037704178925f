// DirectReader: positioned reads of one file around the page cache. No
// TensorFlow.
//
// A restore reads each byte of a checkpoint once, so caching it only costs the
// kernel's copy of every byte (the largest part of a 10M-key tiered restore's
// CPU) and evicts pages that are read again, the tier's among them. Read takes
// the whole kDirectAlign blocks of a request whose offset and buffer are
// aligned (direct_io.h) straight from the disk into the buffer, and leaves
// the rest (an unaligned request, the tail under a block, a file system or
// device that refuses direct I/O) to the caller's read through the page
// cache. The kernel keeps the two coherent.
//
// Layout: one O_DIRECT descriptor of the file (-1: refused), opened by the
// constructor and closed by the destructor, beside the caller's own
// descriptor for cached reads.
// Invariants: Read never reads past the file's end (a short direct read ends
// it); once a device answers EINVAL (its block is coarser than kDirectAlign)
// no later Read goes direct. Read may be called from several threads at once:
// the descriptor is closed only by the destructor.
#pragma once
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <string>

#include "direct_io.h"

namespace evstore {

class DirectReader {
 public:
  explicit DirectReader(const std::string& path) : fd_(OpenDirect(path, O_RDONLY)), usable_(fd_ >= 0) {}
  ~DirectReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  DirectReader(const DirectReader&) = delete;
  DirectReader& operator=(const DirectReader&) = delete;

  // Whether reads at aligned offsets into aligned buffers go around the page cache.
  bool direct() const { return usable_.load(std::memory_order_relaxed); }
  // Whether a Read at `offset` (into an aligned buffer) would go direct, so a
  // read-ahead of the page cache there would be wasted.
  bool Takes(int64_t offset) const { return direct() && IsDirectAligned(offset); }

  // The whole blocks of [offset, offset + n) read into p when offset and p are
  // aligned: the bytes read (0: none, read them through the page cache; fewer
  // than the whole blocks only at the file's end, or where the device refused
  // direct reads part way). -1 with errno set: the disk failed the read.
  int64_t Read(int64_t offset, char* p, int64_t n) const {
    if (!direct() || !IsDirectAligned(offset) || !IsDirectAligned(p)) return 0;
    const int64_t whole = n - n % kDirectAlign;
    int64_t done = 0;
    while (done < whole) {
      const ssize_t r = ::pread(fd_, p + done, whole - done, offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno == EINVAL) {  // the device's block is coarser: the page cache from here on
        usable_.store(false, std::memory_order_relaxed);
        break;
      }
      if (r < 0) return -1;
      done += r;
      if (r == 0 || r % kDirectAlign != 0) break;  // the end of the file: the rest (none) through the cache
    }
    return done;
  }

 private:
  const int fd_;
  mutable std::atomic<bool> usable_;
};

}  // namespace evstore
