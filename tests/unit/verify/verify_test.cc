// verify layer without a mount or a family reader: coverage geometry over
// random tilings, and Verify() over synthetic checkpoints whose defects are
// placed by hand (zeroed chunks judged against sibling states, layer gaps,
// missing files, NaN/Inf), plus findings surviving the index round trip.
#include "ckptfs/verify.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "../test_util.h"
#include "ckptfs/geometry.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

uint64_t Vol(const Box& b) {
  uint64_t v = 1;
  for (int64_t l : b.lengths) v *= static_cast<uint64_t>(l);
  return v;
}

// A random grid tiling of `shape`.
std::vector<Box> Tiling(const std::vector<int64_t>& shape, std::mt19937& rng) {
  std::vector<std::vector<int64_t>> cuts(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    cuts[d] = {0};
    for (int64_t x = 1; x < shape[d]; ++x) {
      if (rng() % 3 == 0) cuts[d].push_back(x);
    }
    cuts[d].push_back(shape[d]);
  }
  std::vector<Box> out = {Box{}};
  for (size_t d = 0; d < shape.size(); ++d) {
    std::vector<Box> next;
    for (const Box& b : out) {
      for (size_t k = 0; k + 1 < cuts[d].size(); ++k) {
        Box n = b;
        n.offsets.push_back(cuts[d][k]);
        n.lengths.push_back(cuts[d][k + 1] - cuts[d][k]);
        next.push_back(n);
      }
    }
    out = next;
  }
  return out;
}

TEST(CoverageTest, RandomTilingsAreCleanAndDefectsAreLocated) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<int64_t> shape(1 + rng() % 3);
    for (auto& s : shape) s = 1 + rng() % 7;
    std::vector<Box> boxes = Tiling(shape, rng);
    EXPECT_TRUE(AnalyzeCoverage(shape, boxes).clean());
    std::shuffle(boxes.begin(), boxes.end(), rng);
    EXPECT_TRUE(AnalyzeCoverage(shape, boxes).clean());

    // A dropped box is a hole of exactly its volume, and the holes lie inside it.
    const size_t victim = rng() % boxes.size();
    const Box gone = boxes[victim];
    std::vector<Box> holed = boxes;
    holed.erase(holed.begin() + static_cast<ptrdiff_t>(victim));
    Coverage c = AnalyzeCoverage(shape, holed, 1000);
    EXPECT_EQ(c.uncovered, Vol(gone));
    EXPECT_EQ(c.overlap_pairs, 0u);
    uint64_t listed = 0;
    for (const Box& h : c.holes) {
      listed += Vol(h);
      for (size_t d = 0; d < shape.size(); ++d) {
        EXPECT_GE(h.offsets[d], gone.offsets[d]);
        EXPECT_LE(h.offsets[d] + h.lengths[d], gone.offsets[d] + gone.lengths[d]);
      }
    }
    EXPECT_EQ(listed, Vol(gone));

    // A duplicated box overlaps with itself exactly.
    std::vector<Box> dup = boxes;
    dup.push_back(boxes[victim]);
    c = AnalyzeCoverage(shape, dup);
    EXPECT_EQ(c.uncovered, 0u);
    ASSERT_EQ(c.overlap_pairs, 1u);
    EXPECT_EQ(BoxString(c.overlaps[0].box), BoxString(gone));
  }
}

TEST(CoverageTest, ScalarsEmptyTensorsAndTheCutFallback) {
  EXPECT_TRUE(AnalyzeCoverage({}, {Box{}}).clean());
  EXPECT_EQ(AnalyzeCoverage({}, {}).uncovered, 1u);
  EXPECT_TRUE(AnalyzeCoverage({0, 4}, {}).clean());
  // A checkerboard of 1x1 boxes with every other one missing exceeds a tiny
  // piece budget: the count stays exact, the list is cut.
  std::vector<Box> boxes;
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 16; ++j) {
      if ((i + j) % 2 == 0) boxes.push_back(Box{{i, j}, {1, 1}});
    }
  }
  Coverage c = AnalyzeCoverage({16, 16}, boxes, 4, 8);
  EXPECT_FALSE(c.exact);
  EXPECT_EQ(c.uncovered, 128u);
  EXPECT_EQ(BoxString(Box{{2, 0}, {3, 4}}), "[2:5, 0:4]");

  // The words and JSON both the DCP reader and verify report.
  Coverage both = AnalyzeCoverage({4, 2}, {Box{{0, 0}, {2, 2}}, Box{{1, 0}, {2, 2}}});
  CoverageText t = DescribeCoverage(
      both, {4, 2}, [](size_t i) { return "f" + std::to_string(i); }, "chunks");
  EXPECT_EQ(t.message,
            "2 of 8 elements are in no chunk (first hole [3:4, 0:2]); 1 pair(s) of chunks overlap "
            "(first [1:2, 0:2], in f0 and f1)");
  EXPECT_EQ(t.detail, R"({"shape":[4,2],"uncovered_elements":2,"holes":["[3:4, 0:2]"],)"
                      R"("overlaps":[{"region":"[1:2, 0:2]","files":["f0","f1"]}]})");
}

