#include "ckptfs/index.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <thread>

#include "../test_util.h"
#include "index/codec.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;
namespace fs = std::filesystem;

Checkpoint Tiny(const std::string& dir) {
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.info.step = 7;
  ck.info.problems = {"p1"};
  ck.files.push_back(SourceFile{"a.bin", 0, 0, 0});
  ckptfs::testing::WriteFile(dir + "/a.bin", std::string(64, 'x'));
  ckptfs::testing::FillStat(dir, &ck.files[0]);
  for (int i = 0; i < 3; ++i) {
    TensorRecord t;
    t.key = "k" + std::to_string(i);
    t.dtype = DType::kF32;
    t.shape = {2, 2};
    t.byte_size = 16;
    t.num_fragments = 2;
    ck.tensors.push_back(t);
    std::vector<Fragment> fr(2);
    for (int j = 0; j < 2; ++j) {
      fr[j].file = FileId{0};
      fr[j].offsets = {j, 0};
      fr[j].lengths = {1, 2};
      fr[j].strides = {2, 1};
      fr[j].dtype = DType::kF32;
      fr[j].data_offset = static_cast<uint64_t>(8 * j + 16 * i);
      fr[j].data_length = 8;
    }
    ck.fragments.Append(fr);
  }
  return ck;
}

TEST(CodecTest, RoundTripsAndRejectsCorruption) {
  Fragment f;
  f.file = FileId{3};
  f.offsets = {1, 2};
  f.lengths = {3, 4};
  f.strides = {4, 1};
  f.dtype = DType::kBF16;
  f.data_offset = 1ull << 40;
  f.compression = Compression::kZstd;
  std::string e = index::EncodeFragment(f);
  auto d = index::DecodeFragment(e);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->data_offset, 1ull << 40);
  EXPECT_EQ(d->strides, f.strides);
  EXPECT_EQ(d->compression, Compression::kZstd);
  for (size_t n = 0; n < e.size(); ++n) EXPECT_FALSE(index::DecodeFragment(e.substr(0, n)).ok());
  EXPECT_FALSE(index::DecodeFragment(e + "x").ok());
  EXPECT_LT(index::KeyU32('g', 1), index::KeyU32('g', 256));  // numeric order
}

TEST(IndexTest, BuildOpenAndPrefixScan) {
  TempDir t;
  Checkpoint ck = Tiny(t.path());
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok()) << ix.status().message();
  EXPECT_EQ((*ix)->info().step, 7);
  EXPECT_EQ((*ix)->tensors().size(), 3u);
  EXPECT_EQ((*ix)->num_fragments(), 6u);
  auto fr = (*ix)->Fragments(TensorId{1});
  ASSERT_TRUE(fr.ok());
  ASSERT_EQ(fr->size(), 2u);
  EXPECT_EQ((*fr)[1].data_offset, 24u);
  EXPECT_FALSE((*ix)->Fragments(TensorId{9}).ok());
  EXPECT_FALSE(fs::exists(t.path() + "/ix.tmp." + std::to_string(::getpid())));
}

