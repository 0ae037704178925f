// Large allocations for the table: arena blocks and big index segments.
// Blocks of 2 MiB or more are 2 MiB aligned and advised as transparent huge
// pages (Linux, where THP is in "madvise" mode): random row and index access
// over gigabytes then misses the TLB far less, and first touch faults once per
// 2 MiB instead of once per 4 KiB. Smaller blocks are cache-line aligned.
// AllocLarge(bytes, false) leaves the advice for later (AdviseHuge): the
// block reserve maps base pages first (block_reserve.h).
// Everything is released with std::free. FaultIn maps a block's pages now
// (one madvise where the kernel has MADV_POPULATE_WRITE, else a write per
// page), so that later writers find them mapped.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace evstore {

inline constexpr size_t kHugePage = size_t{2} << 20;

// Advises [p, p + bytes) as transparent huge pages where p is 2 MiB aligned
// (an AllocLarge block of 2 MiB or more).
inline void AdviseHuge(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (bytes >= kHugePage && reinterpret_cast<uintptr_t>(p) % kHugePage == 0)
    madvise(p, (bytes + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// advise = false: aligned as above, but not advised yet (AdviseHuge later).
inline void* AllocLarge(size_t bytes, bool advise = true) {
  size_t align = bytes >= kHugePage ? kHugePage : 64;
  size_t rounded = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded ? rounded : align) != 0 || p == nullptr) throw std::bad_alloc();
  if (advise) AdviseHuge(p, bytes);
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