// A synthetic checkpoint: float32 tensors split into row blocks, all in one
// data file; `rows` decides the fragments.
struct Builder {
  std::string dir;
  Checkpoint ck;
  std::string data;

  Builder(const std::string& d) : dir(d) {
    ck.info.family = Family::kUnknown;
    ck.info.format_note = "synthetic";
    ck.files.push_back(SourceFile{"data.bin", 0, 0, 0});
  }
  void Add(const std::string& fqn, Role role, const std::string& state, std::vector<float> values, int64_t cols,
           int64_t rows_per_fragment, FileId file = FileId{0}) {
    TensorRecord t;
    t.key = fqn + "/" + state;
    t.fqn = fqn;
    t.state = state;
    t.role = role;
    t.dtype = DType::kF32;
    const int64_t rows = static_cast<int64_t>(values.size()) / cols;
    t.shape = {rows, cols};
    std::vector<Fragment> frags;
    for (int64_t r = 0; r < rows; r += rows_per_fragment) {
      Fragment f;
      f.file = file;
      f.dtype = DType::kF32;
      f.offsets = {r, 0};
      f.lengths = {std::min(rows_per_fragment, rows - r), cols};
      f.strides = {cols, 1};
      f.data_offset = data.size();
      f.data_length = static_cast<uint64_t>(f.lengths[0] * cols) * 4;
      data.append(reinterpret_cast<const char*>(values.data() + r * cols), f.data_length);
      frags.push_back(f);
    }
    ck.AddTensor(t, frags);
  }
  std::unique_ptr<Index> Build() {
    ckptfs::testing::WriteFile(dir + "/data.bin", data);
    ckptfs::testing::FillStat(dir, &ck.files[0]);
    EXPECT_TRUE(Index::Build(ck, dir + "/index").ok());
    auto ix = Index::Open(dir + "/index", dir);
    EXPECT_TRUE(ix.ok()) << ix.status().message();
    return std::move(ix).value();
  }
};

std::vector<float> Ramp(size_t n, float base = 1) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i);
  return v;
}

Report RunVerify(const Index& ix, VerifyOptions o = {}) {
  auto reader = TensorReader::Open(ix, EngineKind::kPread);
  EXPECT_TRUE(reader.ok());
  auto r = Verify(ix, **reader, o);
  EXPECT_TRUE(r.ok());
  return std::move(r).value();
}

std::vector<const Finding*> Of(const Report& r, Check c) {
  std::vector<const Finding*> out;
  for (const Finding& f : r.findings) {
    if (f.check == c) out.push_back(&f);
  }
  return out;
}

TEST(VerifyTest, CleanCheckpointHasNoFindingAndHashesEveryByte) {
  TempDir t;
  Builder b(t.path());
  b.ck.info.step = 3;
  b.Add("w", Role::kParam, "param", Ramp(24), 4, 2);
  b.Add("w", Role::kOptimState, "exp_avg", Ramp(24, 5), 4, 2);
  b.Add("w", Role::kOptimState, "exp_avg_sq", Ramp(24, 9), 4, 2);
  auto ix = b.Build();
  Report r = RunVerify(*ix, {.deep = true});
  EXPECT_TRUE(r.findings.empty());
  EXPECT_EQ(r.ExitCode(), 0);
  EXPECT_EQ(r.bytes_read, 3u * 24 * 4);
  auto reader = TensorReader::Open(*ix, EngineKind::kPread);
  for (const TensorCheck& c : r.tensors) {
    EXPECT_TRUE(c.read);
    EXPECT_EQ(c.xxh3, *(*reader)->Xxh3Raw(TensorId{c.tensor}));  // info.json's hash
    EXPECT_TRUE(c.numeric);
  }
  // param: 1..24 -> sqrt(sum i^2) and max 24.
  double ss = 0;
  for (int i = 1; i <= 24; ++i) ss += i * i;
  EXPECT_DOUBLE_EQ(r.tensors[0].l2, std::sqrt(ss));
  EXPECT_DOUBLE_EQ(r.tensors[0].max_abs, 24);
}

