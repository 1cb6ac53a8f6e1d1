// The Orbax family: the OCDBT reader against tensorstore's own listing of
// real orbax saves (tests/data/orbax, ts_listing.json), hostile databases
// built here byte by byte, zarr v3 shard indexes, and the reader's handling
// of CheckpointManager roots, unfinished steps and damaged copies.
#include <gtest/gtest.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "ckptfs/formats.h"
#include "common/crc32c.h"
#include "common/varint.h"
#include "formats/orbax/ocdbt.h"
#include "formats/orbax/orbax_reader.h"
#include "formats/orbax/orbax_tree.h"
#include "formats/orbax/zarr_arrays.h"

namespace ckptfs::formats::orbax {
namespace {

namespace fs = std::filesystem;
using ckptfs::testing::ReadFile;
using ckptfs::testing::TempDir;
using ckptfs::testing::WriteFile;
using json = nlohmann::json;

const std::string kData = std::string(CKPTFS_TEST_DATA) + "/orbax";

OcdbtFiles DirFiles(const std::string& dir) {
  OcdbtFiles io;
  io.size_of = [dir](const std::string& rel) -> Result<uint64_t> {
    std::error_code ec;
    const auto n = fs::file_size(dir + "/" + rel, ec);
    if (ec) return NotFound("cannot open " + rel);
    return static_cast<uint64_t>(n);
  };
  io.read = [dir](const std::string& rel, uint64_t off, uint64_t len) -> Result<std::string> {
    std::string all = ReadFile(dir + "/" + rel);
    if (off > all.size() || len > all.size() - off) return Invalid("short " + rel);
    return all.substr(off, len);
  };
  return io;
}

// An in-memory database: files by name.
struct MemDb {
  std::map<std::string, std::string> files;
  OcdbtFiles Io() {
    OcdbtFiles io;
    io.size_of = [this](const std::string& rel) -> Result<uint64_t> {
      auto it = files.find(rel);
      if (it == files.end()) return NotFound("cannot open " + rel);
      return static_cast<uint64_t>(it->second.size());
    };
    io.read = [this](const std::string& rel, uint64_t off, uint64_t len) -> Result<std::string> {
      const std::string& f = files.at(rel);
      if (off > f.size() || len > f.size() - off) return Invalid("short " + rel);
      return f.substr(off, len);
    };
    return io;
  }
};

// magic u32be | length u64le | version 0 | compression | body | crc32c u32le.
std::string Envelope(uint32_t magic, const std::string& body, bool zstd = false, bool bad_crc = false) {
  std::string payload = zstd ? std::string() : body;
  if (zstd) {
    payload.resize(ZSTD_compressBound(body.size()));
    payload.resize(ZSTD_compress(payload.data(), payload.size(), body.data(), body.size(), 1));
  }
  std::string out;
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<char>(magic >> (8 * i)));
  const uint64_t len = 4 + 8 + 2 + payload.size() + 4;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(len >> (8 * i)));
  out.push_back(0);
  out.push_back(zstd ? 1 : 0);
  out += payload;
  uint32_t crc = Crc32cUpdate(0, out.data(), out.size()) ^ (bad_crc ? 1u : 0u);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(crc >> (8 * i)));
  return out;
}

// A data file table of one file `path` whose base path is its first `base` bytes.
std::string OneFileTable(const std::string& path, size_t base) {
  std::string t;
  PutVarint(t, 1);
  PutVarint(t, path.size());
  PutVarint(t, base);
  return t + path;
}

// A leaf node of (key, inline value) entries.
std::string Leaf(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::string b(1, '\0');  // height 0
  PutVarint(b, 0);         // no data files
  PutVarint(b, kv.size());
  for (size_t i = 1; i < kv.size(); ++i) PutVarint(b, 0);
  for (const auto& [k, v] : kv) PutVarint(b, k.size());
  for (const auto& [k, v] : kv) b += k;
  for (const auto& [k, v] : kv) PutVarint(b, v.size());
  for (size_t i = 0; i < kv.size(); ++i) b.push_back(0);  // inline
  for (const auto& [k, v] : kv) b += v;
  return b;
}

