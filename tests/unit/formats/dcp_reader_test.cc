#include "formats/dcp/dcp_reader.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "../test_util.h"
#include "ckptfs/formats.h"

namespace ckptfs::formats {
namespace {

namespace fs = std::filesystem;
using ckptfs::testing::TempDir;

const std::string kSingle = std::string(CKPTFS_TEST_DATA) + "/dcp_single";

// A writable copy of the committed fixture (tests may damage it).
std::string CopyFixture(const TempDir& t) {
  std::string dst = t.path() + "/ck";
  fs::copy(kSingle, dst, fs::copy_options::recursive);
  fs::remove_all(dst + "/.ckptfs");
  return dst;
}

const TensorRecord* Find(const Checkpoint& ck, const std::string& key) {
  for (const auto& t : ck.tensors) {
    if (t.key == key) return &t;
  }
  return nullptr;
}

TEST(DcpReaderTest, ReadsTorch2Metadata) {
  auto ck = ReadDcp(kSingle);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->info.family, Family::kPytorchDcp);
  EXPECT_EQ(ck->info.step, 2);
  EXPECT_EQ(ck->info.world_size, 1u);
  const TensorRecord* w = Find(*ck, "model.proj.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->role, Role::kParam);
  EXPECT_EQ(w->fqn, "proj.weight");
  EXPECT_EQ(w->shape, (std::vector<int64_t>{10, 6}));
  const TensorRecord* s = Find(*ck, "optimizer.state.proj.weight.exp_avg_sq");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->role, Role::kOptimState);
  EXPECT_EQ(s->fqn, "proj.weight");
  EXPECT_EQ(s->state, "exp_avg_sq");
  const TensorRecord* bf = Find(*ck, "extra.bf16");
  ASSERT_NE(bf, nullptr);
  EXPECT_EQ(bf->dtype, DType::kBF16);
  EXPECT_EQ(bf->role, Role::kOther);
  const TensorRecord* tr = Find(*ck, "extra.transposed");
  ASSERT_NE(tr, nullptr);
  size_t ti = static_cast<size_t>(tr - ck->tensors.data());
  const std::vector<Fragment> tf = ck->fragments.Get(ti);
  ASSERT_EQ(tf.size(), 1u);
  EXPECT_EQ(tf[0].strides, (std::vector<int64_t>{1, 8}));
  const TensorRecord* lr = Find(*ck, "lr_scheduler.last_epoch");
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ(lr->encoding, Encoding::kBytes);
  for (const auto& t : ck->tensors) EXPECT_TRUE(t.error.empty()) << t.key << ": " << t.error;
}

TEST(DcpReaderTest, EmptyMetadataIsFatalWithFileName) {
  TempDir t;
  std::string d = CopyFixture(t);
  ckptfs::testing::WriteFile(d + "/.metadata", "");
  auto ck = ReadDcp(d);
  ASSERT_FALSE(ck.ok());
  EXPECT_EQ(ck.status().message(), "cannot parse " + d + "/.metadata: empty file");
}

TEST(DcpReaderTest, CorruptMetadataIsFatalWithFileName) {
  TempDir t;
  std::string d = CopyFixture(t);
  std::string m = ckptfs::testing::ReadFile(d + "/.metadata");
  ckptfs::testing::WriteFile(d + "/.metadata", m.substr(0, m.size() / 2));
  auto ck = ReadDcp(d);
  ASSERT_FALSE(ck.ok());
  EXPECT_EQ(ck.status().message().rfind("cannot parse " + d + "/.metadata: ", 0), 0u) << ck.status().message();
}

TEST(DcpReaderTest, TruncatedDataFileBreaksOnlyTheTensorsPastTheCut) {
  TempDir t;
  std::string d = CopyFixture(t);
  std::string data = ckptfs::testing::ReadFile(d + "/__0_0.distcp");
  ckptfs::testing::WriteFile(d + "/__0_0.distcp", data.substr(0, data.size() - 3000));
  auto ck = ReadDcp(d);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  size_t broken = 0, fine = 0;
  for (const auto& tr : ck->tensors) {
    if (tr.error.empty()) {
      ++fine;
    } else {
      ++broken;
      EXPECT_NE(tr.error.find("__0_0.distcp"), std::string::npos) << tr.error;
    }
  }
  EXPECT_GT(broken, 0u);
  EXPECT_GT(fine, 0u);
}

TEST(DcpReaderTest, MissingDataFileIsPerTensor) {
  TempDir t;
  std::string d = CopyFixture(t);
  fs::remove(d + "/__0_0.distcp");
  auto ck = ReadDcp(d);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  for (const auto& tr : ck->tensors) {
    EXPECT_NE(tr.error.find("cannot open " + d + "/__0_0.distcp: No such file"), std::string::npos) << tr.error;
  }
}

TEST(DcpReaderTest, NoMetadataIsNotACheckpoint) {
  TempDir t;
  auto ck = ReadCheckpoint(t.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("cannot detect a checkpoint"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs::formats
