#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "ckptfs/model.h"

namespace ckptfs {
namespace {

bool Same(const Fragment& a, const Fragment& b) {
  return a.file.v == b.file.v && a.offsets == b.offsets && a.lengths == b.lengths && a.strides == b.strides &&
         a.dtype == b.dtype && a.data_offset == b.data_offset && a.data_length == b.data_length &&
         a.compression == b.compression && a.item_offset == b.item_offset && a.item_length == b.item_length &&
         a.replica == b.replica;
}

TEST(FragmentTableTest, EveryFieldComesBackAtItsExtremes) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  Fragment a;
  a.file.v = UINT32_MAX;
  a.offsets = {0, 1, kMax};
  a.lengths = {kMax, 127, 128};
  a.strides = {-1, kMin, 0};  // negative strides round-trip (zigzag)
  a.dtype = DType::kF8E5M2FNUZ;
  a.data_offset = UINT64_MAX;
  a.data_length = uint64_t{1} << 63;
  a.compression = Compression::kZstd;
  a.item_offset = 300;
  a.item_length = 16384;
  a.replica = UINT32_MAX;
  Fragment b;  // a 0-d fragment with every default
  Fragment c;
  c.file.v = 7;
  c.offsets = {4096};
  c.lengths = {4096};
  c.strides = {1};
  c.dtype = DType::kBF16;
  c.data_offset = 1234567;
  c.data_length = 8192;

  FragmentTable t;
  t.Append({a, b, c});
  t.Append({});
  t.Resize(4);
  t.Set(3, {c});
  ASSERT_EQ(t.size(), 4u);
  const std::vector<Fragment> got = t.Get(0);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(Same(got[0], a));
  EXPECT_TRUE(Same(got[1], b));
  EXPECT_TRUE(Same(got[2], c));
  EXPECT_EQ(t.Count(0), 3u);
  EXPECT_TRUE(t.Empty(1));
  EXPECT_EQ(t.Count(1), 0u);
  EXPECT_TRUE(t.Get(2).empty());
  ASSERT_EQ(t.Count(3), 1u);
  EXPECT_TRUE(Same(t.Get(3)[0], c));
  t.Set(0, {c, c});
  EXPECT_EQ(t.Count(0), 2u);
  t.Clear(0);
  EXPECT_TRUE(t.Empty(0));
  EXPECT_TRUE(t.Get(0).empty());
}

}  // namespace
}  // namespace ckptfs