// A single-file manifest whose one version's root is [off, +len) of `file`.
std::string Manifest(const std::string& file, uint64_t off, uint64_t len, uint64_t num_keys, uint8_t height = 0) {
  std::string b(16, 'u');
  b.push_back(0);         // manifest_kind single
  PutVarint(b, 1024);     // max_inline_value_bytes
  PutVarint(b, 1 << 20);  // max_decoded_node_bytes
  b.push_back(4);         // version_tree_arity_log2
  PutVarint(b, 0);        // no compression
  b += OneFileTable(file, 0);
  PutVarint(b, 1);  // one version
  PutVarint(b, 1);  // generation 1
  b.push_back(static_cast<char>(height));
  PutVarint(b, 0);  // data file id
  PutVarint(b, off);
  PutVarint(b, len);
  PutVarint(b, num_keys);
  PutVarint(b, len);
  PutVarint(b, 0);
  b += std::string(8, '\0');  // commit time
  PutVarint(b, 0);            // no version-tree nodes
  return Envelope(kOcdbtManifestMagic, b);
}

MemDb OneLeafDb(const std::string& leaf_body, uint64_t num_keys, bool zstd = false) {
  MemDb db;
  db.files["d/node"] = Envelope(kOcdbtBtreeNodeMagic, leaf_body, zstd);
  db.files["manifest.ocdbt"] = Manifest("d/node", 0, db.files["d/node"].size(), num_keys);
  return db;
}

// --- Real saves: the same keys and value sizes as tensorstore lists.

class OcdbtListingTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OcdbtListingTest, SameKeysAndSizesAsTensorstore) {
  const std::string fixture = kData + "/" + GetParam();
  const json want = json::parse(ReadFile(fixture + "/ts_listing.json"));
  // The latest step's item directory.
  std::string item;
  for (const auto& step : fs::directory_iterator(fixture + "/ckpt")) {
    if (!step.is_directory() || step.path().filename().string().find("tmp") != std::string::npos) continue;
    for (const auto& it : fs::directory_iterator(step.path())) {
      if (fs::exists(it.path() / "manifest.ocdbt") && (item.empty() || it.path().string() > item)) {
        item = it.path().string();
      }
    }
  }
  ASSERT_FALSE(item.empty());
  auto listing = ReadOcdbt(DirFiles(item), "manifest.ocdbt");
  ASSERT_TRUE(listing.ok()) << listing.status().message();
  std::map<std::string, uint64_t> got;
  size_t inline_values = 0;
  for (const OcdbtValue& v : listing->values) {
    got[v.key] = v.length;
    if (v.is_inline) {
      ++inline_values;
      EXPECT_EQ(v.bytes.size(), v.length);
      EXPECT_LE(v.length, listing->config.max_inline_value_bytes);
    } else {
      EXPECT_TRUE(fs::exists(item + "/" + v.file)) << v.file;
      EXPECT_GT(v.length, listing->config.max_inline_value_bytes);
    }
  }
  std::map<std::string, uint64_t> expected;
  for (const auto& [k, size] : want.items()) expected[k] = size.get<uint64_t>();
  EXPECT_EQ(got, expected);
  EXPECT_EQ(listing->config.max_inline_value_bytes, 1024u);
  EXPECT_EQ(listing->config.compression, 1u);
  EXPECT_GT(listing->commit_time_ns, uint64_t{1700000000} * 1000000000);  // nanoseconds
  EXPECT_GT(inline_values, 0u);
}

INSTANTIATE_TEST_SUITE_P(RealSaves, OcdbtListingTest,
                         ::testing::Values("v0_f32", "v0_bf16", "v0_zarr3", "v1", "multiprocess", "v0_scan_bf16"));

TEST(OcdbtTest, MultiProcessRootPointsIntoEachProcessDatabase) {
  const std::string item = kData + "/multiprocess/ckpt/2/default";
  auto listing = ReadOcdbt(DirFiles(item), "manifest.ocdbt");
  ASSERT_TRUE(listing.ok()) << listing.status().message();
  std::set<std::string> dirs;
  for (const OcdbtValue& v : listing->values) {
    if (!v.is_inline) dirs.insert(v.file.substr(0, v.file.find('/')));
  }
  EXPECT_EQ(dirs, (std::set<std::string>{"ocdbt.process_0", "ocdbt.process_1"}));
  // Each process's own database is complete for its keys, too.
  auto p1 = ReadOcdbt(DirFiles(item + "/ocdbt.process_1"), "manifest.ocdbt");
  ASSERT_TRUE(p1.ok()) << p1.status().message();
  EXPECT_GT(p1->versions, 1u);  // generations of the batches it committed: only the latest is read
  EXPECT_LT(p1->values.size(), listing->values.size());
}