TEST(IndexTest, ChecksumRangesAreLookedUpByFileAndOffset) {
  TempDir t;
  Checkpoint ck = Tiny(t.path());
  ck.files.push_back(SourceFile{"b.bin", 0, 0, 0});
  ckptfs::testing::WriteFile(t.path() + "/b.bin", std::string(1 << 12, 'z'));
  ckptfs::testing::FillStat(t.path(), &ck.files[1]);
  // Out of order, across files, one repeated (a reader may list a range twice).
  for (uint64_t off : {40u, 0u, 10u, 100u, 10u})
    ck.checksums.Add(ChecksumRange{FileId{0}, off, 10, 0xC0 + static_cast<uint32_t>(off), "e" + std::to_string(off)});
  for (uint64_t off : {2048u, 0u}) ck.checksums.Add(ChecksumRange{FileId{1}, off, 1024, 7, "b"});
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok()) << ix.status().message();
  auto offsets = [&](FileId f, uint64_t lo, uint64_t hi) {
    auto v = (*ix)->ChecksumsIn(f, lo, hi);
    EXPECT_TRUE(v.ok()) << v.status().message();
    std::vector<uint64_t> out;
    for (const auto& c : *v) out.push_back(c.offset);
    return out;
  };
  EXPECT_EQ(offsets(FileId{0}, 0, 200), (std::vector<uint64_t>{0, 10, 40, 100}));
  EXPECT_EQ(offsets(FileId{0}, 15, 41), (std::vector<uint64_t>{10, 40}));  // starts inside [10, 20)
  EXPECT_EQ(offsets(FileId{0}, 20, 40), (std::vector<uint64_t>{}));        // the gap between two
  EXPECT_EQ(offsets(FileId{0}, 109, 110), (std::vector<uint64_t>{100}));
  EXPECT_EQ(offsets(FileId{0}, 110, 1000), (std::vector<uint64_t>{}));
  EXPECT_EQ(offsets(FileId{1}, 0, 1), (std::vector<uint64_t>{0}));  // not file 0's last
  EXPECT_EQ(offsets(FileId{1}, 1500, 4096), (std::vector<uint64_t>{2048}));
  EXPECT_EQ(offsets(FileId{2}, 0, 1u << 20), (std::vector<uint64_t>{}));
  auto one = (*ix)->ChecksumsIn(FileId{0}, 10, 11);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].crc32, 0xC0u + 10);
  EXPECT_EQ((*one)[0].name, "e10");  // the first of the repeat
  std::vector<std::pair<uint32_t, uint64_t>> all;
  size_t batches = 0;
  ASSERT_TRUE((*ix)
                  ->ScanChecksums(4,
                                  [&](std::vector<ChecksumRange>& v) {
                                    ++batches;
                                    EXPECT_LE(v.size(), 4u);
                                    for (const auto& c : v) all.emplace_back(c.file.v, c.offset);
                                    return Status::Ok();
                                  })
                  .ok());
  EXPECT_EQ(batches, 2u);
  EXPECT_EQ(all, (std::vector<std::pair<uint32_t, uint64_t>>{{0, 0}, {0, 10}, {0, 40}, {0, 100}, {1, 0}, {1, 2048}}));
}

// The records are encoded on one thread and written on another (a bounded
// queue of batches between them): many batches' worth arrive whole and in
// order, and an encoder's refusal fails the build without leaving files.
TEST(IndexTest, BuildsManyBatchesOfRecordsAndRefusesABadChecksum) {
  TempDir t;
  Checkpoint ck = Tiny(t.path());
  constexpr uint64_t kSums = 50000;  // ~12 batches of the queue
  for (uint64_t i = 0; i < kSums; ++i)
    ck.checksums.Add(ChecksumRange{FileId{0}, (kSums - 1 - i) * 4, 4, static_cast<uint32_t>(i), "e"});
  constexpr size_t kTensors = 20000;
  for (size_t i = 0; i < kTensors; ++i) {
    TensorRecord r = ck.tensors[0];
    r.key = "many." + std::to_string(i);
    ck.AddTensor(std::move(r), ck.fragments.Get(i % 3));
  }
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok()) << ix.status().message();
  ASSERT_EQ((*ix)->tensors().size(), 3 + kTensors);
  EXPECT_EQ((*ix)->tensors().back().key, "many." + std::to_string(kTensors - 1));
  EXPECT_EQ((*ix)->num_fragments(), 2 * (3 + kTensors));
  auto fr = (*ix)->Fragments(TensorId{static_cast<uint32_t>(3 + kTensors - 1)});
  ASSERT_TRUE(fr.ok());
  EXPECT_EQ((*fr)[1].data_offset, ck.fragments.Get((kTensors - 1) % 3)[1].data_offset);
  uint64_t n = 0, next = 0;
  ASSERT_TRUE((*ix)
                  ->ScanChecksums(1000,
                                  [&](std::vector<ChecksumRange>& v) {
                                    for (const auto& c : v) {
                                      EXPECT_EQ(c.offset, next);
                                      EXPECT_EQ(c.crc32, kSums - 1 - next / 4);
                                      next += 4;
                                      ++n;
                                    }
                                    return Status::Ok();
                                  })
                  .ok());
  EXPECT_EQ(n, kSums);

  ck.checksums.Add(ChecksumRange{FileId{9}, 0, 4, 0, "nowhere"});  // sorts after every file-0 range
  Status refused = Index::Build(ck, t.path() + "/ix2");
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("a checksum names an unknown file"), std::string::npos) << refused.message();
  EXPECT_FALSE(fs::exists(t.path() + "/ix2"));
  EXPECT_FALSE(fs::exists(t.path() + "/ix2.tmp." + std::to_string(::getpid())));
  EXPECT_FALSE(fs::exists(t.path() + "/ix2.tmp." + std::to_string(::getpid()) + ".sst"));
}

