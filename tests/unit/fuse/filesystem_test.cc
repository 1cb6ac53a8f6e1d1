// The FUSE-free core driven directly: tree, sizes, reads, errors.
#include "ckptfs/fs.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <filesystem>

#include "../test_util.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;
namespace fs = std::filesystem;

class FilesystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = tmp_.path() + "/ck";
    fs::copy(std::string(CKPTFS_TEST_DATA) + "/dcp_single", src_, fs::copy_options::recursive);
    FsOptions o;
    o.src = src_;
    o.index_dir = tmp_.path() + "/index";
    auto f = Filesystem::Open(o);
    ASSERT_TRUE(f.ok()) << f.status().message();
    fs_ = std::move(f).value();
  }
  std::string ReadAll(const std::string& path) {
    auto ino = fs_->view().Resolve(path);
    EXPECT_TRUE(ino.ok()) << path;
    auto a = fs_->GetAttr(*ino);
    std::string out(a->size, '\0');
    // Odd-sized reads exercise unaligned element ranges.
    for (uint64_t off = 0; off < out.size();) {
      auto n = fs_->Read(*ino, off, std::min<size_t>(37, out.size() - off), out.data() + off);
      EXPECT_TRUE(n.ok()) << n.status().message();
      if (!n.ok() || *n == 0) break;
      off += *n;
    }
    return out;
  }
  TempDir tmp_;
  std::string src_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_F(FilesystemTest, TreeHasParamsStatesOtherAndMetadataFiles) {
  for (const char* p : {"README.txt", "checkpoint.json", "params/proj.weight/param.npy", "params/proj.weight/param.raw",
                        "params/proj.weight/exp_avg.npy", "params/proj.weight/exp_avg_sq.raw",
                        "params/proj.weight/step.npy", "params/proj.weight/info.json", "other/extra.bf16.npy",
                        "other/extra.bf16.raw", "other/lr_scheduler.last_epoch", "other/train_state.step"}) {
    EXPECT_TRUE(fs_->view().Resolve(p).ok()) << p;
  }
  auto e = fs_->Lookup(kRootIno, "nope");
  EXPECT_EQ(ToErrno(e.status()), ENOENT);
}

TEST_F(FilesystemTest, NpyIsHeaderPlusRawAndSizesAreExact) {
  std::string npy = ReadAll("params/proj.weight/param.npy");
  std::string raw = ReadAll("params/proj.weight/param.raw");
  ASSERT_EQ(raw.size(), 10u * 6u * 4u);
  ASSERT_GT(npy.size(), raw.size());
  EXPECT_EQ(npy.substr(npy.size() - raw.size()), raw);
  EXPECT_EQ(npy.substr(0, 6), "\x93NUMPY");
  // bf16 widens in .npy: 24 elements * 4 bytes after the header.
  std::string bf = ReadAll("other/extra.bf16.npy");
  std::string bfraw = ReadAll("other/extra.bf16.raw");
  EXPECT_EQ(bfraw.size(), 48u);
  EXPECT_EQ(bf.size() % 64, 96u % 64);
  EXPECT_EQ(bf[bf.size() - 96 + 2], bfraw[0]);
}

TEST_F(FilesystemTest, TransposedSourceIsServedInCOrder) {
  std::string raw = ReadAll("other/extra.transposed.raw");
  ASSERT_EQ(raw.size(), 160u);
  // transposed = arange(40).reshape(5, 8).t(): element (i, j) = j*8 + i.
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 5; ++j) {
      float v;
      std::memcpy(&v, raw.data() + 4 * (i * 5 + j), 4);
      EXPECT_EQ(v, static_cast<float>(j * 8 + i));
    }
  }
}

TEST_F(FilesystemTest, InfoJsonCarriesFragmentsAndHash) {
  std::string j = ReadAll("params/proj.weight/info.json");
  EXPECT_NE(j.find("\"fragments\""), std::string::npos);
  EXPECT_NE(j.find("__0_0.distcp"), std::string::npos);
  size_t h = j.find("\"xxh3_64_raw\": \"");
  ASSERT_NE(h, std::string::npos);
  EXPECT_EQ(j.substr(h + 16, 16).find_first_not_of("0123456789abcdef"), std::string::npos);
  auto parsed = fs_->GetAttr(*fs_->view().Resolve("params/proj.weight/info.json"));
  EXPECT_EQ(parsed->size, j.size());
}

TEST_F(FilesystemTest, ChangedSourceGivesStaleOnOpenAndRead) {
  auto ino = fs_->view().Resolve("params/proj.weight/param.raw");
  ASSERT_TRUE(fs_->OpenFile(*ino).ok());
  std::string d = ckptfs::testing::ReadFile(src_ + "/__0_0.distcp");
  ckptfs::testing::WriteFile(src_ + "/__0_0.distcp", d + "junk");
  EXPECT_EQ(ToErrno(fs_->OpenFile(*ino)), ESTALE);
  char buf[16];
  auto n = fs_->Read(*ino, 0, sizeof(buf), buf);
  EXPECT_EQ(ToErrno(n.status()), ESTALE);
  // Literal files keep working.
  auto r = fs_->view().Resolve("README.txt");
  EXPECT_TRUE(fs_->Read(*r, 0, sizeof(buf), buf).ok());
}

TEST(ErrnoMapTest, OneMap) {
  EXPECT_EQ(ToErrno(Status::Ok()), 0);
  EXPECT_EQ(ToErrno(NotFound("x")), ENOENT);
  EXPECT_EQ(ToErrno(Invalid("x")), EIO);
  EXPECT_EQ(ToErrno(Stale("x")), ESTALE);
  EXPECT_EQ(ToErrno(Status(Code::kReadOnly, "x")), EROFS);
}

}  // namespace
}  // namespace ckptfs