// --- Hostile databases.

TEST(OcdbtTest, SyntheticLeafReadsInlineValues) {
  MemDb db = OneLeafDb(Leaf({{"a/.zarray", "{}"}, {"a/0", "xyz"}, {"b", ""}}), 3, /*zstd=*/true);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_TRUE(l.ok()) << l.status().message();
  ASSERT_EQ(l->values.size(), 3u);
  EXPECT_EQ(l->values[1].key, "a/0");
  EXPECT_EQ(l->values[1].bytes, "xyz");
  EXPECT_TRUE(l->values[1].node_zstd);
}

TEST(OcdbtTest, DataFileOutsideTheDirectoryIsRefused) {
  MemDb db = OneLeafDb(Leaf({{"k", "v"}}), 1);
  db.files["manifest.ocdbt"] = Manifest("../../etc/passwd", 0, 10, 1);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("leaves the database directory"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("manifest.ocdbt"), std::string::npos);
  EXPECT_FALSE(SafeRelativePath("/abs"));
  EXPECT_FALSE(SafeRelativePath("d//x"));
  EXPECT_FALSE(SafeRelativePath("d/./x"));
  EXPECT_TRUE(SafeRelativePath("ocdbt.process_0/d/abc"));
}

TEST(OcdbtTest, NodePastTheEndOfItsFileIsRefused) {
  MemDb db = OneLeafDb(Leaf({{"k", "v"}}), 1);
  db.files["manifest.ocdbt"] = Manifest("d/node", 0, db.files["d/node"].size() + 100, 1);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("past its end"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("d/node"), std::string::npos);
}

TEST(OcdbtTest, EndlessVarintIsRefused) {
  std::string body(1, '\0');
  PutVarint(body, 0);
  body += std::string(20, '\xff');  // num_entries never ends
  MemDb db = OneLeafDb(body, 1);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("varint"), std::string::npos) << l.status().message();
}

TEST(OcdbtTest, KeyCountThatDoesNotFitIsRefused) {
  std::string body(1, '\0');
  PutVarint(body, 0);
  PutVarint(body, uint64_t{1} << 40);  // entries
  MemDb db = OneLeafDb(body, 1);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("num_entries"), std::string::npos) << l.status().message();
}

TEST(OcdbtTest, NodeDecompressingPastTheBoundIsRefused) {
  std::string body = Leaf({{"k", std::string(4 << 20, 'z')}});  // 4 MiB of one byte: a tiny zstd frame
  MemDb db = OneLeafDb(body, 1, /*zstd=*/true);
  EXPECT_LT(db.files["d/node"].size(), 4096u);
  OcdbtLimits limits;
  limits.max_decoded_node_bytes = 1 << 20;
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt", limits);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("d/node"), std::string::npos) << l.status().message();
}

TEST(OcdbtTest, ChecksumAndMagicAndKeyCountAreChecked) {
  MemDb db = OneLeafDb(Leaf({{"k", "v"}}), 1);
  db.files["d/node"] = Envelope(kOcdbtBtreeNodeMagic, Leaf({{"k", "v"}}), false, /*bad_crc=*/true);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("CRC-32C"), std::string::npos) << l.status().message();

  db = OneLeafDb(Leaf({{"k", "v"}}), 1);
  db.files["d/node"] = Envelope(kOcdbtManifestMagic, Leaf({{"k", "v"}}));
  l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("magic"), std::string::npos) << l.status().message();

  db = OneLeafDb(Leaf({{"k", "v"}}), 7);  // the manifest says 7 keys, the tree holds 1
  l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("7 keys"), std::string::npos) << l.status().message();

  // Keys out of order, and a node whose height is not what its parent says.
  db = OneLeafDb(Leaf({{"b", "1"}, {"a", "2"}}), 2);
  EXPECT_FALSE(ReadOcdbt(db.Io(), "manifest.ocdbt").ok());
  db = OneLeafDb(Leaf({{"k", "v"}}), 1);
  db.files["manifest.ocdbt"] = Manifest("d/node", 0, db.files["d/node"].size(), 1, /*height=*/1);
  l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("height"), std::string::npos) << l.status().message();
}

