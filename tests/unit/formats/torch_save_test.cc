#include "formats/torch_save.h"

#include <gtest/gtest.h>

#include "../test_util.h"
#include "formats/npy.h"

namespace ckptfs::formats {
namespace {

// tests/data/sample.pt was written by torch.save (see tests/fixtures).
class TorchSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = ckptfs::testing::ReadFile(std::string(CKPTFS_TEST_DATA) + "/sample.pt");
    ASSERT_FALSE(data_.empty());
  }
  std::string data_;
};

TEST_F(TorchSaveTest, ZipDirectoryAndDataOffsetsAreAligned) {
  MemoryReader r(data_, "sample.pt");
  auto dir = ReadZipDirectory(r);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  ASSERT_NE(dir->Find("sample/data.pkl"), nullptr);
  for (const auto& e : dir->entries) {
    if (e.name.find("/data/") == std::string::npos) continue;
    auto off = ZipDataOffset(r, e);
    ASSERT_TRUE(off.ok()) << off.status().message();
    EXPECT_EQ(*off % 64, 0u) << e.name;  // torch aligns records to 64 bytes
  }
}

TEST_F(TorchSaveTest, TensorsViewsStridesAndBf16) {
  MemoryReader r(data_, "sample.pt");
  auto a = ReadTorchSave(r);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->prefix, "sample");
  const PyValue* view = a->root->Get("view");
  ASSERT_NE(view, nullptr);
  ASSERT_EQ(view->kind, PyKind::kTensor);
  EXPECT_EQ(view->tensor().storage_offset, 5u);
  EXPECT_EQ(view->tensor().shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(view->tensor().strides, (std::vector<int64_t>{3, 1}));
  auto rv = ResolveTensor(r, *a, view->tensor());
  ASSERT_TRUE(rv.ok()) << rv.status().message();
  float first;
  std::memcpy(&first, data_.data() + rv->data_offset, 4);
  EXPECT_EQ(first, 5.0f);  // arange(20)[5]

  const PyValue* t = a->root->Get("t");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->tensor().strides, (std::vector<int64_t>{1, 3}));

  const PyValue* bf = a->root->Get("bf");
  ASSERT_NE(bf, nullptr);
  EXPECT_EQ(bf->tensor().dtype, DType::kBF16);
  auto rb = ResolveTensor(r, *a, bf->tensor());
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ(data_.substr(rb->data_offset, 4), std::string("\x80\x3f\x20\xc0", 4));  // 1.0, -2.5

  EXPECT_EQ(a->root->Get("p")->kind, PyKind::kTensor);  // Parameter unwraps
  EXPECT_EQ(a->root->Get("n")->i, 42);
  EXPECT_EQ(a->root->Get("b")->s, std::string("\x00\xff", 2));
}

TEST_F(TorchSaveTest, EveryTruncationIsAnErrorNeverACrash) {
  for (size_t n = 0; n < data_.size(); n += 7) {
    std::string cut = data_.substr(0, n);
    MemoryReader r(cut, "cut.pt");
    auto a = ReadTorchSave(r);
    if (a.ok()) {  // only possible if the directory survived: then tensors must check out or fail cleanly
      const PyValue* w = a->root->Get("w");
      if (w != nullptr && w->kind == PyKind::kTensor) (void)ResolveTensor(r, *a, w->tensor()).ok();
    }
  }
  SUCCEED();
}

TEST_F(TorchSaveTest, CorruptBytesNeverCrash) {
  std::mt19937 rng(1);
  for (int i = 0; i < 300; ++i) {
    std::string bad = data_;
    for (int k = 0; k < 4; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
    MemoryReader r(bad, "bad.pt");
    auto a = ReadTorchSave(r);
    if (a.ok() && a->root->kind == PyKind::kDict) {
      for (const auto& [k, v] : a->root->dict) {
        if (v->kind == PyKind::kTensor) (void)ResolveTensor(r, *a, v->tensor()).ok();
      }
    }
  }
  SUCCEED();
}

TEST(NpyTest, HeaderIsAlignedAndDescribesShape) {
  auto h = NpyHeader(DType::kF32, {3, 4});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->size() % 64, 0u);
  EXPECT_EQ(h->substr(0, 6), "\x93NUMPY");
  EXPECT_NE(h->find("'descr': '<f4'"), std::string::npos);
  EXPECT_NE(h->find("'shape': (3, 4)"), std::string::npos);
  EXPECT_NE(NpyHeader(DType::kI64, {5})->find("(5,)"), std::string::npos);
  EXPECT_NE(NpyHeader(DType::kF32, {})->find("'shape': ()"), std::string::npos);
  EXPECT_FALSE(NpyHeader(DType::kBF16, {2}).ok());
}

}  // namespace
}  // namespace ckptfs::formats
