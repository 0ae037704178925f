// The serving view's encodings (docs/ARCHITECTURE.md, "Checkpoints", "Serving
// view"; checkpoint/serving_view.py is the Python side and the decoder): float32
// embedding rows in a lower precision, for serving replicas. No TensorFlow here.
//
// Layout (row-major, as the rows arrive from the exporter):
//   kBfloat16, kFloat16   out: n x dim uint16 (the bit patterns), no scales.
//   kInt8                 out: n x dim int8, scales: n float32.
// Encodings (bit for bit what numpy / ml_dtypes give for the same rows, which
// the Python codec decodes and tests/fleet/test_serving_view.py checks):
//   bfloat16: the top 16 bits of the float32, rounded to nearest, ties to even
//             (a NaN stays a quiet NaN of its sign).
//   float16:  IEEE binary16, rounded to nearest, ties to even, subnormals kept,
//             values past the largest half round to +-inf (numpy's
//             npy_floatbits_to_halfbits, in portable integer code).
//   int8:     per row scale = max |value| / 127 (float32), q = round-half-even
//             (value / scale) clamped to [-127, 127]; a row of zeros has scale
//             0 and q = 0 (Check-N-Run's uniform quantization). Decoded value =
//             q * scale.
// Portable C++17 only: the loops are plain integer and float code that
// compilers vectorise; there is no platform-specific path.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace evstore {
namespace view {

enum class Codec { kNone, kBfloat16, kFloat16, kInt8 };

static_assert(sizeof(float) == 4 && sizeof(uint16_t) == 2, "float32 rows and 16-bit codes");

// The codec of a view's manifest name ("" means no view); throws std::invalid_argument.
inline Codec Parse(const std::string& name) {
  if (name.empty()) return Codec::kNone;
  if (name == "bfloat16") return Codec::kBfloat16;
  if (name == "float16") return Codec::kFloat16;
  if (name == "int8") return Codec::kInt8;
  throw std::invalid_argument("serving view must be bfloat16, float16 or int8, got '" + name + "'");
}

// Bytes of one encoded element (the scales are extra for kInt8).
inline int ElementBytes(Codec c) { return c == Codec::kInt8 ? 1 : 2; }

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline uint16_t ToBfloat16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t ToFloat16(float x) {
  const uint32_t f = Bits(x);
  const uint16_t sign = static_cast<uint16_t>((f & 0x80000000u) >> 16);
  uint32_t exp = f & 0x7f800000u, sig = f & 0x007fffffu;
  if (exp >= 0x47800000u) {  // past the half range: inf, NaN or overflow
    if (exp == 0x7f800000u && sig != 0) {
      uint16_t r = static_cast<uint16_t>(0x7c00u + (sig >> 13));
      return sign | (r == 0x7c00u ? 0x7c01u : r);  // a NaN stays a NaN
    }
    return sign | 0x7c00u;
  }
  if (exp <= 0x38000000u) {  // a half subnormal or zero
    if (exp < 0x33000000u) return sign;
    exp >>= 23;
    sig = (0x00800000u + sig) >> (113 - exp);
    if ((sig & 0x3fffu) != 0x1000u || (f & 0x7ffu)) sig += 0x1000u;  // ties to even
    return sign | static_cast<uint16_t>(sig >> 13);
  }
  const uint16_t hexp = static_cast<uint16_t>((exp - 0x38000000u) >> 13);
  if ((sig & 0x3fffu) != 0x1000u) sig += 0x1000u;  // ties to even; a carry raises the exponent
  return sign | static_cast<uint16_t>(hexp + (sig >> 13));
}

// Encodes `n` rows of `dim` float32 into `out` (n * dim * ElementBytes(c)
// bytes) and, for kInt8, `scales` (n floats).
inline void EncodeRows(Codec c, const float* rows, int64_t n, int dim, void* out, float* scales) {
  const int64_t total = n * dim;
  if (c == Codec::kBfloat16 || c == Codec::kFloat16) {
    uint16_t* o = static_cast<uint16_t*>(out);
    if (c == Codec::kBfloat16) {
      for (int64_t i = 0; i < total; ++i) o[i] = ToBfloat16(rows[i]);
    } else {
      for (int64_t i = 0; i < total; ++i) o[i] = ToFloat16(rows[i]);
    }
    return;
  }
  if (c != Codec::kInt8) throw std::logic_error("EncodeRows without a view codec");
  int8_t* q = static_cast<int8_t*>(out);
  for (int64_t r = 0; r < n; ++r) {
    const float* v = rows + r * dim;
    float m = 0.f;
    for (int j = 0; j < dim; ++j) m = std::max(m, std::fabs(v[j]));
    const float scale = m / 127.f;
    scales[r] = scale;
    const float safe = scale > 0.f ? scale : 1.f;
    for (int j = 0; j < dim; ++j) {
      const float k = std::nearbyint(v[j] / safe);  // the default rounding mode: half to even
      q[r * dim + j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, k)));
    }
  }
}

}  // namespace view
}  // namespace evstore
