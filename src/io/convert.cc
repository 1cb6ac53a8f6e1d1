// CPU element transforms. Widening is exact: every bf16, f16 and fp8 value is
// a float32 value. NaN payloads are kept where the source has them (bf16,
// f16); fp8 NaNs become the canonical quiet NaN with the source's sign.
// Narrowing float32 to bf16 / f16 rounds to nearest even, as torch's
// .to(dtype) does (float_bits.h; overflow gives inf, NaN the canonical quiet
// NaN: bf16 0x7FC0, f16 sign | 0x7E00).
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "ckptfs/io.h"
#include "io/transform_internal.h"

namespace ckptfs {
namespace {

// Decodes an 8-bit float with the given exponent/mantissa widths and bias.
// fnuz: no negative zero, 0x80 is the only NaN, no infinities.
float DecodeFp8(uint8_t b, int exp_bits, int man_bits, int bias, bool fnuz) {
  const bool neg = (b & 0x80) != 0;
  const int e = (b >> man_bits) & ((1 << exp_bits) - 1);
  const int m = b & ((1 << man_bits) - 1);
  const float nan = std::copysign(std::nanf(""), neg ? -1.0f : 1.0f);
  if (fnuz) {
    if (b == 0x80) return std::nanf("");
  } else if (exp_bits == 4) {  // e4m3fn: only S.1111.111 is NaN, no infinities
    if (e == 15 && m == 7) return nan;
  } else if (e == (1 << exp_bits) - 1) {  // e5m2: IEEE-like
    if (m == 0) return neg ? -INFINITY : INFINITY;
    return nan;
  }
  float v;
  if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(static_cast<float>(m + (1 << man_bits)), e - bias - man_bits);
  }
  return neg ? -v : v;
}

using Table = std::array<float, 256>;
Table MakeTable(int exp_bits, int man_bits, int bias, bool fnuz) {
  Table t{};
  for (int i = 0; i < 256; ++i) t[i] = DecodeFp8(static_cast<uint8_t>(i), exp_bits, man_bits, bias, fnuz);
  return t;
}

const Table* Fp8TableOf(DType d) {
  static const Table e4m3fn = MakeTable(4, 3, 7, false);
  static const Table e5m2 = MakeTable(5, 2, 15, false);
  static const Table e4m3fnuz = MakeTable(4, 3, 8, true);
  static const Table e5m2fnuz = MakeTable(5, 2, 16, true);
  switch (d) {
    case DType::kF8E4M3FN:
      return &e4m3fn;
    case DType::kF8E5M2:
      return &e5m2;
    case DType::kF8E4M3FNUZ:
      return &e4m3fnuz;
    case DType::kF8E5M2FNUZ:
      return &e5m2fnuz;
    default:
      return nullptr;
  }
}

// Stores n float32 bit patterns. `dst` may sit at any byte offset of a reply
// buffer: aligned outputs take typed stores (which vectorize), others memcpy.
template <typename Bits>
void WidenLoop(char* dst, uint64_t n, Bits bits) {
  if (reinterpret_cast<uintptr_t>(dst) % alignof(uint32_t) == 0) {
    auto* out = reinterpret_cast<uint32_t*>(dst);
    for (uint64_t i = 0; i < n; ++i) out[i] = bits(i);
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t b = bits(i);
      std::memcpy(dst + 4 * i, &b, 4);
    }
  }
}

}  // namespace

const float* Fp8DecodeTable(DType d) {
  const Table* t = Fp8TableOf(d);
  return t != nullptr ? t->data() : nullptr;
}

bool CanConvert(DType from, DType to) { return Renders(from, to); }

