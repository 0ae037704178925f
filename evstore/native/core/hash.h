// Key hashing for the table. One 64-bit mix per key (the key traits' Hash,
// key_traits.h) feeds three consumers:
//   top bits     -> segment (Index::SegmentOf, index.h)
//   bits 7..38   -> home group inside the segment (fast range reduction)
//   low 7 bits   -> H2 control byte stored next to the slot (Segment)
// and a second, independent mix picks the initializer-bank row.
#pragma once
#include <cstdint>

namespace evstore {

inline uint64_t Mix64(uint64_t x) {
  // murmur3 fmix64: full avalanche, so patterned ids (multiples of 1000,
  // sequential ids) spread evenly over segments and groups.
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace evstore