TEST(OcdbtTest, ANodeReferencedTwiceIsRefused) {
  // An interior root whose two children are the same leaf: a DAG, whose
  // repeated references would make the work exponential in the height.
  const std::string leaf = Envelope(kOcdbtBtreeNodeMagic, Leaf({{"k", "v"}}));
  std::string b(1, '\1');  // height 1
  b += OneFileTable("d/leaf", 0);
  PutVarint(b, 2);  // entries
  PutVarint(b, 0);  // key prefix of entry 1
  PutVarint(b, 1);  // key suffix lengths
  PutVarint(b, 1);
  PutVarint(b, 0);  // subtree common prefixes
  PutVarint(b, 0);
  b += "ab";
  for (int i = 0; i < 2; ++i) PutVarint(b, 0);  // data file ids
  for (int i = 0; i < 2; ++i) PutVarint(b, 0);  // offsets
  for (int i = 0; i < 2; ++i) PutVarint(b, leaf.size());
  for (int i = 0; i < 2; ++i) PutVarint(b, 1);  // num_keys
  for (int i = 0; i < 2; ++i) PutVarint(b, leaf.size());
  for (int i = 0; i < 2; ++i) PutVarint(b, 0);
  MemDb db;
  db.files["d/leaf"] = leaf;
  db.files["d/root"] = Envelope(kOcdbtBtreeNodeMagic, b);
  db.files["manifest.ocdbt"] = Manifest("d/root", 0, db.files["d/root"].size(), 2, /*height=*/1);
  auto l = ReadOcdbt(db.Io(), "manifest.ocdbt");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("referenced twice"), std::string::npos) << l.status().message();
}

TEST(OcdbtTest, EveryTruncationOfARealDatabaseIsAnErrorNotACrash) {
  const std::string item = kData + "/v0_bf16/ckpt/2/default";
  const std::string manifest = ReadFile(item + "/manifest.ocdbt");
  for (size_t n = 0; n < manifest.size(); n += 7) {
    MemDb db;
    db.files["manifest.ocdbt"] = manifest.substr(0, n);
    EXPECT_FALSE(ReadOcdbt(db.Io(), "manifest.ocdbt").ok()) << n;
  }
}

// --- zarr v3 shards.

TEST(ZarrArraysTest, ShardIndexChecksAndBounds) {
  auto a = ParseZarrMetadata(
      R"({"chunk_grid":{"configuration":{"chunk_shape":[4]},"name":"regular"},"chunk_key_encoding":{"name":"default"},
          "codecs":[{"configuration":{"chunk_shape":[4],"codecs":[{"configuration":{"endian":"little"},"name":"bytes"},
          {"configuration":{"checksum":false,"level":3},"name":"zstd"}],"index_codecs":[{"configuration":{"endian":"little"},
          "name":"bytes"},{"name":"crc32c"}]},"name":"sharding_indexed"}],"data_type":"bfloat16","fill_value":0.0,
          "node_type":"array","shape":[32],"zarr_format":3})");
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->dtype, DType::kBF16);
  EXPECT_TRUE(a->sharded && a->zstd && a->index_crc);
  EXPECT_EQ(a->ChunkKey({7}), "c/7");
  EXPECT_EQ(a->ShardIndexBytes(), 20u);
  auto index = [](uint64_t off, uint64_t n, bool bad_crc) {
    std::string s;
    for (uint64_t v : {off, n}) {
      for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
    }
    const uint32_t crc = Crc32cUpdate(0, s.data(), s.size()) ^ (bad_crc ? 1u : 0u);
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(crc >> (8 * i)));
    return s;
  };
  auto ok = DecodeShardIndex(*a, index(0, 25, false), 45);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ((*ok)[0].nbytes, 25u);
  // A chunk longer than the shard holds, and a damaged index.
  auto past = DecodeShardIndex(*a, index(0, 26, false), 45);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("outside the shard"), std::string::npos) << past.status().message();
  EXPECT_FALSE(DecodeShardIndex(*a, index(0, 25, true), 45).ok());
  auto empty = DecodeShardIndex(*a, index(UINT64_MAX, UINT64_MAX, false), 20);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE((*empty)[0].absent);
  // What the reader refuses, saying what.
  auto v2 =
      ParseZarrMetadata(R"({"chunks":[4],"compressor":{"id":"blosc"},"dtype":"<f4","shape":[8],"zarr_format":2})");
  ASSERT_FALSE(v2.ok());
  EXPECT_NE(v2.status().message().find("blosc"), std::string::npos);
  EXPECT_FALSE(ParseZarrMetadata(R"({"chunks":[0],"dtype":"<f4","shape":[8],"zarr_format":2})").ok());
  EXPECT_FALSE(ParseZarrMetadata(R"({"chunks":[4],"dtype":">f4","shape":[8],"zarr_format":2})").ok());
}

