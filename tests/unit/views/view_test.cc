#include "ckptfs/views.h"

#include <gtest/gtest.h>

#include "../test_util.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

TEST(PathComponentTest, SanitizesKeys) {
  EXPECT_EQ(PathComponent("a/b"), "a%2Fb");
  EXPECT_EQ(PathComponent(""), "_");
  EXPECT_EQ(PathComponent(".."), "_..");
  EXPECT_LE(PathComponent(std::string(600, 'x')).size(), 255u);
}

TEST(ViewTest, LayoutsAndCollisions) {
  TempDir t;
  Checkpoint ck;
  ck.info.family = "synthetic";
  ck.files.push_back(SourceFile{"d", 0, 0, 0});
  ckptfs::testing::WriteFile(t.path() + "/d", std::string(100, 'a'));
  ckptfs::testing::FillStat(t.path(), &ck.files[0]);
  auto add = [&](const std::string& key, Role role, const std::string& fqn, const std::string& state, DType dt,
                 std::vector<int64_t> shape) {
    TensorRecord r;
    r.key = key;
    r.role = role;
    r.fqn = fqn;
    r.state = state;
    r.dtype = dt;
    r.shape = shape;
    r.byte_size = r.Numel() * DTypeSize(dt);
    r.num_fragments = 1;
    ck.tensors.push_back(r);
    Fragment f;
    f.offsets.assign(shape.size(), 0);
    f.lengths = shape;
    f.strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) f.strides[d - 1] = f.strides[d] * shape[d];
    f.dtype = dt;
    f.data_length = r.byte_size;
    ck.fragments.push_back({f});
  };
  add("model.w", Role::kParam, "w", "param", DType::kBF16, {3, 2});
  add("opt.w.exp_avg", Role::kOptimState, "w", "exp_avg", DType::kF32, {3, 2});
  add("x", Role::kOther, "x", "", DType::kI64, {2});
  add("dup", Role::kParam, "w", "param", DType::kF32, {1});
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok());
  auto npy = (*v)->Resolve("params/w/param.npy");
  ASSERT_TRUE(npy.ok());
  auto l = (*v)->Layout(*npy);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ((*l)->segments.size(), 2u);
  EXPECT_EQ((*l)->segments[1].out_dtype, DType::kF32);  // bf16 widened
  EXPECT_EQ((*l)->size, (*l)->segments[0].size + 24);
  auto raw = (*v)->Layout(*(*v)->Resolve("params/w/param.raw"));
  EXPECT_EQ((*raw)->size, 12u);
  EXPECT_TRUE((*v)->Resolve("other/x.npy").ok());
  // The colliding fourth entry is kept under a distinct name and reported.
  EXPECT_TRUE((*v)->Resolve("params/w/param.npy~3").ok());
  auto cj = (*v)->Layout(*(*v)->Resolve("checkpoint.json"));
  EXPECT_NE((*cj)->segments[0].literal.find("two entries map to"), std::string::npos);
  EXPECT_EQ((*v)->PathOf(*npy), "/params/w/param.npy");
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// universal/zero/<name>/ embeds parameter names from the checkpoint: '..',
// '' and over-long components stay single, visible entries inside the tree.
TEST(ViewTest, ExportPathComponentsAreEscaped) {
  ckptfs::testing::TempDir t;
  Checkpoint ck;
  ck.info.family = "synthetic";
  for (const char* p : {"universal/zero/../fp32.pt", "universal/zero//fp32.pt", "universal/zero/./x/fp32.pt"}) {
    ExportFile x;
    x.path = p;
    ExportPart part;
    part.literal = "abc";
    part.size = 3;
    x.parts.push_back(part);
    ck.exports.push_back(x);
  }
  ExportFile longx;
  longx.path = "universal/zero/" + std::string(4000, 'n') + "/fp32.pt";
  longx.parts = ck.exports[0].parts;
  ck.exports.push_back(longx);
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_TRUE((*v)->Resolve("universal/zero/_../fp32.pt").ok());
  EXPECT_TRUE((*v)->Resolve("universal/zero/_/fp32.pt").ok());
  EXPECT_TRUE((*v)->Resolve("universal/zero/_./x/fp32.pt").ok());
  auto zero = (*v)->Resolve("universal/zero");
  ASSERT_TRUE(zero.ok());
  size_t n = 0;
  for (const auto& [name, ino, is_dir] : (*v)->List(*zero)) {
    EXPECT_TRUE(name != ".." && name != "." && !name.empty() && name.size() <= 255) << name;
    ++n;
  }
  EXPECT_EQ(n, 4u);
}

}  // namespace
}  // namespace ckptfs
