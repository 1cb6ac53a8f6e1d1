// dcp/ (views/dcp_view.h) without torch: the tree is made from the index
// alone and deterministically; every item is one torch.save archive (a ZIP
// whose local header opens the item, whose end-of-central-directory closes
// it), items tile their data files, row-block chunks tile each tensor, and
// tensors a reader refused are left out by name. torch's own reader loading
// it is tests/integration/test_dcp_view.py.
#include "views/dcp_view.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "../fs_fixture.h"
#include "../test_util.h"
#include "ckptfs/formats.h"
#include "ckptfs/fs.h"
#include "formats/byte_reader.h"
#include "formats/torch_save.h"

namespace ckptfs {
namespace {

using testing::ReadAll;
using testing::TempDir;

// The number of whole torch.save archives that tile `data`: each one "PK\3\4"
// where the previous ended, closed by an end-of-central-directory record
// ("PK\5\6", no comment). -1 if they do not tile it.
int64_t ArchivesTiling(const std::string& data) {
  uint64_t off = 0;
  int64_t items = 0;
  while (off < data.size()) {
    if (data.compare(off, 4, "PK\x03\x04") != 0) return -1;
    const size_t eocd = data.find("PK\x05\x06", off);
    if (eocd == std::string::npos) return -1;
    off = eocd + 22;
    ++items;
  }
  return off == data.size() ? items : -1;
}

TEST(DcpViewTest, MadeFromTheIndexDeterministically) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  auto a = dcp_view::DcpFiles(fs->index());
  auto b = dcp_view::DcpFiles(fs->index());
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(a->files.size(), b->files.size());
  for (size_t i = 0; i < a->files.size(); ++i) {
    EXPECT_EQ(a->files[i].first, b->files[i].first);
    EXPECT_EQ(a->files[i].second.size, b->files[i].second.size);
  }
  EXPECT_EQ(a->files[0].first, ".metadata");
  EXPECT_TRUE(a->left_out.empty());
  EXPECT_GT(a->chunks, 0u);
}

// A .metadata past the spool size is written to an unlinked temporary file
// in pieces and read back from it: the same bytes as the one made in memory.
TEST(DcpViewTest, LargeMetadataIsSpooledToATemporaryFileWithTheSameBytes) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  auto memory = dcp_view::DcpFiles(fs->index());
  auto spooled = dcp_view::DcpFiles(fs->index(), /*spool_piece=*/512);
  ASSERT_TRUE(memory.ok() && spooled.ok());
  const FileLayout& a = memory->files[0].second;
  const FileLayout& b = spooled->files[0].second;
  ASSERT_EQ(a.segments.size(), 1u);
  ASSERT_EQ(b.segments.size(), 1u);
  EXPECT_EQ(a.segments[0].kind, SegmentKind::kLiteral);
  ASSERT_EQ(b.segments[0].kind, SegmentKind::kSpooled);
  ASSERT_EQ(b.size, a.size);
  std::string back(b.size, '\0');
  ASSERT_TRUE(b.segments[0].spooled()->Read(0, back.size(), back.data()).ok());
  EXPECT_EQ(back, a.segments[0].literal());
  EXPECT_FALSE(b.segments[0].spooled()->Read(b.size - 1, 2, back.data()).ok());  // past the end: an error
}

// Each item of a data file is a torch.save archive: "PK\3\4" where the
// metadata says it starts, an end-of-central-directory record ("PK\5\6") 22
// bytes before it ends (no comment), and the metadata's fqn in the pickle.
TEST(DcpViewTest, ItemsAreWholeArchivesTilingTheDataFiles) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "meta_llama_mp2/mp2");
  ASSERT_NE(fs, nullptr);
  const std::string md = ReadAll(*fs, "dcp/.metadata");
  ASSERT_GT(md.size(), 100u);
  EXPECT_NE(md.find("torch.distributed.checkpoint.metadata\nMetadata\n"), std::string::npos);
  EXPECT_NE(md.find("_StorageInfo"), std::string::npos);
  const std::string data = ReadAll(*fs, "dcp/__0_0.distcp");
  ASSERT_GT(data.size(), 0u);
  auto tree = dcp_view::DcpFiles(fs->index());
  ASSERT_TRUE(tree.ok());
  EXPECT_EQ(ArchivesTiling(data), static_cast<int64_t>(tree->chunks));
}

TEST(DcpViewTest, ListedAtTheRootOnlyWithTensors) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "dcp_single");
  ASSERT_NE(fs, nullptr);
  auto root = fs->ReadDir(kRootIno);
  ASSERT_TRUE(root.ok());
  bool dcp = false;
  for (const DirEntry& e : *root) dcp |= e.name == "dcp" && e.is_dir;
  EXPECT_TRUE(dcp);
  const std::string readme = ReadAll(*fs, "dcp/README.txt");
  EXPECT_NE(readme.find("dcp.load"), std::string::npos);
  EXPECT_NE(readme.find("Every tensor of the checkpoint is represented"), std::string::npos);
}

