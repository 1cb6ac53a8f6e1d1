#include "ckptfs/topo.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "../test_util.h"
#include "ckptfs/io.h"
#include "ckptfs/views.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

TEST(TopologyTest, ParsesCanonicalNames) {
  auto t = Topology::Parse("tp4-pp2");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->tp, 4);
  EXPECT_EQ(t->pp, 2);
  EXPECT_EQ(t->dp, 0);
  EXPECT_EQ(Topology::Parse("tp2-pp1-dp8")->dp, 8);
  EXPECT_EQ(Topology::Parse("tp1-pp1-ep2")->ep, 2);
  EXPECT_EQ(Topology::Parse("tp2-pp1-dp4-ep2")->Name(), "tp2-pp1-dp4-ep2");
  for (const char* bad :
       {"tp2", "pp2-tp1", "tp0-pp1", "tp2-pp1-", "tp2-pp1-xx3", "tp-pp1", "tp2-pp1-ep2-dp2", "ERRORS"}) {
    EXPECT_FALSE(Topology::Parse(bad)) << bad;
  }
  EXPECT_EQ(Topology::Parse("tp02-pp1")->Name(), "tp2-pp1");  // View::Lookup serves only the canonical spelling
  EXPECT_EQ(ParsePpLayers("3,5").value(), (std::vector<int64_t>{3, 5}));
  EXPECT_FALSE(ParsePpLayers("3,x").ok());
}

// A synthetic checkpoint: one source file of f32 values 0, 1, 2, ... that
// every tensor's single fragment reads from its own offset.
class TopoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Add("layers.0.w1.weight", "param", {4, 6});
    Add("layers.0.w1.weight", "exp_avg", {4, 6});
    Add("layers.0.w1.weight", "step", {});
    Add("layers.1.w2.weight", "param", {6, 4});
    TensorSplit vocab{SplitKind::kDim, 0, 0, true};
    Add("tok_embeddings.weight", "param", {5, 6}, vocab);
    Add("norm.weight", "param", {6});
    Add("layers.0.qkv.weight", "param", {8, 2}, TensorSplit{SplitKind::kDim, 0, 2, false});
    Add("layers.1.fc1.weight", "param", {8, 2}, TensorSplit{SplitKind::kSub2, 0, 0, false});
    Rebuild();
  }
  // Writes the data file and (re)builds the index of ck_.
  void Rebuild() {
    ix_.reset();
    ck_.files.clear();
    std::string data;
    for (uint32_t i = 0; i < next_ / 4; ++i) {
      float f = static_cast<float>(i);
      data.append(reinterpret_cast<const char*>(&f), 4);
    }
    ckptfs::testing::WriteFile(dir_.path() + "/d", data);
    ck_.files.push_back(SourceFile{"d", 0, 0, 0});
    ckptfs::testing::FillStat(dir_.path(), &ck_.files[0]);
    ck_.info.family = Family::kUnknown;
    ASSERT_TRUE(Index::Build(ck_, dir_.path() + "/ix").ok());
    auto ix = Index::Open(dir_.path() + "/ix", dir_.path());
    ASSERT_TRUE(ix.ok()) << ix.status().message();
    ix_ = std::move(*ix);
  }
  void Add(const std::string& fqn, const std::string& state, std::vector<int64_t> shape, TensorSplit split = {}) {
    TensorRecord r;
    r.key = fqn + "/" + state;
    r.role = state == "param" ? Role::kParam : Role::kOptimState;
    r.fqn = fqn;
    r.state = state;
    r.dtype = DType::kF32;
    r.shape = shape;
    r.split = split;
    Fragment f = ckptfs::testing::WholeFragment(shape, DType::kF32, next_);
    next_ += f.data_length;
    base_[fqn + "/" + state] = f.data_offset / 4;
    ck_.AddTensor(r, {f});
  }
  const RankTensor* Find(const TopoPlan& p, int tp, int pp, const std::string& name) {
    for (const RankTensor& rt : p.ranks[static_cast<size_t>(pp) * p.topo.tp + tp].tensors) {
      if (rt.name == name) return &rt;
    }
    return nullptr;
  }
  TempDir dir_;
  Checkpoint ck_;
  std::unique_ptr<Index> ix_;
  uint64_t next_ = 0;
  std::map<std::string, uint64_t> base_;
};

