// crc32c (Castagnoli), the checksum of TensorFlow's tensor bundles and of our
// manifests. Crc32cExtend(crc, p, n) continues a finished crc32c over n more
// bytes (the contract of tsl::crc32c::Extend; Crc32cExtend(0, p, n) is the
// crc32c of p). With SSE4.2 (checked once at run time) it runs the crc32
// instruction over 8 bytes at a time (~8 bytes per 3 cycles); otherwise a
// byte table. TensorFlow's pip build runs a portable version without the
// crc32 instruction, and the checksum is a large part of a checkpoint save's
// CPU (BENCHMARKS.md, Checkpoints).
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace evstore {
namespace crc32c_internal {

struct ByteTable {
  uint32_t t[256];
  ByteTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};

// Raw (not inverted) update.
inline uint32_t Software(uint32_t c, const uint8_t* p, size_t n) {
  static const ByteTable table;
  for (size_t i = 0; i < n; ++i) c = table.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t Hardware(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  for (; n; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

inline bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace crc32c_internal

inline uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (crc32c_internal::HaveSse42()) return ~crc32c_internal::Hardware(c, p, n);
#endif
  return ~crc32c_internal::Software(c, p, n);
}

// crc32c and size of the whole file at `path`, read through the caller's
// buffer of n bytes (not cleared: callers checking many files allocate it
// once). err is 0, or the errno of the failed open (opened false) or read.
struct FileCrc32c {
  uint32_t crc = 0;
  int64_t size = 0;
  int err = 0;
  bool opened = false;
};

inline FileCrc32c Crc32cOfFile(const char* path, char* buf, size_t n) {
  FileCrc32c f;
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    f.err = errno;
    return f;
  }
  f.opened = true;
  ssize_t r;
  while ((r = ::read(fd, buf, n)) != 0) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      f.err = errno;
      break;
    }
    f.crc = Crc32cExtend(f.crc, buf, static_cast<size_t>(r));
    f.size += r;
  }
  ::close(fd);
  return f;
}

}  // namespace evstore