// DeepSpeed's universal info says the vocabulary is 30 rows, saved padded to
// 32 in two TP slices: params/ serves rows [0, 30) and the padding rows
// beside them, together exactly the stored tensor; dcp/'s chunks are the TP
// slices cut at row 30.
TEST(DcpViewTest, PaddedVocabularyChunksStopAtTheVocabulary) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  const auto& ts = fs->index().tensors();
  auto plan = dcp_view::PlanDcp(fs->index());
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  int padded = 0;
  int groups = 0;
  for (const auto& e : plan->entries) {
    if (e.tensor == dcp_view::DcpEntry::kLiteral) {  // the param groups DeepSpeed saved
      EXPECT_EQ(e.key.rfind("optim.param_groups.", 0), 0u) << e.key;
      EXPECT_EQ(e.literal.rfind("PK\3\4", 0), 0u) << e.key;  // a torch.save archive
      ++groups;
      continue;
    }
    const TensorRecord& t = ts[e.tensor];
    if (!t.VocabPadded()) continue;
    ++padded;
    EXPECT_EQ(t.vocab_rows, 30) << t.key;
    EXPECT_EQ(t.shape[0], 32) << t.key;
    ASSERT_EQ(e.chunks.size(), 2u) << t.key;
    EXPECT_EQ(e.chunks[0].lengths[0], 16);
    EXPECT_EQ(e.chunks[1].offsets[0], 16);
    EXPECT_EQ(e.chunks[1].lengths[0], 14);
    if (t.role != Role::kOptimState) continue;
    const std::string dir = "params/" + t.fqn + "/" + t.state;
    const std::string both = ReadAll(*fs, dir + ".raw") + ReadAll(*fs, dir + ".vocab_padding.raw");
    std::string whole(t.byte_size, '\0');
    ASSERT_TRUE(fs->ReadTensor(TensorId{e.tensor}, t.dtype, nullptr, whole.data(), whole.size()).ok());
    EXPECT_EQ(both, whole) << dir;
  }
  EXPECT_GE(padded, 2);   // the model's embedding and its fp32 master
  EXPECT_GE(groups, 10);  // lr, betas, eps, ..., params of group 0
}

// DeepSpeed MoE (DeepSpeed 0.15, DP=2 EP=2, two MoE layers of 4 experts):
// each expert-parallel rank saves its expert groups with its own 2 experts
// per layer under local numbers; dcp/'s expert groups list all 4 of each
// layer under the global names params/ serves, the dense groups none.
TEST(DcpViewTest, DeepSpeedMoeExpertGroupsListEveryExpert) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/moe_z2_bf16_dp2_ep2");
  ASSERT_NE(fs, nullptr);
  for (const std::string& p : fs->index().info().problems) EXPECT_EQ(p.find("param_groups"), std::string::npos) << p;
  std::set<std::string> experts;  // every expert parameter's name
  for (const TensorRecord& t : fs->index().tensors()) {
    if (t.role == Role::kParam && t.fqn.find(".deepspeed_experts.") != std::string::npos) experts.insert(t.fqn);
  }
  ASSERT_EQ(experts.size(), 2u * 4u * 4u);  // 2 layers x 4 experts x two Linears' weight and bias
  std::set<std::string> in_expert_groups, in_dense_groups;
  for (const ExportFile& x : fs->index().exports()) {
    if (!x.path.starts_with("@dcp/optim.param_groups.") || !x.path.ends_with(".params")) continue;
    ASSERT_EQ(x.parts.size(), 1u);
    formats::MemoryReader r(x.parts[0].literal, x.path);
    auto a = formats::ReadTorchSave(r);
    ASSERT_TRUE(a.ok()) << a.status().message();
    ASSERT_TRUE(a->root->IsSeq()) << x.path;
    for (const formats::PyValue* n : a->root->items) {
      ASSERT_TRUE(n->IsStr());
      (n->s.find(".deepspeed_experts.") != std::string::npos ? in_expert_groups : in_dense_groups).insert(n->s);
    }
  }
  EXPECT_EQ(in_expert_groups, experts);
  EXPECT_FALSE(in_dense_groups.empty());
}