TEST(VerifyTest, ZeroChunksAreJudgedAgainstTheirSiblings) {
  TempDir t;
  Builder b(t.path());
  b.ck.info.step = 5;
  std::vector<float> sq = Ramp(24, 9);
  std::fill(sq.begin() + 8, sq.begin() + 16, 0.f);  // chunk rows 2:4 lost
  b.Add("lost", Role::kParam, "param", Ramp(24), 4, 2);
  b.Add("lost", Role::kOptimState, "exp_avg", Ramp(24, 5), 4, 2);
  b.Add("lost", Role::kOptimState, "exp_avg_sq", sq, 4, 2);
  // Rows 0:2 never got a gradient: both moments zero, master fine -> a note.
  std::vector<float> m1 = Ramp(24, 5), m2 = Ramp(24, 9);
  std::fill(m1.begin(), m1.begin() + 8, 0.f);
  std::fill(m2.begin(), m2.begin() + 8, 0.f);
  b.Add("unused", Role::kParam, "param", Ramp(24), 4, 2);
  b.Add("unused", Role::kOptimState, "exp_avg", m1, 4, 2);
  b.Add("unused", Role::kOptimState, "exp_avg_sq", m2, 4, 2);
  b.Add("unused", Role::kOptimState, "fp32", Ramp(24), 4, 2);
  // A zero fp32 master over a non-zero weight.
  std::vector<float> master = Ramp(24);
  std::fill(master.begin() + 16, master.end(), 0.f);
  b.Add("master", Role::kParam, "param", Ramp(24), 4, 2);
  b.Add("master", Role::kOptimState, "fp32", master, 4, 2);
  // A zero master over a zero weight is consistent.
  std::vector<float> zw(24, 0.f);
  b.Add("zero_bias", Role::kParam, "param", zw, 4, 2);
  b.Add("zero_bias", Role::kOptimState, "fp32", zw, 4, 2);
  auto ix = b.Build();
  Report r = RunVerify(*ix);
  auto z = Of(r, Check::kZeroed);
  ASSERT_EQ(z.size(), 2u) << (z.empty() ? "" : z[0]->message);
  EXPECT_EQ(z[0]->tensor, "lost/exp_avg_sq");
  EXPECT_NE(z[0]->message.find("[2:4, 0:4]"), std::string::npos) << z[0]->message;
  EXPECT_NE(z[0]->message.find("exp_avg of the same region is not"), std::string::npos);
  EXPECT_EQ(z[1]->tensor, "master/fp32");
  EXPECT_NE(z[1]->message.find("[4:6, 0:4]"), std::string::npos) << z[1]->message;
  // The same zero master no longer rounds to its weight (8 of 24 elements).
  auto mm = Of(r, Check::kMaster);
  ASSERT_EQ(mm.size(), 1u);
  EXPECT_NE(mm[0]->message.find("'master': its fp32 master does not round to the weight at 8 of 24 elements"),
            std::string::npos)
      << mm[0]->message;
  EXPECT_EQ(r.findings.size(), 3u);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("'unused'"), std::string::npos);
  EXPECT_EQ(r.ExitCode(), 3);

  // At step 0 nothing has been written by the optimizer yet: no judgement.
  TempDir t0;
  Builder b0(t0.path());
  b0.ck.info.step = 0;
  b0.Add("lost", Role::kOptimState, "exp_avg", Ramp(24, 5), 4, 2);
  b0.Add("lost", Role::kOptimState, "exp_avg_sq", sq, 4, 2);
  EXPECT_TRUE(RunVerify(*b0.Build()).findings.empty());
}