// --- The reader on copies of real saves.

std::string CopyFixture(const TempDir& tmp, const std::string& name) {
  const std::string dst = tmp.path() + "/" + name;
  fs::copy(kData + "/" + name + "/ckpt", dst, fs::copy_options::recursive);
  return dst;
}

TEST(OrbaxReaderTest, RootReadsTheLatestFinishedStep) {
  TempDir tmp;
  const std::string root = CopyFixture(tmp, "tmp_step");
  ASSERT_TRUE(fs::exists(root + "/3.orbax-checkpoint-tmp"));
  auto ck = ReadCheckpoint(root);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->info.family, Family::kOrbax);
  EXPECT_EQ(ck->info.step, 2);
  bool noted = false;
  for (const std::string& p : ck->info.problems) noted |= p.find("3.orbax-checkpoint-tmp") != std::string::npos;
  EXPECT_TRUE(noted);
  for (const SourceFile& f : ck->files) EXPECT_EQ(f.rel_path.find("3.orbax"), std::string::npos) << f.rel_path;

  // Only the unfinished step, or the unfinished step itself (or its item):
  // not recognised, so nothing is ever written into them.
  const std::string only = tmp.path() + "/only_tmp";
  fs::create_directories(only);
  fs::rename(root + "/3.orbax-checkpoint-tmp", only + "/3.orbax-checkpoint-tmp");
  for (const std::string& d : {only, only + "/3.orbax-checkpoint-tmp", only + "/3.orbax-checkpoint-tmp/default/"}) {
    EXPECT_FALSE(Recognise(d).ok()) << d;
    auto none = ReadCheckpoint(d);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.status().message().find("orbax-checkpoint-tmp saves are never read"), std::string::npos)
        << none.status().message();
  }
  // An item directory's step is its step directory's number.
  auto item = ReadCheckpoint(root + "/2/default");
  ASSERT_TRUE(item.ok()) << item.status().message();
  EXPECT_EQ(item->info.step, 2);
}

TEST(OrbaxReaderTest, TreeFollowsTheProjectConventions) {
  TempDir tmp;
  const std::string root = CopyFixture(tmp, "v0_f32");
  auto ck = ReadCheckpoint(root);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  std::map<std::string, const TensorRecord*> by_key;
  for (const TensorRecord& t : ck->tensors) by_key[t.key] = &t;
  const TensorRecord* w = by_key.at("params.layers.layers_0.attention.wq");
  EXPECT_EQ(w->role, Role::kParam);
  EXPECT_EQ(w->fqn, "layers.layers_0.attention.wq");
  EXPECT_EQ(w->num_fragments, 8u);  // one per shard of the 2x4 mesh
  // topo/'s split from the PartitionSpec: P("data", "model") -> dim 1 over "model";
  // P("model", "data") -> dim 0; P() -> replicated.
  EXPECT_EQ(w->split.kind, SplitKind::kDim);
  EXPECT_EQ(w->split.dim, 1);
  EXPECT_EQ(by_key.at("params.layers.layers_0.attention.wo")->split.dim, 0);
  EXPECT_EQ(by_key.at("opt_state.0.mu.layers.layers_0.attention.wq")->split.dim, 1);
  EXPECT_EQ(by_key.at("params.norm")->split.kind, SplitKind::kReplicate);
  const TensorRecord* mu = by_key.at("opt_state.0.mu.layers.layers_0.attention.wq");
  EXPECT_EQ(mu->role, Role::kOptimState);
  EXPECT_EQ(mu->fqn, "layers.layers_0.attention.wq");
  EXPECT_EQ(mu->state, "exp_avg");
  EXPECT_EQ(by_key.at("opt_state.0.nu.norm")->state, "exp_avg_sq");
  EXPECT_EQ(by_key.at("opt_state.0.count")->role, Role::kOther);
  EXPECT_EQ(by_key.at("params.norm")->num_fragments, 8u);  // replicated, split across the replicas
  EXPECT_TRUE(by_key.count("_sharding"));
  EXPECT_EQ(ck->info.step, 2);
  EXPECT_NE(ck->info.format_note.find("data=2 x model=4"), std::string::npos) << ck->info.format_note;

  std::vector<TensorRecord> flax(2);
  flax[0].encoding = flax[1].encoding = Encoding::kTensor;
  ClassifyPytree(flax, {{"params", "params", "decoder", "w"}, {"opt_state", "0", "mu", "params", "decoder", "w"}});
  EXPECT_EQ(flax[0].fqn, "decoder.w");
  EXPECT_EQ(flax[1].fqn, "decoder.w");
  EXPECT_EQ(flax[1].state, "exp_avg");
}

