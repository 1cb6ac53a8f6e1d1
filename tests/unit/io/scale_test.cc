// ScaleFloats (hf/'s scaled and offset tensors: MaxText's query kernels,
// Gemma's embedding and norms): x * scale + add computed in double and
// rounded once to float32 / bfloat16 / float16, to nearest even. The
// reference rounds the double directly to 16 bits (no float32 in between),
// on values chosen so that rounding twice would differ.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ckptfs/transforms.h"

namespace ckptfs {
namespace {

// d rounded to nearest even with `mant` explicit mantissa bits, as float
// bits of that format: bfloat16 (8-bit exponent) from the double's bits;
// normal, finite values only.
uint16_t RoundDoubleToBf16(double d) {
  const uint64_t b = std::bit_cast<uint64_t>(d);
  const uint64_t sign = b >> 63;
  const int64_t exp = static_cast<int64_t>((b >> 52) & 0x7FF) - 1023 + 127;
  uint64_t mant = b & ((1ull << 52) - 1);
  // Keep 7 bits of the 52: round on the 45 dropped.
  const uint64_t drop = 45, half = 1ull << (drop - 1), rest = mant & ((1ull << drop) - 1);
  uint64_t kept = mant >> drop;
  uint64_t e = static_cast<uint64_t>(exp);
  if (rest > half || (rest == half && (kept & 1))) {
    if (++kept == (1u << 7)) kept = 0, ++e;
  }
  return static_cast<uint16_t>((sign << 15) | (e << 7) | kept);
}

std::vector<char> Floats(const std::vector<float>& v) {
  std::vector<char> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(ScaleFloatsTest, Bf16IsTheDoubleRoundedOnce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const double scale = std::sqrt(128.0);  // inexact: MaxText's head_dim 128
  std::vector<float> x(200000);
  for (float& v : x) v = u(rng);
  const std::vector<char> in = Floats(x);
  std::vector<char> out(x.size() * 2);
  ASSERT_TRUE(ScaleFloats(in.data(), x.size(), scale, 0.0, DType::kBF16, out.data()).ok());
  size_t twice_differs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = static_cast<double>(x[i]) * scale;
    uint16_t got;
    std::memcpy(&got, out.data() + 2 * i, 2);
    ASSERT_EQ(got, RoundDoubleToBf16(d)) << x[i];
    // Through float32 with round to nearest even, then bf16: sometimes not.
    const uint32_t f = std::bit_cast<uint32_t>(static_cast<float>(d));
    const uint16_t twice = static_cast<uint16_t>((f + (((f >> 16) & 1u) + 0x7FFFu)) >> 16);
    twice_differs += twice != got;
  }
  EXPECT_GT(twice_differs, 0u) << "no case where rounding twice differs: the test shows nothing";
}

TEST(ScaleFloatsTest, F32AndOffsetAndHalf) {
  const std::vector<float> x = {1.0f, 1.5f, -2.25f, 0.0f, 1e-3f};
  const std::vector<char> in = Floats(x);
  std::vector<char> out(x.size() * 4);
  // Gemma's norms: x - 1.
  ASSERT_TRUE(ScaleFloats(in.data(), x.size(), 1.0, -1.0, DType::kF32, out.data()).ok());
  std::vector<float> got(x.size());
  std::memcpy(got.data(), out.data(), out.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(got[i], static_cast<float>(static_cast<double>(x[i]) - 1.0));
  // Gemma's embedding: x / sqrt(hidden), float16.
  ASSERT_TRUE(ScaleFloats(in.data(), x.size(), 1.0 / 8.0, 0.0, DType::kF16, out.data()).ok());
  uint16_t h;
  std::memcpy(&h, out.data() + 2, 2);
  EXPECT_EQ(h, 0x3200);  // 1.5 / 8 = 0.1875
  // Only floats of 32 or 16 bits are written.
  EXPECT_FALSE(ScaleFloats(in.data(), x.size(), 2.0, 0.0, DType::kI32, out.data()).ok());
}

// -0.0 scaled stays -0.0 (the source's sign bit; the converters keep it),
// and with an offset it is the offset's result.
TEST(ScaleFloatsTest, NegativeZeroKeepsItsSign) {
  const std::vector<char> in = Floats({-0.0f, 0.0f});
  std::vector<char> out(8);
  ASSERT_TRUE(ScaleFloats(in.data(), 2, 8.0, 0.0, DType::kF32, out.data()).ok());
  uint32_t v[2];
  std::memcpy(v, out.data(), 8);
  EXPECT_EQ(v[0], 0x80000000u);
  EXPECT_EQ(v[1], 0x00000000u);
  ASSERT_TRUE(ScaleFloats(in.data(), 2, 0.125, 0.0, DType::kBF16, out.data()).ok());
  uint16_t h[2];
  std::memcpy(h, out.data(), 4);
  EXPECT_EQ(h[0], 0x8000);
  ASSERT_TRUE(ScaleFloats(in.data(), 2, 1.0, -1.0, DType::kF32, out.data()).ok());
  std::memcpy(v, out.data(), 8);
  EXPECT_EQ(v[0], std::bit_cast<uint32_t>(-1.0f));
}

TEST(ScaleFloatsTest, OverflowAndNan) {
  const std::vector<float> x = {3.0e38f, -3.0e38f, std::nanf("")};
  const std::vector<char> in = Floats(x);
  std::vector<char> out(x.size() * 2);
  ASSERT_TRUE(ScaleFloats(in.data(), x.size(), 4.0, 0.0, DType::kBF16, out.data()).ok());
  uint16_t v[3];
  std::memcpy(v, out.data(), 6);
  EXPECT_EQ(v[0], 0x7F80);  // +inf
  EXPECT_EQ(v[1], 0xFF80);  // -inf
  EXPECT_EQ(v[2], 0x7FC0);  // the canonical quiet NaN
}

}  // namespace
}  // namespace ckptfs