Status ConvertRun(const char* src, DType sd, int64_t stride, char* dst, DType dd, uint64_t n) {
  const size_t ss = DTypeSize(sd);
  if (sd == dd) {
    if (stride == 1) {
      std::memcpy(dst, src, n * ss);
    } else {
      for (uint64_t i = 0; i < n; ++i)
        std::memcpy(dst + i * ss, src + static_cast<int64_t>(i) * stride * static_cast<int64_t>(ss), ss);
    }
    return Status::Ok();
  }
  if (stride == 1 && (sd == DType::kBF16 || sd == DType::kF16) && dd == DType::kF32) {
    // Contiguous runs (a widened tensor's rows): loops the compiler vectorizes
    // (this file is built with -ftree-vectorize).
    if (sd == DType::kBF16) {
      for (uint64_t i = 0; i < n; ++i)
        StoreLE<uint32_t>(dst + 4 * i, BFloat16BitsToFloatBits(LoadLE<uint16_t>(src + 2 * i)));
    } else {
      for (uint64_t i = 0; i < n; ++i)
        StoreLE<uint32_t>(dst + 4 * i, HalfBitsToFloatBits(LoadLE<uint16_t>(src + 2 * i)));
    }
    return Status::Ok();
  }
  if (stride == 1 && sd == DType::kF32 && dd == DType::kBF16) {
    for (uint64_t i = 0; i < n; ++i)
      StoreLE<uint16_t>(dst + 2 * i, FloatBitsToBFloat16Bits(LoadLE<uint32_t>(src + 4 * i)));
    return Status::Ok();
  }
  const int64_t step = stride * static_cast<int64_t>(ss);
  if (sd == DType::kF32 && NarrowsFromF32(dd)) {
    const bool bf = dd == DType::kBF16;
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t f = LoadLE<uint32_t>(src + static_cast<int64_t>(i) * step);
      const uint16_t h = bf ? FloatBitsToBFloat16Bits(f) : FloatBitsToHalfBits(f);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    return Status::Ok();
  }
  if (dd != DType::kF32)
    return Internal("no conversion from " + std::string(DTypeName(sd)) + " to " + std::string(DTypeName(dd)));
  if (sd == DType::kBF16) {
    WidenLoop(dst, n, [&](uint64_t i) {
      return BFloat16BitsToFloatBits(LoadLE<uint16_t>(src + static_cast<int64_t>(i) * step));
    });
  } else if (sd == DType::kF16) {
    WidenLoop(dst, n,
              [&](uint64_t i) { return HalfBitsToFloatBits(LoadLE<uint16_t>(src + static_cast<int64_t>(i) * step)); });
  } else if (const float* t = Fp8DecodeTable(sd)) {
    const auto* bits = reinterpret_cast<const uint32_t*>(t);
    WidenLoop(dst, n, [&](uint64_t i) { return bits[static_cast<uint8_t>(src[static_cast<int64_t>(i) * step])]; });
  } else {
    return Internal("no conversion from " + std::string(DTypeName(sd)) + " to float32");
  }
  return Status::Ok();
}

Status ScaleFloats(const char* f32, uint64_t n, double scale, double add, DType out, char* dst) {
  const uint64_t osz = DTypeSize(out);
  if (out != DType::kF32 && out != DType::kBF16 && out != DType::kF16) {
    return Internal("a scaled tensor is rendered as float32, bfloat16 or float16, not " + std::string(DTypeName(out)));
  }
  for (uint64_t i = 0; i < n; ++i) {
    double d = static_cast<double>(std::bit_cast<float>(LoadLE<uint32_t>(f32 + 4 * i))) * scale;
    if (add != 0.0) d += add;         // -0.0 + 0.0 would be +0.0: a zero offset leaves the sign alone
    float f = static_cast<float>(d);  // round to nearest even
    if (out == DType::kF32) {
      StoreLE<uint32_t>(dst + 4 * i, std::bit_cast<uint32_t>(f));
      continue;
    }
    // Rounded to odd on the way to float32 (the neighbour of d with an odd
    // last bit when inexact), then to nearest even in 16 bits: with 13 or
    // more bits to spare this is d rounded once, never twice.
    if (!std::isnan(d) && static_cast<double>(f) != d && (std::bit_cast<uint32_t>(f) & 1u) == 0) {
      f = std::isinf(f) ? std::copysign(std::numeric_limits<float>::max(), f)
                        : std::nextafter(f, d > static_cast<double>(f) ? INFINITY : -INFINITY);
    }
    const uint32_t b = std::bit_cast<uint32_t>(f);
    StoreLE<uint16_t>(dst + osz * i, out == DType::kBF16 ? FloatBitsToBFloat16Bits(b) : FloatBitsToHalfBits(b));
  }
  return Status::Ok();
}

}  // namespace ckptfs
