// Bit-exact float conversions shared by host and device code: the CPU and the
// CUDA transforms call the same function, so their bytes cannot differ.
#ifndef CKPTFS_COMMON_FLOAT_BITS_H_
#define CKPTFS_COMMON_FLOAT_BITS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define CKPTFS_HD __host__ __device__
#else
#define CKPTFS_HD
#endif

namespace ckptfs {

// IEEE binary16 -> binary32 bits (exact; NaN payloads kept).
CKPTFS_HD inline uint32_t HalfBitsToFloatBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  if (exp == 0x1F) return sign | 0x7F800000 | (man << 13);
  if (exp != 0) return sign | ((exp + 112) << 23) | (man << 13);
  if (man == 0) return sign;
  int e = -1;  // subnormal: normalise
  do {
    ++e;
    man <<= 1;
  } while ((man & 0x400) == 0);
  return sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
}

// bfloat16 -> binary32 bits: the upper half of a float32.
CKPTFS_HD inline uint32_t BFloat16BitsToFloatBits(uint16_t b) { return static_cast<uint32_t>(b) << 16; }

// binary32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's
// scalar rule, which torch's elementwise bf16 ops apply after each op).
CKPTFS_HD inline uint16_t FloatBitsToBFloat16Bits(uint32_t f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((f + (((f >> 16) & 1u) + 0x7FFFu)) >> 16);
}

// binary32 -> IEEE binary16, round to nearest even (overflow to inf,
// subnormals rounded); NaN -> sign | 0x7E00 (c10's fp16_ieee_from_fp32_value).
CKPTFS_HD inline uint16_t FloatBitsToHalfBits(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a < 0x38800000u) {                                               // below 2^-14: subnormal or zero
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);           // below 2^-25
    const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value / 2^-24 = m * 2^(e-126)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t h = (a >> 13) - (112u << 10);  // rebias the exponent 127 -> 15
  const uint32_t rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right (and gives inf)
  return static_cast<uint16_t>(sign | h);
}

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_FLOAT_BITS_H_
