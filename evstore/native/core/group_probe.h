// Group probe: the index's 16-wide control-byte compare, in two builds.
//
// A segment (segment.h) keeps one control byte per slot, in groups of
// kGroupWidth = 16 slots:
//     kEmpty   = 0x80  1000'0000   never used since the last rehash
//     kDeleted = 0xFE  1111'1110   tombstone
//     full     = 0x00..0x7F        the low 7 bits of the key's hash (H2)
// Every probe question is a 16-bit mask over one group (bit i = slot i):
//     Match(h2)            slots whose control byte equals h2 (full, same tag)
//     MatchEmpty()         slots that are kEmpty
//     MatchEmptyOrDeleted  slots with the top bit set (free for an insert)
// Both implementations answer exactly (no false positives), so callers need
// not know which one they got:
//   SSE2      one 16-byte load, _mm_cmpeq_epi8 + _mm_movemask_epi8 (x86-64).
//   portable  a byte loop the compiler may vectorise (aarch64, or any build
//             with EVSTORE_PORTABLE_PROBE defined: the C++ test binary is
//             built and run in both modes, tests/native/CMakeLists.txt (make test-native)).
// Control arrays are 16-byte aligned (segment.h allocates them so).
#pragma once
#include <cstdint>

#if defined(__SSE2__) && !defined(EVSTORE_PORTABLE_PROBE)
#define EVSTORE_PROBE_SSE2 1
#include <emmintrin.h>
#else
#define EVSTORE_PROBE_SSE2 0
#endif

namespace evstore {

inline constexpr int kGroupWidth = 16;
inline constexpr uint8_t kCtrlEmpty = 0x80;
inline constexpr uint8_t kCtrlDeleted = 0xFE;
// The encodings the masks rely on: free slots have the top bit set, full
// ones do not, and an H2 tag never collides with a marker.
static_assert((kCtrlEmpty & 0x80) && (kCtrlDeleted & 0x80), "free slots have the top bit set");
static_assert(kCtrlEmpty != kCtrlDeleted, "empty and deleted differ");
static_assert((0x7F & 0x80) == 0, "a full slot's H2 tag (7 bits) has the top bit clear");

inline constexpr const char* kProbeImpl = EVSTORE_PROBE_SSE2 ? "sse2" : "portable";

#if EVSTORE_PROBE_SSE2
class GroupProbe {
 public:
  explicit GroupProbe(const uint8_t* ctrl) : c_(_mm_load_si128(reinterpret_cast<const __m128i*>(ctrl))) {}
  uint32_t Match(uint8_t h2) const { return Eq(static_cast<char>(h2)); }
  uint32_t MatchEmpty() const { return Eq(static_cast<char>(kCtrlEmpty)); }
  uint32_t MatchEmptyOrDeleted() const { return static_cast<uint32_t>(_mm_movemask_epi8(c_)); }

 private:
  uint32_t Eq(char b) const {
    return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(c_, _mm_set1_epi8(b))));
  }
  __m128i c_;
};
#else
class GroupProbe {
 public:
  explicit GroupProbe(const uint8_t* ctrl) : c_(ctrl) {}
  uint32_t Match(uint8_t h2) const { return Eq(h2); }
  uint32_t MatchEmpty() const { return Eq(kCtrlEmpty); }
  uint32_t MatchEmptyOrDeleted() const {
    uint32_t m = 0;
    for (int i = 0; i < kGroupWidth; ++i) m |= static_cast<uint32_t>(c_[i] >> 7) << i;
    return m;
  }

 private:
  uint32_t Eq(uint8_t b) const {
    uint32_t m = 0;
    for (int i = 0; i < kGroupWidth; ++i) m |= static_cast<uint32_t>(c_[i] == b) << i;
    return m;
  }
  const uint8_t* c_;
};
#endif

// Prefetch for reading into all cache levels. x86: inline asm, because GCC 12
// deletes a __builtin_prefetch whose address depends on an SSE compare
// (checked with objdump); elsewhere the builtin.
inline void PrefetchT0(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

}  // namespace evstore
