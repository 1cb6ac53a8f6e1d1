// Crc32Update against zlib's crc32_z: every length up to a few blocks, at
// every alignment, continued from earlier states, and over large buffers.
#include "common/crc32.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace ckptfs {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(g());
  return s;
}

TEST(Crc32, KnownValues) {
  EXPECT_EQ(Crc32Update(0, "", 0), 0u);
  EXPECT_EQ(Crc32Update(0, "123456789", 9), 0xCBF43926u);  // the CRC-32 check value
  const std::string zeros(4096, '\0');
  EXPECT_EQ(Crc32Update(0, zeros.data(), zeros.size()), Crc32UpdateZlib(0, zeros.data(), zeros.size()));
}

TEST(Crc32, EqualsZlibAtEveryLengthAndAlignment) {
  const std::string buf = RandomBytes(600, 1);
  for (size_t align = 0; align < 16; ++align) {
    for (size_t n = 0; n + align <= 600 && n <= 560; ++n) {
      ASSERT_EQ(Crc32Update(0, buf.data() + align, n), Crc32UpdateZlib(0, buf.data() + align, n))
          << "length " << n << " at offset " << align;
    }
  }
}

TEST(Crc32, ContinuesFromAnyState) {
  const std::string buf = RandomBytes(1 << 16, 2);
  std::mt19937 g(3);
  for (int round = 0; round < 200; ++round) {
    const size_t cut = g() % buf.size();
    const uint32_t first = Crc32Update(0, buf.data(), cut);
    ASSERT_EQ(first, Crc32UpdateZlib(0, buf.data(), cut));
    ASSERT_EQ(Crc32Update(first, buf.data() + cut, buf.size() - cut), Crc32UpdateZlib(0, buf.data(), buf.size()))
        << "cut at " << cut;
  }
}

TEST(Crc32, LargeBuffers) {
  for (size_t n : {size_t{1} << 20, (size_t{1} << 22) + 13, size_t{9999991}}) {
    const std::string buf = RandomBytes(n, static_cast<uint32_t>(n));
    EXPECT_EQ(Crc32Update(0x12345678u, buf.data(), buf.size()), Crc32UpdateZlib(0x12345678u, buf.data(), buf.size()))
        << n;
  }
}

}  // namespace
}  // namespace ckptfs
