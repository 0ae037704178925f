// The string key hash: FarmHash's Fingerprint64 (Geoff Pike, Google).
//
// Why this one: it is the hash TensorFlow itself defines for strings
// (tf.fingerprint, tf.strings.to_hash_bucket_fast, Fingerprint64 in
// tensorflow/core/platform/fingerprint.h), with a documented promise that its
// values never change across releases or platforms. So a string key's hash
// (its sharded-EV route, docs/ARCHITECTURE.md) can be computed by any client
// with `tf.fingerprint`, and golden values pin it. It is fast on short keys
// (one 64-bit multiply chain per 8 bytes) and avalanches fully.
//
// Where it comes from: TensorFlow's own include dir ships FarmHash as a
// header-only file (external/farmhash_gpu_archive/src/farmhash_gpu.h, the
// same algorithm written for host and device). The op library already
// compiles against that dir, so no new dependency and no hand-written hash.
// The header is meant for nvcc: its host+device marker macros are defined
// empty for the include only.
#pragma once
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include <string.h>

// The header defines its functions without `inline`; inside an unnamed
// namespace they get internal linkage, so every translation unit may include
// it (its only own includes, <cstdint> and <string.h>, are included above).
#pragma push_macro("__device__")
#pragma push_macro("__host__")
#define __device__
#define __host__
namespace evstore {
namespace farmhash_internal {
namespace {
#include "external/farmhash_gpu_archive/src/farmhash_gpu.h"
}  // namespace
}  // namespace farmhash_internal
}  // namespace evstore
#pragma pop_macro("__host__")
#pragma pop_macro("__device__")

namespace evstore {

// FarmHash Fingerprint64 of the bytes: equals tf.fingerprint(s) read as a
// little-endian uint64 (golden values: tests/native, tests/evstore/test_string_keys.py).
inline uint64_t StringFingerprint64(std::string_view s) { return farmhash_internal::util_gpu::Fingerprint64(s.data(), s.size()); }

}  // namespace evstore
