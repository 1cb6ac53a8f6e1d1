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

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_FLOAT_BITS_H_