// A Megatron torch_dist checkpoint's param groups are offered in dcp/ with
// .params: common.pt's (saved without member ids), or, where the distributed
// optimizer keeps them in per-DP-rank objects (Megatron-Bridge's
// dp_reshardable run), those objects'.
TEST(DcpViewTest, MegatronParamGroupsFromCommonPtOrPerDpRankObjects) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "megatron_versions/mcore0.14.0-dist_distopt_tp2_pp2_dp2");
  ASSERT_NE(fs, nullptr);
  auto expect_groups = [](const Index& ix) {
    std::set<std::string> keys;
    for (const ExportFile& x : ix.exports()) {
      if (x.path.starts_with("@dcp/optim.param_groups.")) keys.insert(x.path.substr(5));
    }
    for (const char* k : {"optim.param_groups.0.params", "optim.param_groups.1.params", "optim.param_groups.0.lr",
                          "optim.param_groups.1.wd_mult"}) {
      EXPECT_TRUE(keys.count(k)) << ix.src_dir() << ": " << k;
    }
    for (const std::string& p : ix.info().problems) EXPECT_EQ(p.find("param_groups"), std::string::npos) << p;
  };
  expect_groups(fs->index());
  auto tree = dcp_view::DcpFiles(fs->index());
  ASSERT_TRUE(tree.ok()) << tree.status().message();
  const std::string md = ReadAll(*fs, "dcp/.metadata");
  EXPECT_NE(md.find("optim.param_groups.1.params"), std::string::npos);
  EXPECT_NE(md.find("optimizer.param_groups.1.params"), std::string::npos);

  TempDir tmp2;
  auto bridge = testing::OpenFixtureCopy(tmp2, "megatron_wrappers/bridge-dist_distopt_tp2_dp2");
  ASSERT_NE(bridge, nullptr);
  expect_groups(bridge->index());
}

// Megatron's torch_dist/ profile of megatron-core 0.14's save (torch_dist,
// the distributed optimizer's fully_sharded_model_space layout): the layers
// are stacked on a leading axis whose chunks each hold one layer of one
// source tensor, every key's chunks tile its tensor, and every item of the
// data file is a whole archive (the objects' and the stacked chunks' alike).
TEST(DcpViewTest, TorchDistProfileStacksTheLayers) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "megatron_versions/mcore0.14.0-dist_distopt_tp2_pp2_dp2");
  ASSERT_NE(fs, nullptr);
  const Index& ix = fs->index();
  const FamilyReader* reader = ReaderFor(ix.info().family);
  ASSERT_TRUE(reader != nullptr && reader->dcp_profile != nullptr);
  const DcpProfile profile = reader->dcp_profile(DcpProfileInput{ix.info(), ix.tensors(), ix.exports()});
  ASSERT_TRUE(profile.absent.empty()) << profile.absent;
  EXPECT_EQ(profile.dir, "torch_dist");
  EXPECT_EQ(profile.dcp_dir, "iter_0000007");
  auto plan = dcp_view::PlanProfile(ix, profile);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_TRUE(plan->left_out.empty());
  size_t stacks = 0, objects = 0;
  for (const dcp_view::DcpEntry& e : plan->entries) {
    if (e.tensor == dcp_view::DcpEntry::kLiteral) {
      EXPECT_NE(e.key.find("._extra_state/shard_"), std::string::npos) << e.key;
      ++objects;
      continue;
    }
    int64_t covered = 0;
    for (const Box& b : e.chunks) covered += NumelOf(b.lengths);
    EXPECT_EQ(covered, NumelOf(e.size)) << e.key;  // no chunk overlaps another (source row blocks)
    if (e.key.rfind("decoder.layers.", 0) != 0 && e.key.find(".decoder.layers.") == std::string::npos) {
      EXPECT_TRUE(e.chunk_tensors.empty()) << e.key;
      continue;
    }
    ++stacks;
    EXPECT_EQ(e.size[0], 4) << e.key;
    ASSERT_EQ(e.chunk_tensors.size(), e.chunks.size()) << e.key;
    for (size_t c = 0; c < e.chunks.size(); ++c) {
      const TensorRecord& t = ix.tensors()[e.chunk_tensors[c]];
      EXPECT_EQ(e.chunks[c].lengths[0], 1);
      // Chunk c is a box of the layer its first offset names.
      EXPECT_NE(t.fqn.find("decoder.layers." + std::to_string(e.chunks[c].offsets[0]) + "."), std::string::npos)
          << e.key << " " << t.fqn;
      EXPECT_EQ(std::vector<int64_t>(e.size.begin() + 1, e.size.end()), t.shape) << e.key;
    }
  }
  EXPECT_EQ(objects, 16u);  // 4 linear layers x 4 layers
  EXPECT_GE(stacks, 40u);   // 10 stacked parameters, each with its master and moments
  const std::string dir = "torch_dist/iter_0000007/";
  EXPECT_EQ(ArchivesTiling(ReadAll(*fs, dir + "__0_0.distcp")), static_cast<int64_t>(plan->chunks + objects));
  EXPECT_NE(ReadAll(*fs, dir + "common.pt").find("fully_reshardable"), std::string::npos);
  EXPECT_NE(ReadAll(*fs, dir + "metadata.json").find("\"sharded_backend\": \"torch_dist\""), std::string::npos);
  EXPECT_EQ(ReadAll(*fs, "torch_dist/latest_checkpointed_iteration.txt"), "7");

  // A stack with a layer missing is left out by name, never served with a hole.
  DcpProfile holed = profile;
  std::erase_if(holed.tensors, [&](const DcpProfileTensor& t) {
    return t.key == "decoder.layers.self_attention.linear_qkv.weight" && t.stack_index == std::vector<int64_t>{2};
  });
  auto partial = dcp_view::PlanProfile(ix, holed);
  ASSERT_TRUE(partial.ok());
  ASSERT_EQ(partial->left_out.size(), 1u);
  EXPECT_EQ(partial->left_out[0], "decoder.layers.self_attention.linear_qkv.weight: layer 2 of 4 is missing");
}

