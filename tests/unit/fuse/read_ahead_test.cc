// Cross-file read-ahead (read_ahead.h) and the walks it follows
// (View::NextInWalk), driven through the FUSE-free core.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../fs_fixture.h"
#include "ckptfs/fs.h"

namespace ckptfs {
namespace {

using ckptfs::testing::OpenFixtureCopy;
using ckptfs::testing::TempDir;
using Order = View::WalkOrder;

// Every file under `dir` in a depth-first walk, each directory's entries
// sorted by name or by inode: what ls -R / tar and GNU cp -r meet.
void Walk(const View& v, uint64_t dir, Order order, std::vector<uint64_t>* out) {
  auto kids = v.List(dir);
  if (order == Order::kInode) {
    std::sort(kids.begin(), kids.end(), [](const auto& a, const auto& b) { return std::get<1>(a) < std::get<1>(b); });
  }
  for (const auto& [name, ino, is_dir] : kids) {
    if (is_dir) {
      Walk(v, ino, order, out);
    } else if (!v.Get(ino)->report && !v.Get(ino)->topo_errors) {
      out->push_back(ino);
    }
  }
}

class ReadAheadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs_ = OpenFixtureCopy(tmp_, "dcp_single", /*read_ahead=*/true);
    ASSERT_NE(fs_, nullptr);
    auto params = fs_->view().Resolve("params");
    ASSERT_TRUE(params.ok());
    params_ = *params;
  }
  std::vector<uint64_t> Files(Order order) const {
    std::vector<uint64_t> out;
    Walk(fs_->view(), params_, order, &out);
    return out;
  }
  void Open(uint64_t ino, uint32_t pid) { ASSERT_TRUE(fs_->OpenFile(ino, pid).ok()) << fs_->view().PathOf(ino); }
  TempDir tmp_;
  std::unique_ptr<Filesystem> fs_;
  uint64_t params_ = 0;
};

TEST_F(ReadAheadTest, NextInWalkFollowsNameAndInodeOrderAcrossDirectories) {
  for (Order order : {Order::kName, Order::kInode}) {
    const std::vector<uint64_t> files = Files(order);
    ASSERT_GT(files.size(), 20u);
    for (size_t i = 0; i + 1 < files.size(); ++i) {
      EXPECT_EQ(fs_->view().NextInWalk(files[i], order), files[i + 1])
          << fs_->view().PathOf(files[i]) << " (order " << static_cast<int>(order) << ")";
    }
    // Past params/ the walk goes on to the root's next entry, never back.
    const uint64_t after = fs_->view().NextInWalk(files.back(), order);
    EXPECT_EQ(std::find(files.begin(), files.end(), after), files.end());
  }
  // The orders differ here (names and creation order disagree), so both are really tested.
  EXPECT_NE(Files(Order::kName), Files(Order::kInode));
}

TEST_F(ReadAheadTest, AWalkIsReadAheadAndEveryFileAskedAheadIsThenOpened) {
  for (Order order : {Order::kName, Order::kInode}) {
    fs_.reset();  // a fresh core: fresh counts
    std::filesystem::remove_all(tmp_.path() + "/ck");
    std::filesystem::remove_all(tmp_.path() + "/index");
    fs_ = OpenFixtureCopy(tmp_, "dcp_single", /*read_ahead=*/true);
    ASSERT_NE(fs_, nullptr);
    const std::vector<uint64_t> files = Files(order);
    for (uint64_t ino : files) Open(ino, 7);
    const ReadAhead::Counts c = fs_->read_ahead_counts(/*drain=*/true);
    // Every file but the first few of the walk was asked ahead (those of
    // literals only, such as a step's .npy, ask for no bytes)...
    EXPECT_GE(c.hits, files.size() - 12) << static_cast<int>(order);
    EXPECT_GT(c.files, files.size() / 4);
    EXPECT_GT(c.bytes, 0u);
    // ... and was then opened: nothing asked ahead was left unread but the
    // files past the walk's end (which the walk went on to).
    EXPECT_LE(c.files, c.hits + ReadAhead::kFilesAhead);
    const std::string stats = fs_->StatsJson();
    EXPECT_NE(stats.find("\"read_ahead\": {\"on\": true, \"files\": " + std::to_string(c.files)), std::string::npos)
        << stats;
  }
}

TEST_F(ReadAheadTest, OneFileOrFilesOutOfOrderCauseNoReadAhead) {
  const std::vector<uint64_t> files = Files(Order::kName);
  // One tensor's files (a reader of one tensor), twice over.
  Open(files[0], 1);
  Open(files[1], 1);
  Open(files[0], 1);
  Open(files[1], 1);
  // The whole tree backwards, and the two halves interleaved.
  for (size_t i = files.size(); i-- > 0;) Open(files[i], 2);
  const size_t half = files.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    Open(files[i], 3);
    Open(files[half + i], 3);
  }
  const ReadAhead::Counts c = fs_->read_ahead_counts(/*drain=*/true);
  EXPECT_EQ(c.files, 0u);
  EXPECT_EQ(c.bytes, 0u);
  EXPECT_EQ(c.hits, 0u);
}

TEST_F(ReadAheadTest, AWalkThatBreaksStopsAndTwoReadersKeepTheirOwnWalks) {
  const std::vector<uint64_t> files = Files(Order::kName);
  // Two readers walking the same tree at once, interleaved request by request.
  for (size_t i = 0; i < 8; ++i) {
    Open(files[i], 10);
    Open(files[i], 11);
  }
  const ReadAhead::Counts two = fs_->read_ahead_counts(true);
  EXPECT_GE(two.hits, 2u * (8 - ReadAhead::kInOrder - 1));
  // Reader 10 jumps ahead, then back: its walk stops, nothing more is asked.
  Open(files[files.size() / 2], 10);
  Open(files[1], 10);
  EXPECT_EQ(fs_->read_ahead_counts(true).files, two.files);
}

TEST_F(ReadAheadTest, AReaderOfOneFileNamePerDirectoryIsFollowedPastTheOthers) {
  // A loader that takes params/*/param.npy only: the other names are passed
  // over, so once learned, everything asked ahead is opened.
  std::vector<uint64_t> npy;
  for (uint64_t ino : Files(Order::kName)) {
    if (fs_->view().Get(ino)->name == "param.npy") npy.push_back(ino);
  }
  ASSERT_GE(npy.size(), 5u);
  for (uint64_t ino : npy) Open(ino, 5);
  const ReadAhead::Counts c = fs_->read_ahead_counts(true);
  EXPECT_GE(c.hits, npy.size() - ReadAhead::kInOrder - 1);
  EXPECT_LE(c.files, c.hits + ReadAhead::kFilesAhead + 1);
}

TEST_F(ReadAheadTest, OffByDefaultAndOffMeansNone) {
  FsOptions o;
  EXPECT_FALSE(o.read_ahead);
  o.src = tmp_.path() + "/ck";
  o.index_dir = tmp_.path() + "/index";
  o.gpu = GpuMode::kOff;
  auto off = Filesystem::Open(o);
  ASSERT_TRUE(off.ok()) << off.status().message();
  for (uint64_t ino : Files(Order::kName)) ASSERT_TRUE((*off)->OpenFile(ino, 1).ok());
  EXPECT_EQ((*off)->read_ahead_counts(true).files, 0u);
  EXPECT_NE((*off)->StatsJson().find("\"read_ahead\": {\"on\": false"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs
