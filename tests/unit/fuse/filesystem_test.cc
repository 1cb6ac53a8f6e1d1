// The FUSE-free core driven directly: tree, sizes, reads, errors.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "ckptfs/fs.h"
#include "common/float_bits.h"

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

// The Python package's read: a tensor (or a box of it) without a path, the
// same bytes as its params/ file; every argument checked before any I/O.
TEST_F(FilesystemTest, ReadTensorServesTheFileBytesAndChecksItsArguments) {
  const auto& ts = fs_->index().tensors();
  auto find = [&](std::string_view fqn, std::string_view state) {
    for (uint32_t i = 0; i < ts.size(); ++i) {
      if (ts[i].fqn == fqn && ts[i].state == state) return TensorId{i};
    }
    ADD_FAILURE() << fqn;
    return TensorId{0};
  };
  const TensorId w = find("proj.weight", "param");  // float32 [10, 6]
  std::string raw = ReadAll("params/proj.weight/param.raw");
  std::string got(raw.size(), '\0');
  ASSERT_TRUE(fs_->ReadTensor(w, DType::kF32, nullptr, got.data(), got.size()).ok());
  EXPECT_EQ(got, raw);
  // Rows 2..4, columns 1..3: element (r, c) of the file at r*6 + c.
  Box box{{2, 1}, {3, 3}};
  std::string sub(9 * 4, '\0');
  ASSERT_TRUE(fs_->ReadTensor(w, DType::kF32, &box, sub.data(), sub.size()).ok());
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(sub.substr(r * 12, 12), raw.substr(((2 + r) * 6 + 1) * 4, 12)) << r;
  }
  // bf16 widens to float32 exactly as the .npy does.
  const TensorId bf = find("extra.bf16", "");
  std::string npy = ReadAll("other/extra.bf16.npy");
  std::string wide(24 * 4, '\0');
  ASSERT_TRUE(fs_->ReadTensor(bf, DType::kF32, nullptr, wide.data(), wide.size()).ok());
  EXPECT_EQ(wide, npy.substr(npy.size() - wide.size()));

  auto code = [&](TensorId id, DType d, const Box* b, size_t len) {
    std::string buf(len, '\0');
    return fs_->ReadTensor(id, d, b, buf.data(), len);
  };
  Box outside{{8, 0}, {3, 6}}, rank1{{0}, {10}}, negative{{-1, 0}, {1, 6}};
  EXPECT_EQ(code(w, DType::kF32, &outside, 18 * 4).code(), Code::kInvalid);
  EXPECT_EQ(code(w, DType::kF32, &rank1, 10 * 4).code(), Code::kInvalid);
  EXPECT_EQ(code(w, DType::kF32, &negative, 6 * 4).code(), Code::kInvalid);
  EXPECT_EQ(code(w, DType::kF32, nullptr, raw.size() - 4).code(), Code::kInvalid);  // a short buffer
  // float32 narrows to bfloat16 with round to nearest even; to int32 it does not convert.
  std::string half(raw.size() / 2, '\0');
  ASSERT_TRUE(fs_->ReadTensor(w, DType::kBF16, nullptr, half.data(), half.size()).ok());
  for (size_t i = 0; i < raw.size() / 4; ++i) {
    uint32_t f;
    uint16_t b;
    std::memcpy(&f, raw.data() + 4 * i, 4);
    std::memcpy(&b, half.data() + 2 * i, 2);
    EXPECT_EQ(b, FloatBitsToBFloat16Bits(f)) << i;
  }
  Status other = code(w, DType::kI32, nullptr, raw.size());
  EXPECT_EQ(other.code(), Code::kInvalid);
  EXPECT_NE(other.message().find("cannot render float32 as int32"), std::string::npos) << other.message();
  EXPECT_EQ(code(find("lr_scheduler.last_epoch", ""), DType::kU8, nullptr, 1).code(), Code::kInvalid);  // a blob
  EXPECT_EQ(code(TensorId{static_cast<uint32_t>(ts.size())}, DType::kF32, nullptr, 4).code(), Code::kNotFound);
}

// Every file of the tree, read as mapped pieces (what a FUSE reply sends)
// where the core offers them: the same bytes as Read, at odd offsets and
// sizes (a 37-byte step starts and ends inside widened elements); params/
// tensors are offered, and so is the bf16 tensor widened in its .npy
// (converted from the mapping); `mapped_reads = false` offers none.
TEST_F(FilesystemTest, MappedReadsServeTheSameBytes) {
  const bool guard = InstallSigbusGuard().ok();  // not in a ThreadSanitizer build: the engine converts
  std::vector<std::pair<std::string, uint64_t>> files;
  std::vector<std::pair<std::string, uint64_t>> dirs = {{"", kRootIno}};
  while (!dirs.empty()) {
    auto [path, ino] = dirs.back();
    dirs.pop_back();
    for (auto& [name, child, is_dir] : fs_->view().List(ino)) {
      if (path.empty() && name == ".ckptfs") continue;  // report.json runs verify; stats change
      (is_dir ? dirs : files).emplace_back(path + (path.empty() ? "" : "/") + name, child);
    }
  }
  MappedRead r;
  int mapped_files = 0;
  for (const auto& [path, ino] : files) {
    const std::string want = ReadAll(path);
    bool any = false;
    for (uint64_t step : {uint64_t{37}, uint64_t{4096}, uint64_t{1} << 20}) {
      for (uint64_t off = 0; off < want.size(); off += step) {
        if (!fs_->ReadMapped(ino, off, step, 1000, &r)) continue;
        any = true;
        std::string got;
        for (const iovec& p : r.bytes.pieces) got.append(static_cast<const char*>(p.iov_base), p.iov_len);
        ASSERT_EQ(got, want.substr(off, step)) << path << " @ " << off;
      }
    }
    if (any) ++mapped_files;
    if ((path.starts_with("params/") || (guard && path == "other/extra.bf16.npy")) && path.ends_with(".npy") &&
        !want.empty()) {
      EXPECT_TRUE(any) << path;
    }
  }
  EXPECT_GT(mapped_files, 10);
  const auto stats = nlohmann::json::parse(fs_->StatsJson());
  EXPECT_GT(stats["mapped_reads"].get<uint64_t>(), 10u);
  EXPECT_EQ(stats["mapped_conversions"].get<uint64_t>() > 0, guard);
  FsOptions o;
  o.src = src_;
  o.index_dir = tmp_.path() + "/index";
  o.mapped_reads = false;
  auto off = Filesystem::Open(o);
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_FALSE((*off)->ReadMapped(*fs_->view().Resolve("params/proj.weight/param.npy"), 0, 4096, 1000, &r));
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

// .ckptfs/stats is read like /proc: size 0, fresh bytes at each read from
// offset 0, and no checkpoint I/O of its own.
nlohmann::json ReadStats(Filesystem& fs) {
  auto ino = fs.view().Resolve(".ckptfs/stats");
  EXPECT_TRUE(ino.ok());
  EXPECT_TRUE(fs.OpenFile(*ino).ok());
  std::string out;
  char buf[64];  // in pieces: later pieces continue the snapshot taken at offset 0
  for (;;) {
    auto n = fs.Read(*ino, out.size(), sizeof(buf), buf);
    EXPECT_TRUE(n.ok()) << n.status().message();
    if (!n.ok() || *n == 0) break;
    out.append(buf, *n);
  }
  return nlohmann::json::parse(out);
}

TEST_F(FilesystemTest, StatsCountReadsWithoutReadingTheCheckpoint) {
  auto ino = fs_->view().Resolve(".ckptfs/stats");
  ASSERT_TRUE(ino.ok());
  auto a = fs_->GetAttr(*ino);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size, 0u);
  EXPECT_TRUE(a->dynamic);
  EXPECT_TRUE(fs_->Dynamic(*ino));

  nlohmann::json s0 = ReadStats(*fs_);
  EXPECT_EQ(s0["reads"], 0);
  EXPECT_EQ(s0["bytes"], 0);
  EXPECT_EQ(s0["errors"], 0);
  EXPECT_EQ(s0["source_bytes_read"], 0);
  EXPECT_EQ(s0["report_made"], false);
  EXPECT_EQ(s0["read_latency_us"]["count"], 0);
  EXPECT_EQ(s0["engine"], fs_->engine_name());
  EXPECT_EQ(s0["transforms"], fs_->transforms_name());
  EXPECT_GE(s0["uptime_s"].get<double>(), 0.0);

  // Metadata operations count, and read nothing from the checkpoint.
  ASSERT_TRUE(fs_->Lookup(kRootIno, "params").ok());
  ASSERT_TRUE(fs_->GetAttr(*fs_->view().Resolve("params/proj.weight/param.npy")).ok());
  ASSERT_TRUE(fs_->ReadDir(kRootIno).ok());
  nlohmann::json s1 = ReadStats(*fs_);
  EXPECT_GE(s1["lookups"].get<uint64_t>(), 1u);
  EXPECT_GE(s1["getattrs"].get<uint64_t>(), s0["getattrs"].get<uint64_t>() + 1);
  EXPECT_EQ(s1["opens"].get<uint64_t>(), s0["opens"].get<uint64_t>() + 1);  // ReadStats opened it
  EXPECT_EQ(s1["source_bytes_read"], 0);

  std::string raw = ReadAll("params/proj.weight/param.raw");  // 240 bytes in reads of 37
  ASSERT_EQ(raw.size(), 240u);
  const uint64_t source = fs_->reader().source_bytes_read();
  EXPECT_GE(source, 240u);
  nlohmann::json s2 = ReadStats(*fs_);
  EXPECT_EQ(s2["reads"], 7);  // ceil(240 / 37)
  EXPECT_EQ(s2["bytes"], 240);
  EXPECT_EQ(s2["source_bytes_read"], source);
  EXPECT_GE(s2["source_reads"].get<uint64_t>(), 7u);
  EXPECT_EQ(s2["read_latency_us"]["count"], 7);
  const double p50 = s2["read_latency_us"]["p50"], p99 = s2["read_latency_us"]["p99"];
  const double mx = s2["read_latency_us"]["max"];
  EXPECT_GT(mx, 0.0);
  EXPECT_LE(p50, p99);
  EXPECT_LE(p99, mx);
  const TensorReader::TransformCounts tc = fs_->reader().transform_counts();
  EXPECT_EQ(s2["cpu_plans"], tc.cpu_plans);
  EXPECT_EQ(s2["gpu_plans"], tc.gpu_plans);
  EXPECT_EQ(s2["gpu_fallbacks"], tc.gpu_fallbacks);
  // Reading the stats again moves none of the read counters.
  nlohmann::json s3 = ReadStats(*fs_);
  EXPECT_EQ(s3["reads"], s2["reads"]);
  EXPECT_EQ(s3["bytes"], s2["bytes"]);
  EXPECT_EQ(s3["source_bytes_read"], s2["source_bytes_read"]);
  EXPECT_EQ(fs_->reader().source_bytes_read(), source);
  EXPECT_EQ(s3["report_made"], false);
}

TEST_F(FilesystemTest, StatsCountFailedOpensAndReads) {
  auto ino = fs_->view().Resolve("params/proj.weight/param.raw");
  ASSERT_TRUE(fs_->OpenFile(*ino).ok());
  std::string d = ckptfs::testing::ReadFile(src_ + "/__0_0.distcp");
  ckptfs::testing::WriteFile(src_ + "/__0_0.distcp", d + "junk");
  EXPECT_FALSE(fs_->OpenFile(*ino).ok());
  char buf[16];
  EXPECT_FALSE(fs_->Read(*ino, 0, sizeof(buf), buf).ok());
  EXPECT_EQ(fs_->errors(), 2u);
  EXPECT_EQ(ReadStats(*fs_)["errors"], 2);
  EXPECT_EQ(fs_->reads(), 0u);  // a failed read is an error, not a read served
}

// Named in README.txt and found by name, but not listed: `diff -r` of two
// mounts must not meet counters that differ.
TEST_F(FilesystemTest, StatsAreDocumentedAndOpenedByNameButNotListed) {
  EXPECT_NE(ReadAll("README.txt").find(".ckptfs/stats"), std::string::npos);
  auto meta = fs_->view().Resolve(".ckptfs");
  ASSERT_TRUE(meta.ok());
  auto a = fs_->Lookup(*meta, "stats");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size, 0u);
  auto entries = fs_->ReadDir(*meta);
  ASSERT_TRUE(entries.ok());
  std::vector<std::string> names;
  for (const DirEntry& e : *entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{".", "..", "report.json"}));
}

// FUSE listings page through a directory by offset, with no open handle: any
// page size walks the entries ReadDir lists. topo/, which grows while mounted,
// adds an entry after every offset already handed out (a new name that sorts
// first must not shift the next page onto an entry listed already), and its
// mtime moves on so the kernel drops a cached listing.
TEST_F(FilesystemTest, ListingPagesResumeAtOffsetsAndTopoGrowsAtTheEnd) {
  for (const char* dir : {"", "params", "params/proj.weight", "other", ".ckptfs"}) {
    auto ino = fs_->view().Resolve(dir);
    ASSERT_TRUE(ino.ok()) << dir;
    auto whole = fs_->ReadDir(*ino);
    ASSERT_TRUE(whole.ok());
    std::vector<std::string> want;
    for (const DirEntry& e : *whole) want.push_back(e.name);
    for (size_t max : {1, 2, 3, 7, 1000}) {
      std::vector<std::string> got;
      uint64_t off = 0;
      for (size_t pages = 0; pages <= want.size(); ++pages) {
        auto page = fs_->ReadDirPage(*ino, off, max);
        ASSERT_TRUE(page.ok()) << page.status().message();
        ASSERT_LE(page->size(), max);
        if (page->empty()) break;
        for (const DirEntry& e : *page) {
          EXPECT_GT(e.next, off);
          off = e.next;
          got.push_back(e.name);
        }
      }
      EXPECT_EQ(got, want) << "'" << dir << "' in pages of " << max;
    }
  }
  auto file = fs_->view().Resolve("README.txt");
  EXPECT_EQ(fs_->ReadDirPage(*file, 0, 10).status().code(), Code::kInvalid);
  EXPECT_EQ(ToErrno(fs_->ReadDirPage(1u << 30, 0, 10).status()), ENOENT);

  auto topo = fs_->view().Resolve("topo");
  ASSERT_TRUE(topo.ok());
  ASSERT_TRUE(fs_->Lookup(*topo, "tp2-pp1").ok());  // before any listing: the mtime stays
  auto before = fs_->GetAttr(*topo);
  EXPECT_EQ(before->mtime_ns, fs_->GetAttr(kRootIno)->mtime_ns);
  auto first = fs_->ReadDirPage(*topo, 0, 4);
  ASSERT_TRUE(first.ok());
  std::vector<std::string> names;
  for (const DirEntry& e : *first) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{".", "..", "ERRORS", "tp2-pp1"}));
  ASSERT_TRUE(fs_->Lookup(*topo, "tp1-pp1").ok());  // sorts before tp2-pp1
  EXPECT_GT(fs_->GetAttr(*topo)->mtime_ns, before->mtime_ns);
  auto rest = fs_->ReadDirPage(*topo, first->back().next, 10);
  ASSERT_TRUE(rest.ok());
  ASSERT_EQ(rest->size(), 1u);
  EXPECT_EQ((*rest)[0].name, "tp1-pp1");
  auto sorted = fs_->ReadDir(*topo);
  names.clear();
  for (const DirEntry& e : *sorted) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{".", "..", "ERRORS", "tp1-pp1", "tp2-pp1"}));
}

TEST(LatencyHistogramTest, PercentilesAreBucketUpperEdgesCappedAtMax) {
  LatencyHistogram h;
  EXPECT_EQ(h.PercentileNs(0.5), 0u);
  for (int i = 0; i < 90; ++i) h.Record(1000);    // bucket [512, 1024)
  for (int i = 0; i < 9; ++i) h.Record(100'000);  // bucket [65536, 131072)
  h.Record(5'000'000);
  EXPECT_EQ(h.count(), 100u);
  EXPECT_EQ(h.max_ns(), 5'000'000u);
  EXPECT_EQ(h.PercentileNs(0.5), 1023u);
  EXPECT_EQ(h.PercentileNs(0.9), 1023u);
  EXPECT_EQ(h.PercentileNs(0.91), 131071u);
  EXPECT_EQ(h.PercentileNs(0.99), 131071u);
  EXPECT_EQ(h.PercentileNs(1.0), 5'000'000u);  // its bucket's edge (8388607) capped at the max
  h.Record(0);
  EXPECT_EQ(h.count(), 101u);
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