TEST(OrbaxReaderTest, DamageIsNamed) {
  TempDir tmp;
  // A truncated OCDBT data file: the database (or the arrays in it) fail naming it.
  const std::string root = CopyFixture(tmp, "v0_f32");
  const std::string d = root + "/2/default/d";
  std::string biggest;
  for (const auto& e : fs::directory_iterator(d)) {
    if (biggest.empty() || fs::file_size(e.path()) > fs::file_size(biggest)) biggest = e.path().string();
  }
  fs::resize_file(biggest, fs::file_size(biggest) / 2);
  auto ck = ReadCheckpoint(root);
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find(fs::path(biggest).filename().string()), std::string::npos)
      << ck.status().message();

  // A truncated data file of out-of-line values: the arrays there are
  // unreadable (named), the database and the other arrays are not.
  const std::string root2 = CopyFixture(tmp, "multiprocess");
  std::string values;
  for (const auto& e : fs::directory_iterator(root2 + "/2/default/ocdbt.process_0/d")) {
    if (values.empty() || fs::file_size(e.path()) > fs::file_size(values)) values = e.path().string();
  }
  fs::resize_file(values, 2000);
  auto ck3 = ReadCheckpoint(root2);
  ASSERT_TRUE(ck3.ok()) << ck3.status().message();
  size_t broken = 0, fine = 0;
  for (const TensorRecord& t : ck3->tensors) {
    if (t.error.empty()) {
      ++fine;
      continue;
    }
    ++broken;
    EXPECT_NE(t.error.find(fs::path(values).filename().string()), std::string::npos) << t.error;
    EXPECT_NE(t.error.find("truncated"), std::string::npos) << t.error;
  }
  EXPECT_GT(broken, 0u);
  EXPECT_GT(fine, broken);

  // A missing chunk file of a plain zarr array: a hole, flagged, other arrays served.
  const std::string plain = CopyFixture(tmp, "no_ocdbt_zarr2");
  fs::remove(plain + "/2/default/params.output/1.2");
  auto ck2 = ReadCheckpoint(plain);
  ASSERT_TRUE(ck2.ok()) << ck2.status().message();
  bool flagged = false;
  for (const Finding& f : ck2->info.findings) {
    flagged |= f.check == Check::kCoverage && f.message.find("params.output/1.2") != std::string::npos;
  }
  EXPECT_TRUE(flagged);

  // A shape that needs thousands of chunks the directory does not hold: refused
  // before the chunk loop, naming the array.
  const std::string zarray = plain + "/2/default/params.output/.zarray";
  std::string meta = ReadFile(zarray);
  const std::string shape = "\"shape\":[32,64]";
  const size_t at = meta.find(shape);
  ASSERT_NE(at, std::string::npos) << meta;
  meta.replace(at, shape.size(), "\"shape\":[3200,640]");
  WriteFile(zarray, meta);
  auto ck4 = ReadCheckpoint(plain);
  ASSERT_TRUE(ck4.ok()) << ck4.status().message();
  bool refused = false;
  for (const TensorRecord& t : ck4->tensors) {
    if (t.key == "params.output") refused = t.error.find("are stored") != std::string::npos;
  }
  EXPECT_TRUE(refused);
}

}  // namespace
}  // namespace ckptfs::formats::orbax