TEST_F(TopoTest, ExpertParallelRanks) {
  // Without experts, -ep is refused; 4 experts on top: dealt 2 per EP rank.
  auto none = PlanTopology(*ix_, *Topology::Parse("tp1-pp1-ep2"), TopoOptions{});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no MoE experts"), std::string::npos) << none.status().message();
  for (int e = 0; e < 4; ++e)
    Add("layers.1.mlp.experts.local_experts." + std::to_string(e) + ".w1.weight", "param", {4, 2});
  Rebuild();
  auto plan = PlanTopology(*ix_, *Topology::Parse("tp2-pp1-ep2"), TopoOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->num_experts, 4);
  ASSERT_EQ(plan->ranks.size(), 4u);  // (pp * EP + ep) * TP + tp
  auto names = [&](int e, int t) {
    std::set<std::string> out;
    const RankPlan& r = plan->ranks[static_cast<size_t>(e) * 2 + t];
    EXPECT_EQ(r.ep, e);
    EXPECT_EQ(r.tp, t);
    for (const RankTensor& rt : r.tensors) {
      if (ExpertOf(rt.name) >= 0) out.insert(rt.name);
    }
    return out;
  };
  EXPECT_EQ(names(1, 0), (std::set<std::string>{"layers.1.mlp.experts.local_experts.2.w1.weight",
                                                "layers.1.mlp.experts.local_experts.3.w1.weight"}));
  EXPECT_EQ(names(0, 1).size(), 2u);
  // Dense tensors on every EP rank.
  for (size_t r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::any_of(plan->ranks[r].tensors.begin(), plan->ranks[r].tensors.end(),
                            [](const RankTensor& rt) { return rt.name == "norm.weight"; }));
  }
  auto three = PlanTopology(*ix_, *Topology::Parse("tp1-pp1-ep3"), TopoOptions{});
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("4 experts per layer do not divide by EP=3"), std::string::npos);
  auto dp = PlanTopology(*ix_, *Topology::Parse("tp1-pp1-dp2-ep2"), TopoOptions{});
  EXPECT_FALSE(dp.ok());
  // A lookup cannot make the daemon plan a million ranks.
  auto huge = PlanTopology(*ix_, *Topology::Parse("tp1048576-pp1-ep4"), TopoOptions{});
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("model-parallel ranks"), std::string::npos) << huge.status().message();
}