TEST(VerifyTest, LayerNumberingGapsAndConfiguredCount) {
  TempDir t;
  Builder b(t.path());
  for (int i : {0, 1, 3}) b.Add("model.layers." + std::to_string(i) + ".w", Role::kParam, "param", Ramp(4), 2, 2);
  b.Add("model.layers_norm.w", Role::kParam, "param", Ramp(4), 2, 2);  // not a layer
  auto ix = b.Build();
  Report r = RunVerify(*ix);
  auto c = Of(r, Check::kCollision);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0]->tensor, "model.layers");
  EXPECT_NE(c[0]->detail.find("\"missing_layers\":[2]"), std::string::npos) << c[0]->detail;

  VerifyOptions o;
  o.expected_layers = 6;
  r = RunVerify(*ix, o);
  c = Of(r, Check::kCollision);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_NE(c[0]->detail.find("\"missing_layers\":[2,4,5]"), std::string::npos) << c[0]->detail;
  EXPECT_EQ(r.configured_layers_from, "--num-layers");
}

TEST(VerifyTest, MissingFileIsOneCoverageFindingAndNaNNeedsDeep) {
  TempDir t;
  Builder b(t.path());
  b.ck.files.push_back(SourceFile{"rank1.bin", 0, -1, 0});  // missing when indexed
  std::vector<float> v = Ramp(12);
  v[3] = NAN;
  v[4] = -INFINITY;
  b.Add("a", Role::kParam, "param", v, 3, 4);
  b.Add("b", Role::kParam, "param", Ramp(12), 3, 2, FileId{1});
  b.Add("c", Role::kParam, "param", Ramp(12), 3, 2, FileId{1});
  auto ix = b.Build();
  Report r = RunVerify(*ix);
  auto cov = Of(r, Check::kCoverage);
  ASSERT_EQ(cov.size(), 1u);
  EXPECT_EQ(cov[0]->file, "rank1.bin");
  EXPECT_NE(cov[0]->message.find("holes in 2 tensor(s)"), std::string::npos) << cov[0]->message;
  EXPECT_TRUE(Of(r, Check::kNumerics).empty());
  EXPECT_EQ(r.tensors_read, 1u);

  r = RunVerify(*ix, {.deep = true});
  auto num = Of(r, Check::kNumerics);
  ASSERT_EQ(num.size(), 1u);
  EXPECT_EQ(num[0]->tensor, "a/param");
  EXPECT_EQ(r.tensors[0].nan, 1u);
  EXPECT_EQ(r.tensors[0].inf, 1u);
  EXPECT_EQ(r.ExitCode(), 3);
}

TEST(VerifyTest, IndexFindingsSurviveTheRoundTripAndUnexplainedErrorsExit2) {
  TempDir t;
  Builder b(t.path());
  b.Add("a", Role::kParam, "param", Ramp(4), 2, 2);
  b.ck.info.Flag(Check::kGeometry, Severity::kWarning, "", "zero_pp_rank_3.pt", "recorded padding 3, recomputed 2",
                 R"({"recorded_padding":3})");
  TensorRecord broken;
  broken.key = "bad";
  broken.fqn = "bad";
  broken.role = Role::kParam;
  broken.state = "param";
  broken.dtype = DType::kF32;
  broken.shape = {2};
  broken.error = "cannot read shard.pt: truncated";
  b.ck.AddTensor(broken, {});
  auto ix = b.Build();
  ASSERT_EQ(ix->info().findings.size(), 1u);
  const Finding& f = ix->info().findings[0];
  EXPECT_EQ(f.check, Check::kGeometry);
  EXPECT_EQ(f.severity, Severity::kWarning);
  EXPECT_EQ(f.file, "zero_pp_rank_3.pt");
  EXPECT_EQ(f.detail, R"({"recorded_padding":3})");
  Report r = RunVerify(*ix);
  ASSERT_EQ(r.findings.size(), 2u);
  EXPECT_EQ(r.findings[1].check, Check::kUnreadable);
  EXPECT_EQ(r.ExitCode(), 1);
  const std::string json = ReportJson(r, *ix, false);
  EXPECT_NE(json.find("\"verdict\": \"unreadable\""), std::string::npos);
  EXPECT_EQ(json.find("seconds"), std::string::npos);
  EXPECT_NE(ReportTable(r, *ix).find("zero-geometry"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs
