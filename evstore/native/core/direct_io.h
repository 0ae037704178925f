// Direct I/O: what DirectReader (direct_reader.h) and DirectWriter
// (direct_writer.h) share. No TensorFlow.
//
// A file opened O_DIRECT moves bytes between the disk and the caller's buffer
// without the page cache: no kernel copy of every byte, no cached pages that
// push out pages read again (a tier's). Linux takes such a transfer only when
// the file offset, the buffer address and the length are all multiples of the
// device's logical block size.
//
// Invariants:
//  * kDirectAlign (4096) is a multiple of every common logical block size
//    (512, 4096), so a transfer aligned to it is aligned for those devices.
//    A device with a coarser block answers EINVAL: the caller then goes
//    through the page cache from there on (correct, only slower).
//  * A file system without O_DIRECT (tmpfs before Linux 6.6) refuses the
//    open: OpenDirect returns -1 and the caller uses the page cache only.
//  * The kernel keeps direct and cached transfers of one file coherent, so a
//    file may be read (or written) partly each way.
//  * AlignedBuffer's storage starts at a multiple of kDirectAlign and spans a
//    whole number of kDirectAlign blocks (its size rounded up).
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

namespace evstore {

inline constexpr int64_t kDirectAlign = 4096;
static_assert((kDirectAlign & (kDirectAlign - 1)) == 0, "the alignment is a power of two");
static_assert(kDirectAlign % 512 == 0, "a multiple of the smallest logical block size");

inline constexpr bool IsDirectAligned(int64_t v) { return v % kDirectAlign == 0; }
inline bool IsDirectAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0; }
// `bytes` rounded up to whole kDirectAlign blocks.
inline constexpr int64_t RoundUpToDirect(int64_t bytes) { return (bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign; }
static_assert(RoundUpToDirect(1) == kDirectAlign && RoundUpToDirect(kDirectAlign) == kDirectAlign, "round up");

// `path` opened with O_DIRECT and `flags` (O_CLOEXEC added): the descriptor,
// or -1 where the file system refuses direct I/O (or the open fails: the
// caller's own open of the file reports that).
inline int OpenDirect(const std::string& path, int flags) {
  return ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC);
}

// n elements of T, aligned for direct I/O (see the invariants), not zeroed.
// Throws std::bad_alloc.
template <typename T>
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n = 0) {
    if (n == 0) return;
    const size_t bytes = static_cast<size_t>(RoundUpToDirect(static_cast<int64_t>(n * sizeof(T))));
    p_.reset(static_cast<T*>(std::aligned_alloc(kDirectAlign, bytes)));
    if (!p_) throw std::bad_alloc();
  }
  T* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
};

}  // namespace evstore