TEST_F(TopoTest, SplitsStagesAndRules) {
  auto plan = PlanTopology(*ix_, *Topology::Parse("tp2-pp2"), TopoOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->num_layers, 2);
  // Column-parallel by name convention (w1), row-parallel (w2) on the last stage.
  const RankTensor* w1 = Find(*plan, 1, 0, "layers.0.w1.weight");
  ASSERT_NE(w1, nullptr);
  EXPECT_EQ(w1->shape, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(w1->pieces[0].offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_NE(Find(*plan, 1, 0, "optimizer.state.layers.0.w1.weight.exp_avg"), nullptr);
  EXPECT_EQ(Find(*plan, 1, 0, "optimizer.state.layers.0.w1.weight.step")->shape, std::vector<int64_t>{});
  const RankTensor* w2 = Find(*plan, 0, 1, "layers.1.w2.weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(Find(*plan, 0, 0, "layers.1.w2.weight"), nullptr);
  // Vocabulary: 5 rows over TP=2 -> 3 + (2 + one zero row).
  const RankTensor* e1 = Find(*plan, 1, 0, "tok_embeddings.weight");
  ASSERT_NE(e1, nullptr);
  EXPECT_EQ(e1->shape, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(e1->pieces[0].lengths, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(e1->zero_tail, 6u);
  EXPECT_NE(Find(*plan, 1, 1, "norm.weight"), nullptr);  // replicated, last stage
  // SwiGLU: [W_r; V_r].
  const RankTensor* fc1 = Find(*plan, 1, 1, "layers.1.fc1.weight");
  ASSERT_EQ(fc1->pieces.size(), 2u);
  EXPECT_EQ(fc1->pieces[0].offsets[0], 2);
  EXPECT_EQ(fc1->pieces[1].offsets[0], 6);

  // A dimension that does not divide names the tensor and the reason.
  auto bad = PlanTopology(*ix_, *Topology::Parse("tp3-pp1"), TopoOptions{});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("does not divide by TP=3"), std::string::npos) << bad.status().message();
  // Query groups: 2 groups cannot go to 4 ranks although 8 rows could.
  TopoOptions rep;
  ASSERT_TRUE(ParseRulesFile(
                  [&] {
                    ckptfs::testing::WriteFile(dir_.path() + "/r.json",
                                               R"({"rules": [{"match": "w1|w2|fc1|tok_emb", "split": "replicate"}]})");
                    return dir_.path() + "/r.json";
                  }(),
                  rep)
                  .ok());
  auto groups = PlanTopology(*ix_, *Topology::Parse("tp4-pp1"), rep);
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.status().message().find("2 attention query groups"), std::string::npos) << groups.status().message();
  // Stages: 2 layers do not divide into 3 stages unless --pp-layers says how.
  auto pp3 = PlanTopology(*ix_, *Topology::Parse("tp1-pp3"), TopoOptions{});
  ASSERT_FALSE(pp3.ok());
  EXPECT_NE(pp3.status().message().find("--pp-layers"), std::string::npos);
  TopoOptions uneven;
  uneven.pp_layers = {1, 0, 1};
  auto pp3b = PlanTopology(*ix_, *Topology::Parse("tp1-pp3"), uneven);
  ASSERT_TRUE(pp3b.ok());
  EXPECT_TRUE(pp3b->ranks[1].tensors.empty());
  EXPECT_NE(Find(*pp3b, 0, 2, "layers.1.w2.weight"), nullptr);
}

TEST_F(TopoTest, RulesFileErrorsNameTheFile) {
  const std::string p = dir_.path() + "/bad.json";
  for (const char* text :
       {"[1]", R"({"rules": [{"split": "dim"}]})", R"({"rules": [{"match": "(", "split": "replicate"}]})",
        R"({"rules": [{"match": "x", "split": "dim"}]})", R"({"rules": [{"match": "x", "split": "zz"}]})",
        R"({"rules": [{"match": "x"}]})", R"({"pp_layers": "3"})"}) {
    ckptfs::testing::WriteFile(p, text);
    TopoOptions o;
    Status s = ParseRulesFile(p, o);
    ASSERT_FALSE(s.ok()) << text;
    EXPECT_NE(s.message().find(p), std::string::npos) << s.message();
  }
  TopoOptions o;
  EXPECT_FALSE(ParseRulesFile(dir_.path() + "/missing.json", o).ok());
}

// The bytes of a rank file: a safetensors header, then each tensor's slice
// cut from the global tensor in C order.
TEST_F(TopoTest, RankFileBytesAreTheSlices) {
  auto v = View::Build(*ix_);
  ASSERT_TRUE(v.ok());
  auto topo = (*v)->Resolve("topo");
  ASSERT_TRUE(topo.ok());
  ASSERT_NE((*v)->Lookup(*topo, "tp2-pp1"), nullptr);
  EXPECT_EQ((*v)->Lookup(*topo, "tp3-pp1"), nullptr);
  EXPECT_NE((*v)->TopoErrors().find("topo/tp3-pp1: "), std::string::npos);
  auto ino = (*v)->Resolve("topo/tp2-pp1/tp1-pp0.safetensors");
  ASSERT_TRUE(ino.ok());
  const FileLayout* l = *(*v)->Layout(*ino);
  auto reader = TensorReader::Open(*ix_, EngineKind::kPread);
  ASSERT_TRUE(reader.ok());
  std::string bytes(l->size, '\0');
  for (size_t i = 0; i < l->segments.size(); ++i) {
    const Segment& s = l->segments[i];
    char* dst = bytes.data() + l->starts[i];
    if (s.kind == SegmentKind::kLiteral) {
      std::memcpy(dst, s.literal().data(), s.size);
    } else {
      ASSERT_TRUE((*reader)->ReadBox(s.tensor, s.out_dtype, s.box_or_null(), 0, s.size, dst).ok());
    }
  }
  const uint64_t n = LoadLE<uint64_t>(bytes.data());
  EXPECT_EQ(n % 8, 0u);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["ckptfs_topology"], "tp2-pp1");
  auto at = [&](const std::string& name, size_t k) {
    float f;
    std::memcpy(&f, bytes.data() + 8 + n + h[name]["data_offsets"][0].get<uint64_t>() + 4 * k, 4);
    return f;
  };
  // w2 [6, 4], rank 1 holds columns 2..3: element (r, c) is global (r, 2 + c).
  EXPECT_EQ(h["layers.1.w2.weight"]["shape"], nlohmann::json({6, 2}));
  const float w2 = static_cast<float>(base_["layers.1.w2.weight/param"]);
  for (int r = 0; r < 6; ++r) {
    for (int c = 0; c < 2; ++c) EXPECT_EQ(at("layers.1.w2.weight", r * 2 + c), w2 + r * 4 + 2 + c);
  }
  // fc1 [8, 2] as [W; V]: rank 1 holds W rows 2..3 then V rows 6..7.
  const float fc1 = static_cast<float>(base_["layers.1.fc1.weight/param"]);
  EXPECT_EQ(at("layers.1.fc1.weight", 0), fc1 + 4);
  EXPECT_EQ(at("layers.1.fc1.weight", 2), fc1 + 6);
  EXPECT_EQ(at("layers.1.fc1.weight", 4), fc1 + 12);
  // The padded vocabulary row is zeros.
  const float emb = static_cast<float>(base_["tok_embeddings.weight/param"]);
  EXPECT_EQ(at("tok_embeddings.weight", 0), emb + 18);
  for (int k = 12; k < 18; ++k) EXPECT_EQ(at("tok_embeddings.weight", k), 0.0f);
  // hf/ is the whole model in one shard with its index.
  EXPECT_TRUE((*v)->Resolve("hf/model-00001-of-00001.safetensors").ok());
  EXPECT_TRUE((*v)->Resolve("hf/model.safetensors.index.json").ok());
}

}  // namespace
}  // namespace ckptfs
