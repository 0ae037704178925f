// Serving rows: a serving table's rows in the serving view's precision
// (docs/guides/tiered-storage.md, "Rows in the view's precision"). No TensorFlow.
//
// A serving table (EvCreate's `serving_rows`: "float32", "bfloat16",
// "float16" or "int8") keeps each row packed into PackedFloats(codec, dim)
// 4-byte words of the table: the table and its tier (row_store.h) only copy
// rows (memcpy), so the words need not be floats. Layout of one packed row:
//   float32             dim floats, as trained
//   bfloat16, float16   dim uint16 codes (view_codec.h), two per word; an odd
//                       dim ends with a zero half word
//   int8                word 0: the row's scale (float32), then dim int8
//                       codes, four per word, zero padded
// So a DRAM cache of B bytes holds B / (4 * PackedFloats + the tier's slot
// bookkeeping) rows: at dim 64, 136 bytes a row in bfloat16 and 76 in int8
// against 264 in float32 (1.9x and 3.5x the rows).
//
// A lookup decodes exactly as checkpoint/serving_view.py's decoder does, so a
// tiered server answers bit for bit what a stock replica serving the view
// answers: bfloat16 -> its bits as a float32's top half; float16 -> IEEE
// binary16 widened (numpy's npy_halfbits_to_floatbits); int8 -> float(q) *
// scale, one float32 multiply.
//
// An all-zero packed row decodes to zeros and a row decoding to zeros packs
// to zero words except for int8's -0 scale (never written: scales are >= 0),
// so the table's zero-row count (IsZeroRow on the packed words) stays exact.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "view_codec.h"

namespace evstore {

class ServingRows {
 public:
  // `name`: "float32" or a view codec's name (view::Parse); `dim`: floats a
  // lookup returns; `default_value`: dim floats answered for a key without a row.
  ServingRows(const std::string& name, int dim, std::vector<float> default_value)
      : codec_(name == "float32" ? view::Codec::kNone : view::Parse(name)),
        name_(name),
        dim_(dim),
        default_(std::move(default_value)) {
    if (name.empty()) throw std::invalid_argument("serving rows need a precision");
    if (dim <= 0) throw std::invalid_argument("dim must be positive, got " + std::to_string(dim));
    if (static_cast<int>(default_.size()) != dim) throw std::invalid_argument("default_value must have dim elements");
  }

  // 4-byte words per packed row.
  static int PackedFloats(view::Codec c, int dim) {
    switch (c) {
      case view::Codec::kNone: return dim;
      case view::Codec::kBfloat16:
      case view::Codec::kFloat16: return (dim + 1) / 2;
      case view::Codec::kInt8: return 1 + (dim + 3) / 4;
    }
    return dim;
  }
  int packed_floats() const { return PackedFloats(codec_, dim_); }
  int dim() const { return dim_; }
  view::Codec codec() const { return codec_; }
  const std::string& name() const { return name_; }
  const std::vector<float>& default_value() const { return default_; }

  // `packed` (packed_floats words) decoded into out[0, dim).
  void Decode(const float* packed, float* out) const {
    switch (codec_) {
      case view::Codec::kNone:
        std::memcpy(out, packed, dim_ * sizeof(float));
        return;
      case view::Codec::kBfloat16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(packed);
        for (int j = 0; j < dim_; ++j) out[j] = FromBits(static_cast<uint32_t>(h[j]) << 16);
        return;
      }
      case view::Codec::kFloat16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(packed);
        for (int j = 0; j < dim_; ++j) out[j] = FromBits(HalfToFloatBits(h[j]));
        return;
      }
      case view::Codec::kInt8: {
        const float scale = packed[0];
        const int8_t* q = reinterpret_cast<const int8_t*>(packed + 1);
        for (int j = 0; j < dim_; ++j) out[j] = static_cast<float>(q[j]) * scale;
        return;
      }
    }
  }

  // Whether rows already in the codec (Pack's `codes`) are their packed
  // words byte for byte: float32, or 16-bit codes of an even dim (no pad, no
  // scale word). A caller may then store them without packing.
  bool CodesArePacked() const { return codec_ == view::Codec::kNone || (codec_ != view::Codec::kInt8 && dim_ % 2 == 0); }

  // Packs n rows already in the codec (`codes`: n x dim elements of
  // ElementBytes(codec) bytes; `scales`: n floats for int8, else unused) into
  // out (n x packed_floats words).
  void Pack(const void* codes, const float* scales, int64_t n, float* out) const {
    const int w = packed_floats();
    if (codec_ == view::Codec::kNone) {
      std::memcpy(out, codes, static_cast<size_t>(n) * dim_ * sizeof(float));
      return;
    }
    const size_t eb = view::ElementBytes(codec_), row_bytes = eb * dim_;
    const char* src = static_cast<const char*>(codes);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + i * w;
      std::memset(dst, 0, w * sizeof(float));
      if (codec_ == view::Codec::kInt8) {
        dst[0] = scales[i];
        std::memcpy(dst + 1, src + i * row_bytes, row_bytes);
      } else {
        std::memcpy(dst, src + i * row_bytes, row_bytes);
      }
    }
  }

  // Encodes n float32 rows (dim each) as the view does (view_codec.h, bit for
  // bit the trainer's) and packs them into out (n x packed_floats words).
  void Encode(const float* rows, int64_t n, float* out) const {
    if (codec_ == view::Codec::kNone) {
      Pack(rows, nullptr, n, out);
      return;
    }
    thread_local std::vector<char> codes;
    thread_local std::vector<float> scales;
    codes.resize(static_cast<size_t>(n) * dim_ * view::ElementBytes(codec_));
    scales.resize(n);
    view::EncodeRows(codec_, rows, n, dim_, codes.data(), scales.data());
    Pack(codes.data(), scales.data(), n, out);
  }

 private:
  static float FromBits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  // IEEE binary16 -> binary32 bits, exact (numpy's npy_halfbits_to_floatbits).
  static uint32_t HalfToFloatBits(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = h & 0x7c00u;
    if (exp == 0) {  // zero or subnormal
      uint32_t sig = h & 0x03ffu;
      if (sig == 0) return sign;
      sig <<= 1;
      while ((sig & 0x0400u) == 0) {
        sig <<= 1;
        ++exp;
      }
      return sign + ((127u - 15u - exp) << 23) + ((sig & 0x03ffu) << 13);
    }
    if (exp == 0x7c00u) return sign + 0x7f800000u + (static_cast<uint32_t>(h & 0x03ffu) << 13);  // inf, NaN
    return sign + ((static_cast<uint32_t>(h & 0x7fffu) + 0x1c000u) << 13);
  }

  view::Codec codec_;
  std::string name_;
  int dim_;
  std::vector<float> default_;
};

static_assert(sizeof(float) == 4 && sizeof(int8_t) == 1, "packed rows are 4-byte words");

}  // namespace evstore