// The hook from records alone: names without an mcore sharded key,
// grouped-GEMM experts and a run whose common state could not be made have
// no profile, each with its reason; SequentialMLP's experts are stacked by
// layer and expert, their optimizer states under the chained expert
// optimizer's prefix.
TEST(DcpViewTest, TorchDistProfileAbsentWithItsReason) {
  const FamilyReader* reader = ReaderFor(Family::kMegatronLegacy);
  ASSERT_TRUE(reader != nullptr && reader->dcp_profile != nullptr);
  CheckpointInfo info;
  info.family = Family::kMegatronLegacy;
  info.step = 3;
  auto record = [](std::string fqn) {
    TensorRecord t;
    t.key = fqn;
    t.fqn = std::move(fqn);
    t.role = Role::kParam;
    t.state = "param";
    t.dtype = DType::kF32;
    t.shape = {4};
    return t;
  };
  auto literal = [](std::string path, std::string bytes) {
    const uint64_t n = bytes.size();
    return ExportFile{std::move(path), {ExportPart{PartKind::kLiteral, std::move(bytes), 0, DType::kInvalid, n, {}}}};
  };
  const std::vector<ExportFile> common = {literal("@megatron/common.pkl", "}")};  // an empty dict's opcode
  auto why = [&](std::vector<TensorRecord> ts, const std::vector<ExportFile>& xs) {
    return reader->dcp_profile(DcpProfileInput{info, ts, xs}).absent;
  };
  EXPECT_EQ(why({record("decoder.layers.0.mlp.linear_fc1.weight")}, common), "");
  EXPECT_NE(why({record("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight")}, common)
                .find("has no megatron-core sharded key"),
            std::string::npos);
  EXPECT_NE(why({record("decoder.layers.0.mlp.experts.linear_fc1.weight0")}, common).find("grouped-GEMM experts"),
            std::string::npos);
  EXPECT_EQ(why({record("decoder.layers.0.mlp.linear_fc1.weight")}, {literal("@megatron/common.why", "no groups")}),
            "common.pt cannot be made: no groups");
  EXPECT_NE(why({record("decoder.layers.0.mlp.linear_fc1.weight")}, {}).find("re-index"), std::string::npos);

  TensorRecord expert = record("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight");
  TensorRecord moment = expert;
  moment.role = Role::kOptimState;
  moment.state = "exp_avg";
  const std::vector<TensorRecord> moe = {record("decoder.layers.0.mlp.router.weight"), expert, moment};
  const DcpProfile p = reader->dcp_profile(DcpProfileInput{info, moe, common});
  ASSERT_EQ(p.absent, "");
  ASSERT_EQ(p.tensors.size(), 4u);  // the expert's weight is also its optimizer's param (no fp32 master)
  EXPECT_EQ(p.tensors[0].key, "decoder.layers.mlp.router.weight");
  EXPECT_EQ(p.tensors[0].stack_size, (std::vector<int64_t>{2}));
  EXPECT_EQ(p.tensors[1].key, "decoder.layers.mlp.experts.experts.linear_fc2.weight");
  EXPECT_EQ(p.tensors[1].stack_index, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(p.tensors[1].stack_size, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(p.tensors[2].key, "chained_1.optimizer.state.param.decoder.layers.mlp.experts.experts.linear_fc2.weight");
  EXPECT_EQ(p.tensors[3].key, "chained_1.optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight");
  ASSERT_EQ(p.objects.size(), 1u);
  EXPECT_EQ(p.objects[0].key, "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4");
}

}  // namespace
}  // namespace ckptfs