TEST(IndexTest, StaleSourceIsRefusedAndRebuilt) {
  TempDir t;
  Checkpoint ck = Tiny(t.path());
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ckptfs::testing::WriteFile(t.path() + "/a.bin", std::string(64, 'y'));  // same size, new mtime
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_FALSE(ix.ok());
  EXPECT_EQ(ix.status().code(), Code::kStale);
  EXPECT_NE(ix.status().message().find("a.bin"), std::string::npos);
  fs::remove(t.path() + "/a.bin");
  EXPECT_NE(Index::Open(t.path() + "/ix", t.path()).status().message().find("disappeared"), std::string::npos);
}

TEST(IndexTest, RebuildReplacesAtomically) {
  TempDir t;
  Checkpoint ck = Tiny(t.path());
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  ck.info.step = 8;
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  EXPECT_EQ((*ix)->info().step, 8);
  for (const auto& e : fs::directory_iterator(t.path())) {
    EXPECT_EQ(e.path().filename().string().find(".old."), std::string::npos);
  }
}

TEST(IndexTest, OpenOrBuildOnRealDcpAndDefaultLocation) {
  TempDir t;
  std::string src = t.path() + "/ck";
  fs::copy(std::string(CKPTFS_TEST_DATA) + "/dcp_single", src, fs::copy_options::recursive);
  EXPECT_EQ(DefaultIndexDir(src), src + "/.ckptfs/index");
  auto r = OpenOrBuild(src, "");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->built);
  r->index.reset();
  auto again = OpenOrBuild(src, "");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->built);
  // Touch .metadata: the next open rebuilds and says why.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::string m = ckptfs::testing::ReadFile(src + "/.metadata");
  ckptfs::testing::WriteFile(src + "/.metadata", m);
  again->index.reset();
  auto third = OpenOrBuild(src, "");
  ASSERT_TRUE(third.ok());
  EXPECT_TRUE(third->built);
  EXPECT_NE(third->why_rebuilt.find(".metadata"), std::string::npos);
}

TEST(IndexTest, ConcurrentOpenOrBuildBuildsOnceAndEveryOneOpensIt) {
  // Several ranks of a node mount one checkpoint at once: one builds, the
  // others wait and open what it built (before the lock, two builds swapped the
  // directory under each other's open: "Mismatch in unique ID on table file").
  TempDir t;
  std::string src = t.path() + "/ck";
  fs::copy(std::string(CKPTFS_TEST_DATA) + "/dcp_single", src, fs::copy_options::recursive);
  constexpr int kOpeners = 6;
  std::vector<std::optional<Result<OpenResult>>> got(kOpeners);
  std::vector<std::thread> threads;
  for (int i = 0; i < kOpeners; ++i) threads.emplace_back([&, i] { got[i].emplace(OpenOrBuild(src, "")); });
  for (auto& th : threads) th.join();
  int built = 0;
  for (auto& r : got) {
    ASSERT_TRUE(r->ok()) << r->status().message();
    built += (*r)->built ? 1 : 0;
    ASSERT_TRUE((*r)->index->Fragments(TensorId{0}).ok());
  }
  EXPECT_EQ(built, 1);
  // A forced rebuild swaps the directory; an index opened before keeps reading.
  auto forced = OpenOrBuild(src, "", true);
  ASSERT_TRUE(forced.ok()) << forced.status().message();
  EXPECT_TRUE(forced->built);
  for (auto& r : got) EXPECT_TRUE((*r)->index->Fragments(TensorId{0}).ok());
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// A directory no family recognises gets nothing written into it or beside
// it: no .ckptfs/, no index, no index.lock (the default location, and an
// explicit one).
TEST(IndexTest, NothingIsWrittenForAnUnrecognisedDirectory) {
  ckptfs::testing::TempDir t;
  const std::string src = t.path() + "/notes";
  std::filesystem::create_directories(src);
  ckptfs::testing::WriteFile(src + "/README.txt", "not a checkpoint\n");
  auto r = OpenOrBuild(src, "", false);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot detect a checkpoint in " + src), std::string::npos);
  size_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(src)) {
    EXPECT_EQ(e.path().filename(), "README.txt") << e.path();
    ++n;
  }
  EXPECT_EQ(n, 1u);
  auto r2 = OpenOrBuild(src, t.path() + "/idx/index", false);
  ASSERT_FALSE(r2.ok());
  EXPECT_FALSE(std::filesystem::exists(t.path() + "/idx"));
}

}  // namespace
}  // namespace ckptfs
