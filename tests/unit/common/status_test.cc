#include <gtest/gtest.h>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs {
namespace {

Result<int> Half(int x) {
  if (x % 2) return Invalid("odd number");
  return x / 2;
}

Result<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(StatusTest, AnnotateAddsContext) {
  Status s = Invalid("bad header").Annotate("cannot read x.distcp");
  EXPECT_EQ(s.message(), "cannot read x.distcp: bad header");
  EXPECT_EQ(s.code(), Code::kInvalid);
  EXPECT_TRUE(Status::Ok().Annotate("ignored").ok());
}

TEST(StatusTest, ResultPropagates) {
  EXPECT_EQ(*Quarter(8), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd number");
}

TEST(DTypeTest, NamesSizesAndNumpy) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeFromTorchName("BFloat16Storage"), DType::kBF16);
  EXPECT_EQ(DTypeFromTorchName("float8_e4m3fn"), DType::kF8E4M3FN);
  EXPECT_EQ(DTypeFromTorchName("nonsense"), DType::kInvalid);
  EXPECT_EQ(NumpyDescr(DType::kF32), "<f4");
  EXPECT_EQ(NpyDType(DType::kBF16), DType::kF32);
  EXPECT_EQ(NpyDType(DType::kF16), DType::kF16);
  EXPECT_EQ(Hex64(0xabc), "0000000000000abc");
  EXPECT_EQ(JsonEscape("a\"b\n"), "\"a\\\"b\\n\"");
  EXPECT_EQ(JsonEscape("layers.0.mlp.w"), "\"layers.0.mlp.w\"");  // nothing to escape
  EXPECT_EQ(JsonEscape("a\\b\x7f\x01"), "\"a\\\\b\x7f\\u0001\"");
}

}  // namespace
}  // namespace ckptfs
