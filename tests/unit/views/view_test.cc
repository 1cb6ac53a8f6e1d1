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
