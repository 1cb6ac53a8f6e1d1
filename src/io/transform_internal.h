// Pieces the CPU and CUDA transforms share, so that both compute the same
// bytes by construction: the fp8 decode tables, op validation and the CRC-32C
// combination arithmetic (host and device).
#ifndef CKPTFS_IO_TRANSFORM_INTERNAL_H_
#define CKPTFS_IO_TRANSFORM_INTERNAL_H_

#include <cstdint>
#include <span>

#include "ckptfs/transforms.h"
#include "common/crc32c.h"
#include "common/float_bits.h"

namespace ckptfs {

// 256 float32 values an 8-bit float decodes to; nullptr for other dtypes.
const float* Fp8DecodeTable(DType d);

// Every op fits in src_len / dst_len, its dtypes convert, its rank is in
// range; the first violation names the op.
Status ValidateOps(uint64_t src_len, std::span<const GatherOp> ops, DType out, uint64_t dst_len);

// Host bookkeeping for one plan: the byte ranges it touches.
struct PlanExtent {
  uint64_t src_lo = 0, src_hi = 0, dst_lo = 0, dst_hi = 0;
  uint64_t elements = 0, dst_bytes = 0;  // dst_bytes: sum of what ops write
};
PlanExtent ExtentOf(std::span<const GatherOp> ops, DType out);

// The dtypes kernels::MeanElement (io/kernels.h) computes.
inline bool MeanSupported(DType dt) {
  return dt == DType::kF32 || dt == DType::kF64 || dt == DType::kBF16 || dt == DType::kF16;
}
// An error unless kernels::MeanElement computes `copies` (> 0) copies of `dt`.
Status CheckMean(uint32_t copies, DType dt);

// CRC-32C, reflected polynomial 0x82F63B78.
constexpr uint32_t kCrc32cPoly = 0x82F63B78u;
// Crc32cUpdate: common/crc32c.h.

// a(x) * b(x) mod P(x) in the reflected representation (zlib's multmodp).
CKPTFS_HD inline uint32_t Crc32cMulModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}
// x^(8n) mod P: the operator that appends n zero bytes.
CKPTFS_HD inline uint32_t Crc32cShiftOp(uint64_t n) {
  uint32_t p = 1u << 31;    // x^0
  uint32_t x2k = 1u << 23;  // x^8 (x^k is bit 31-k)
  while (n) {
    if (n & 1) p = Crc32cMulModP(x2k, p);
    n >>= 1;
    x2k = Crc32cMulModP(x2k, x2k);
  }
  return p;
}
// CRC of A||B from crc(A), crc(B) and |B| (standard CRCs, as zlib's crc32_combine).
CKPTFS_HD inline uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return Crc32cMulModP(Crc32cShiftOp(len_b), crc_a) ^ crc_b;
}

}  // namespace ckptfs

#endif  // CKPTFS_IO_TRANSFORM_INTERNAL_H_
