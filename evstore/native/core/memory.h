// Large allocations for the table: arena blocks and big index segments.
// Blocks of 2 MiB or more are 2 MiB aligned and advised as transparent huge
// pages (Linux, where THP is in "madvise" mode): random row and index access
// over gigabytes then misses the TLB far less, and first touch faults once per
// 2 MiB instead of once per 4 KiB. Smaller blocks are cache-line aligned.
// Row blocks are then placed by first_touch.h, which keeps them in small pages
// where huge pages are not cheap to fault.
// Everything is released with std::free. FaultIn maps a block's pages now
// (one madvise where the kernel has MADV_POPULATE_WRITE, else a write per
// page), so that later writers find them mapped.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>

namespace evstore {

inline void* AllocLarge(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  size_t align = bytes >= kHuge ? kHuge : 64;
  size_t rounded = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded ? rounded : align) != 0 || p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == kHuge) madvise(p, rounded, MADV_HUGEPAGE);
#endif
  return p;
}

inline void FaultIn(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  volatile char* c = static_cast<char*>(p);
  for (size_t off = 0; off < bytes; off += 4096) c[off] = 0;
}

}  // namespace evstore
