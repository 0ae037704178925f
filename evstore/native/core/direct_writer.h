// DirectWriter: a file written front to back around the page cache, in whole
// aligned buffers, each by a thread of its own while the next one fills. No
// TensorFlow.
//
// A full save writes each byte once and nobody reads it back soon, so the
// page cache only costs the kernel's copy of every byte and its delayed
// allocation (the largest part of a 10M-key tiered save's CPU).
//
// Layout: two AlignedBuffers of kBufferBytes (direct_io.h). The caller fills
// buffer() to capacity() bytes and Submit()s it with its file offset: a
// thread (std::async) writes it with the O_DIRECT descriptor while buffer()
// is now the other one. At most one write is in flight; Submit and Wait
// first wait for it. Finish waits, then writes the tail (less than a buffer)
// with the caller's own descriptor, through the page cache: the caller's
// fsync makes all of it durable.
//
// Invariants: every direct write starts at a multiple of kBufferBytes (the
// caller submits full buffers, front to back) from an aligned buffer, and is
// a whole number of kDirectAlign blocks. A buffer is never written to while
// its write is in flight (the caller fills only buffer(), the other one).
// A device that answers EINVAL (a block coarser than kDirectAlign) gets that
// buffer, and the later ones, through the page cache. The destructor waits
// for a write in flight (it reads a buffer this object owns).
#pragma once
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <future>
#include <string>

#include "direct_io.h"

namespace evstore {

class DirectWriter {
 public:
  static constexpr size_t kBufferBytes = 1 << 20;
  static_assert(kBufferBytes % kDirectAlign == 0, "a full buffer is whole blocks");

  // `path`, already created and opened for cached writes as `fd` (kept open
  // by the caller), opened again O_DIRECT. direct() is false where the file
  // system refuses it; then nothing is allocated and nothing else may be called.
  DirectWriter(const std::string& path, int fd) : fd_(fd), direct_fd_(OpenDirect(path, O_WRONLY)) {
    if (direct_fd_ < 0) return;
    for (auto& b : bufs_) b = AlignedBuffer<char>(kBufferBytes);
  }
  ~DirectWriter() {
    if (inflight_.valid()) inflight_.wait();
    if (direct_fd_ >= 0) ::close(direct_fd_);
  }
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;

  bool direct() const { return direct_fd_ >= 0; }
  char* buffer() const { return bufs_[filling_].data(); }
  static constexpr size_t capacity() { return kBufferBytes; }

  // Writes the full buffer() at offset `at` (a multiple of kBufferBytes) by a
  // thread; buffer() is then the other one. 0, or the errno of the previous
  // write, which failed (this buffer is then not written).
  int Submit(int64_t at) {
    if (const int err = Wait()) return err;
    const int dfd = direct_fd_, fd = fd_;
    const char* p = buffer();
    inflight_ = std::async(std::launch::async, [this, dfd, fd, p, at] {
      for (size_t off = 0; off < kBufferBytes;) {
        const bool direct = !cached_;
        const ssize_t w = ::pwrite(direct ? dfd : fd, p + off, kBufferBytes - off, at + static_cast<int64_t>(off));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EINVAL && direct) {  // the device's block is coarser: through the cache
          cached_ = true;
          continue;
        }
        if (w < 0) return errno;
        off += static_cast<size_t>(w);
      }
      return 0;
    });
    filling_ ^= 1;
    return 0;
  }
  // Waits for the write in flight: 0, or its errno.
  int Wait() {
    if (!inflight_.valid()) return 0;
    return inflight_.get();
  }
  // Waits, then writes buffer()[0, n) (n < kBufferBytes) at `at` through the
  // page cache, and closes the direct descriptor: 0, or the errno of a write
  // that failed.
  int Finish(size_t n, int64_t at) {
    int err = Wait();
    for (size_t off = 0; err == 0 && off < n;) {
      const ssize_t w = ::pwrite(fd_, buffer() + off, n - off, at + static_cast<int64_t>(off));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) err = errno;
      else off += static_cast<size_t>(w);
    }
    if (direct_fd_ >= 0) ::close(direct_fd_);
    direct_fd_ = -1;
    return err;
  }

 private:
  const int fd_;
  int direct_fd_;
  AlignedBuffer<char> bufs_[2];
  int filling_ = 0;               // which of bufs_ the caller fills
  bool cached_ = false;           // the device refused direct writes: the cache (written by the write thread only)
  std::future<int> inflight_;     // the other buffer's write: 0 or its errno (last: destroyed first)
};

}  // namespace evstore
