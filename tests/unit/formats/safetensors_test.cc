// The safetensors header parser and the safetensors-directory reader, on
// shards torch's HuggingFaceStorageWriter wrote (tests/data/dcp_hf_sharded)
// and on damaged copies of them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "../test_util.h"
#include "formats/safetensors/safetensors_header.h"
#include "formats/safetensors/st_dir_reader.h"

namespace ckptfs::formats {
namespace {

namespace fs = std::filesystem;
using ckptfs::testing::ReadFile;
using ckptfs::testing::TempDir;
using ckptfs::testing::WriteFile;

const std::string kShards = std::string(CKPTFS_TEST_DATA) + "/dcp_hf_sharded";
const std::string kRank0 = "shard-00001-model-00001-of-00001.safetensors";
const std::string kRank1 = "shard-00002-model-00001-of-00001.safetensors";

Result<SafetensorsHeader> Parse(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return NotFound(path);
  const uint64_t size = fs::file_size(path);
  auto h = ReadSafetensorsHeader(fd, 0, size, path);
  ::close(fd);
  return h;
}

// `bytes` with its header replaced by `header` (the data section kept).
std::string WithHeader(const std::string& bytes, const std::string& header) {
  const uint64_t n = LoadLE<uint64_t>(bytes.data());
  std::string out(8, '\0');
  const uint64_t m = header.size();
  std::memcpy(out.data(), &m, 8);
  return out + header + bytes.substr(8 + n);
}

std::string HeaderOf(const std::string& bytes) { return bytes.substr(8, LoadLE<uint64_t>(bytes.data())); }

TEST(SafetensorsHeaderTest, ReadsTorchShards) {
  auto h = Parse(kShards + "/" + kRank1);
  ASSERT_TRUE(h.ok()) << h.status().message();
  EXPECT_EQ(h->entries.size(), 6u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  auto sharding = DcpShardingInfo(*h, kRank1);
  ASSERT_TRUE(sharding.ok()) << sharding.status().message();
  EXPECT_EQ(sharding->at("embed.weight"), (std::vector<int64_t>{7, 0}));  // rank 1: rows 7..12 of 13
  for (const auto& e : h->entries) {
    EXPECT_EQ(e.dtype, DType::kF32);
    EXPECT_GE(e.begin, h->data_start);
    EXPECT_LE(e.end, fs::file_size(kShards + "/" + kRank1));
  }
}

TEST(SafetensorsHeaderTest, RefusesDamageWithTheFileAndReason) {
  TempDir t;
  const std::string good = ReadFile(kShards + "/" + kRank1);
  const std::string p = t.path() + "/x.safetensors";
  auto expect = [&](const std::string& bytes, const std::string& want) {
    WriteFile(p, bytes);
    auto h = Parse(p);
    ASSERT_FALSE(h.ok()) << want;
    EXPECT_NE(h.status().message().find(p), std::string::npos) << h.status().message();
    EXPECT_NE(h.status().message().find(want), std::string::npos) << h.status().message();
  };
  expect(good.substr(0, 5), "shorter than a safetensors header length");
  expect(good.substr(0, good.size() / 4), "passes the end of the data");
  std::string huge = good;
  const uint64_t big = uint64_t{1} << 40;
  std::memcpy(huge.data(), &big, 8);
  expect(huge, "more than the format's limit");
  expect(good.substr(0, good.size() - 16), "lie outside the");
  std::string h = HeaderOf(good);
  expect(WithHeader(good, "[1, 2]"), "not a JSON object");
  expect(WithHeader(good, h.substr(0, h.rfind('}'))), "not a JSON object");  // (the header is space-padded)
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string x = h;
    size_t at = x.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return x.replace(at, from.size(), to);
  };
  expect(WithHeader(good, replace("\"F32\"", "\"Q7\"")), "has dtype \"Q7\"");
  expect(WithHeader(good, replace("\"shape\":[6,6]", "\"shape\":[-6,6]")), "not a count");
  expect(WithHeader(good, replace("\"shape\":[6,6]", "\"shape\":[7,6]")), "data_offsets give");
  expect(WithHeader(good, replace("\"shape\":[6,6]", "\"shape\":[4611686018427387904,4611686018427387904]")),
         "shape overflows");
  expect(WithHeader(good, replace("\"data_offsets\":[", "\"data_offsets\":[99999999,")), "not [begin, end]");
  expect(WithHeader(good, replace("\"format\":\"pt\"", "\"format\":7")), "is not a string");
}

TEST(SafetensorsDirTest, ShardsMergeToGlobalTensors) {
  ASSERT_TRUE(LooksLikeSafetensorsDir(kShards));
  auto ck = ReadSafetensorsDir(kShards);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->info.family, Family::kSafetensors);
  EXPECT_EQ(ck->info.world_size, 2u);
  ASSERT_EQ(ck->tensors.size(), 6u);
  for (size_t i = 0; i < ck->tensors.size(); ++i) {
    const TensorRecord& t = ck->tensors[i];
    EXPECT_TRUE(t.error.empty()) << t.error;
    EXPECT_EQ(t.role, Role::kParam);
    EXPECT_EQ(ck->fragments.Count(i), 2u) << t.key;
    if (t.key == "embed.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{13, 6}));
    } else if (t.key == "norm.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{7}));
    }
  }
}

TEST(SafetensorsDirTest, OverlappingShardsAreRefusedPerTensor) {
  TempDir t;
  const std::string d = t.path() + "/ck";
  fs::copy(kShards, d);
  // Rank 1 claims rank 0's rows of embed.weight: an overlap and a hole.
  const std::string good = ReadFile(d + "/" + kRank1);
  std::string h = HeaderOf(good);
  const std::string from = "\\\"embed.weight\\\": {\\\"saved_offsets\\\": [7, 0]}";
  const size_t at = h.find(from);
  ASSERT_NE(at, std::string::npos) << h;
  h.replace(at, from.size(), "\\\"embed.weight\\\": {\\\"saved_offsets\\\": [1, 0]}");
  WriteFile(d + "/" + kRank1, WithHeader(good, h));
  auto ck = ReadSafetensorsDir(d);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  for (const TensorRecord& r : ck->tensors) {
    if (r.key == "embed.weight") {
      EXPECT_NE(r.error.find("embed.weight"), std::string::npos) << r.error;
      EXPECT_FALSE(r.error.empty());
    } else {
      EXPECT_TRUE(r.error.empty()) << r.error;
    }
  }
}

}  // namespace
}  // namespace ckptfs::formats
