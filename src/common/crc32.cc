#include "common/crc32.h"

#include <zlib.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ckptfs {

uint32_t Crc32UpdateZlib(uint32_t crc, const char* p, uint64_t n) {
  return static_cast<uint32_t>(crc32_z(crc, reinterpret_cast<const Bytef*>(p), static_cast<z_size_t>(n)));
}

#if defined(__x86_64__)
namespace {

// Folding constants of the bit-reflected CRC-32 (x^k mod P(x), reflected and
// shifted one bit), from Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ Instruction" (Intel, 2009), and the Barrett
// reduction's P(x) and mu = floor(x^64 / P(x)).
constexpr uint64_t kFold4Lo = 0x0154442bd4, kFold4Hi = 0x01c6e41596;  // 4 x 128 bits ahead
constexpr uint64_t kFold1Lo = 0x01751997d0, kFold1Hi = 0x00ccaa009e;  // 128 bits ahead
constexpr uint64_t kFold64 = 0x0163cd6124;                            // 64 -> 32 bits
constexpr uint64_t kPoly = 0x01db710641, kMu = 0x01f7011641;

// One 128-bit lane folded `ahead` and added to `next`.
__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i x, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

// The CRC state (not inverted) after `n` bytes at `p`, from state `crc`;
// n >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) uint32_t FoldBlocks(uint32_t crc, const unsigned char* p, uint64_t n) {
  auto load = [](const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  // Four lanes, each folded over the next 64 bytes.
  const __m128i k4 = _mm_set_epi64x(static_cast<int64_t>(kFold4Hi), static_cast<int64_t>(kFold4Lo));
  while (n >= 64) {
    x0 = Fold(x0, k4, load(p));
    x1 = Fold(x1, k4, load(p + 16));
    x2 = Fold(x2, k4, load(p + 32));
    x3 = Fold(x3, k4, load(p + 48));
    p += 64;
    n -= 64;
  }
  // The four lanes into one, then the remaining 16-byte blocks.
  const __m128i k1 = _mm_set_epi64x(static_cast<int64_t>(kFold1Hi), static_cast<int64_t>(kFold1Lo));
  __m128i x = Fold(x0, k1, x1);
  x = Fold(x, k1, x2);
  x = Fold(x, k1, x3);
  while (n >= 16) {
    x = Fold(x, k1, load(p));
    p += 16;
    n -= 16;
  }
  // 128 bits to 64: the low half folded onto the high half.
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, k1, 0x10));
  // 64 bits to 32 (kept in bits 32..95 of the lane).
  const __m128i k64 = _mm_set_epi64x(0, static_cast<int64_t>(kFold64));
  x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, mask32), k64, 0x00));
  // Barrett reduction to the 32-bit remainder.
  const __m128i pmu = _mm_set_epi64x(static_cast<int64_t>(kMu), static_cast<int64_t>(kPoly));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x, mask32), pmu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), pmu, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, t), 1));
}

}  // namespace
#endif

uint32_t Crc32Update(uint32_t crc, const char* p, uint64_t n) {
#if defined(__x86_64__)
  static const bool clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  if (clmul && n >= 64) {
    const uint64_t blocks = n & ~uint64_t{15};
    crc = ~FoldBlocks(~crc, reinterpret_cast<const unsigned char*>(p), blocks);
    p += blocks;
    n -= blocks;
  }
#endif
  return n == 0 ? crc : Crc32UpdateZlib(crc, p, n);
}

}  // namespace ckptfs
