#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "../test_util.h"
#include "formats/megatron/megatron_common.h"
#include "formats/megatron/run_config.h"
#include "formats/pickle.h"
#include "formats/pickle_writer.h"
#include "formats/tp_merge.h"
#include "formats/zarr/zarr_reader.h"

namespace ckptfs::formats {
namespace {

namespace fs = std::filesystem;
using ckptfs::testing::TempDir;
using megatron::LayerOffset;
using megatron::PipelineShape;
using megatron::RenumberExpert;
using megatron::RenumberLayer;
using megatron::SplitRule;

void WriteFile(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(MegatronSplitRuleTest, LayerTypes) {
  auto r = SplitRule("decoder.layers.0.self_attention.linear_qkv.weight", true);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->kind, Merge::kCat);
  EXPECT_EQ(r->cat_dim, 0);
  r = SplitRule("decoder.layers.0.self_attention.linear_proj.weight", true);
  EXPECT_EQ(r->cat_dim, 1);
  EXPECT_EQ(SplitRule("decoder.layers.0.self_attention.linear_proj.bias", true)->kind, Merge::kReplicated);
  EXPECT_EQ(SplitRule("decoder.layers.3.mlp.linear_fc1.weight", true)->kind, Merge::kSub2);
  EXPECT_EQ(SplitRule("decoder.layers.3.mlp.linear_fc1.weight", false)->kind, Merge::kCat);
  EXPECT_EQ(SplitRule("decoder.layers.3.mlp.linear_fc2.weight", true)->cat_dim, 1);
  EXPECT_EQ(SplitRule("decoder.final_layernorm.weight", true)->kind, Merge::kReplicated);
  EXPECT_EQ(SplitRule("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", true)->kind, Merge::kReplicated);
  EXPECT_TRUE(SplitRule("embedding.word_embeddings.weight", true)->vocab);
  EXPECT_TRUE(SplitRule("output_layer.weight", true)->vocab);
  // Legacy (language_model) names.
  EXPECT_EQ(SplitRule("language_model.encoder.layers.1.self_attention.dense.weight", false)->cat_dim, 1);
  EXPECT_EQ(SplitRule("language_model.encoder.layers.1.mlp.dense_4h_to_h.bias", false)->kind, Merge::kReplicated);
  EXPECT_EQ(SplitRule("language_model.encoder.layers.1.self_attention.query_key_value.bias", false)->kind, Merge::kCat);
  // MoE: the router is replicated; experts split like the dense MLP.
  EXPECT_EQ(SplitRule("decoder.layers.0.mlp.router.weight", true)->kind, Merge::kReplicated);
  EXPECT_EQ(SplitRule("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight", true)->kind, Merge::kSub2);
  EXPECT_FALSE(SplitRule("decoder.layers.0.mlp.some_new_module.weight", true).has_value());
}

TEST(MegatronLayersTest, RenumberExpert) {
  int64_t i;
  EXPECT_EQ(RenumberExpert("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", 6, &i),
            "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight");
  EXPECT_EQ(i, 7);
  EXPECT_EQ(RenumberExpert("decoder.layers.1.mlp.linear_fc1.weight", 6, &i), "decoder.layers.1.mlp.linear_fc1.weight");
  EXPECT_EQ(i, -1);
  EXPECT_EQ(RenumberExpert("x.local_experts.99999999999.w", 1, &i), "x.local_experts.99999999999.w");  // no such model
  EXPECT_EQ(i, -1);
}

TEST(MegatronLayersTest, RenumberAndOffsets) {
  int64_t i;
  EXPECT_EQ(RenumberLayer("decoder.layers.1.mlp.linear_fc1.weight", 6, &i), "decoder.layers.7.mlp.linear_fc1.weight");
  EXPECT_EQ(i, 7);
  EXPECT_EQ(RenumberLayer("language_model.encoder.layers.0.x", 2, &i), "language_model.encoder.layers.2.x");
  EXPECT_EQ(RenumberLayer("decoder.final_layernorm.weight", 6, &i), "decoder.final_layernorm.weight");
  EXPECT_EQ(i, -1);
  EXPECT_EQ(RenumberLayer("mylayers.3.w", 1, &i), "mylayers.3.w");  // only a whole "layers" component

  PipelineShape s{8, 2, 1, -1, -1};
  EXPECT_EQ(*LayerOffset(s, 1, 0), 4);
  // Virtual pipeline: chunk v of every stage before chunk v+1 (8 layers, PP 2, VP 2).
  s.vp = 2;
  EXPECT_EQ(*LayerOffset(s, 0, 0), 0);
  EXPECT_EQ(*LayerOffset(s, 1, 0), 2);
  EXPECT_EQ(*LayerOffset(s, 0, 1), 4);
  EXPECT_EQ(*LayerOffset(s, 1, 1), 6);
  // Uneven first / last stages: 10 layers, PP 4, first 1, last 3 -> middle 3 each.
  PipelineShape u{10, 4, 1, 1, 3};
  EXPECT_EQ(*LayerOffset(u, 0, 0), 0);
  EXPECT_EQ(*LayerOffset(u, 1, 0), 1);
  EXPECT_EQ(*LayerOffset(u, 2, 0), 4);
  EXPECT_EQ(*LayerOffset(u, 3, 0), 7);
  EXPECT_EQ(*megatron::LayersPerChunk(u, 3), 3);
  PipelineShape bad{7, 2, 1, -1, -1};
  EXPECT_FALSE(LayerOffset(bad, 1, 0).ok());
}

TEST(MegatronArgsTest, NamespaceToJson) {
  // argparse.Namespace(num_layers=4, swiglu=True, lr=0.5, name='x"y', dt=torch.bfloat16), protocol 2.
  const std::string pkl(
      "\x80\x02\x63\x61\x72\x67\x70\x61\x72\x73\x65\x0a\x4e\x61\x6d\x65\x73\x70\x61\x63\x65\x0a\x71\x00"
      "\x29\x81\x71\x01\x7d\x71\x02\x28\x58\x0a\x00\x00\x00\x6e\x75\x6d\x5f\x6c\x61\x79\x65\x72\x73\x71"
      "\x03\x4b\x04\x58\x06\x00\x00\x00\x73\x77\x69\x67\x6c\x75\x71\x04\x88\x58\x02\x00\x00\x00\x6c\x72"
      "\x71\x05\x47\x3f\xe0\x00\x00\x00\x00\x00\x00\x58\x04\x00\x00\x00\x6e\x61\x6d\x65\x71\x06\x58\x03"
      "\x00\x00\x00\x78\x22\x79\x71\x07\x58\x02\x00\x00\x00\x64\x74\x71\x08\x63\x74\x6f\x72\x63\x68\x0a"
      "\x62\x66\x6c\x6f\x61\x74\x31\x36\x0a\x71\x09\x75\x62\x2e",
      134);
  auto v = Unpickle(pkl, "args");
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(*megatron::ArgInt(v->get(), "num_layers"), 4);
  EXPECT_TRUE(*megatron::ArgBool(v->get(), "swiglu"));
  EXPECT_FALSE(megatron::ArgInt(v->get(), "absent").has_value());
  const std::string j = megatron::ToJson(v->get());
  EXPECT_NE(j.find("\"num_layers\": 4"), std::string::npos) << j;
  EXPECT_NE(j.find("\"lr\": 0.5"), std::string::npos) << j;
  EXPECT_NE(j.find("\"name\": \"x\\\"y\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"dt\": \"torch.bfloat16\""), std::string::npos) << j;
}

// A ChainedOptimizer's state in the three forms Megatron saves it, and what
// is refused.
TEST(MegatronOptimizerTest, ChainedMembersInEveryFormAndBadNumbering) {
  // {"id": n}: member n's state (a stand-in for its state dict).
  auto member = [](PickleWriter& w, int64_t n) {
    w.BeginDict();
    w.Str("id");
    w.Int(n);
    w.EndDict();
  };
  // `keys`: the dict's keys in saved order (ints, or strings when quoted);
  // "list": a list of two members.
  auto parse = [&](const std::vector<std::string>& keys) {
    PickleWriter w;
    if (keys.size() == 1 && keys[0] == "list") {
      w.BeginList();
      member(w, 0);
      member(w, 1);
      w.EndList();
    } else {
      w.BeginDict();
      for (const std::string& k : keys) {
        if (k == "None") {
          w.Int(0);
          w.None();
          continue;
        }
        int64_t n = -1;
        if (k.starts_with("'")) {
          w.Str(k.substr(1, k.size() - 2));
          std::sscanf(k.c_str(), "'chained_%" SCNd64, &n);
        } else {
          n = std::stoll(k);
          w.Int(n);
        }
        member(w, n);
      }
      w.EndDict();
    }
    auto v = Unpickle(w.Finish(), "optimizer");
    EXPECT_TRUE(v.ok()) << v.status().message();
    return std::move(*v);
  };
  auto ids = [](const std::vector<const PyValue*>& members) {
    std::vector<int64_t> out;
    for (const PyValue* m : members) out.push_back(m->Get("id")->i);
    return out;
  };
  for (const auto& keys :
       std::vector<std::vector<std::string>>{{"list"}, {"0", "1"}, {"1", "0"}, {"'chained_1'", "'chained_0'"}}) {
    PyHandle v = parse(keys);
    auto members = megatron::ChainedMembers(*v);
    ASSERT_TRUE(members.ok()) << keys[0] << ": " << members.status().message();
    EXPECT_EQ(ids(*members), (std::vector<int64_t>{0, 1})) << keys[0];
  }
  {  // One optimizer's own state dict: no members.
    PickleWriter w;
    w.BeginDict();
    w.Str("param_state_sharding_type");
    w.Str("dp_reshardable");
    w.EndDict();
    auto v = Unpickle(w.Finish(), "optimizer");
    ASSERT_TRUE(v.ok());
    auto members = megatron::ChainedMembers(**v);
    ASSERT_TRUE(members.ok());
    EXPECT_TRUE(members->empty());
  }
  for (const auto& [keys, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"0", "2"}, "not numbered 0, 1"},
           {{"1"}, "not numbered 0, 1"},
           {{"-1", "0"}, "not numbered 0, 1"},
           {{"0", "'chained_1'"}, "both by number and by chained_<i>"},
           {{"None"}, "member is empty"}}) {
    PyHandle v = parse(keys);
    auto members = megatron::ChainedMembers(*v);
    ASSERT_FALSE(members.ok()) << keys[0];
    EXPECT_NE(members.status().message().find(why), std::string::npos) << members.status().message();
  }
}

TEST(MegatronTrackerTest, FollowsTheTrackerAndReportsADanglingOne) {
  TempDir t;
  WriteFile(t.path() + "/latest_checkpointed_iteration.txt", "12\n");
  auto it = megatron::FindIterDir(t.path());
  ASSERT_FALSE(it.ok());
  EXPECT_NE(it.status().message().find("iter_0000012"), std::string::npos) << it.status().message();
  fs::create_directories(t.path() + "/iter_0000012");
  it = megatron::FindIterDir(t.path());
  ASSERT_TRUE(it.ok());
  EXPECT_EQ(it->rel, "iter_0000012");
  EXPECT_EQ(it->step, 12);
  WriteFile(t.path() + "/latest_checkpointed_iteration.txt", "garbage");
  EXPECT_FALSE(megatron::FindIterDir(t.path()).ok());
}

TEST(MegatronTrackerTest, Nemo2CheckpointsDirectoryPicksWhatAutoResumeWould) {
  TempDir t;
  auto ckpt = [&](const std::string& name) {
    fs::create_directories(t.path() + "/" + name + "/weights");
    fs::create_directories(t.path() + "/" + name + "/context");
    WriteFile(t.path() + "/" + name + "/weights/metadata.json", "{}");
  };
  // One checkpoint directory: its weights/.
  ckpt("m--val_loss=1.0-epoch=0-step=99-consumed_samples=800.0");
  auto it = megatron::FindIterDir(t.path() + "/m--val_loss=1.0-epoch=0-step=99-consumed_samples=800.0/");
  ASSERT_TRUE(it.ok()) << it.status().message();
  EXPECT_EQ(it->rel, "weights");
  EXPECT_EQ(it->step, 99);
  // Several without -last / -end: the highest step.
  ckpt("m--val_loss=0.9-epoch=0-step=199-consumed_samples=1600.0");
  it = megatron::FindIterDir(t.path());
  ASSERT_TRUE(it.ok()) << it.status().message();
  EXPECT_EQ(it->rel, "m--val_loss=0.9-epoch=0-step=199-consumed_samples=1600.0/weights");
  EXPECT_EQ(it->step, 199);
  // A finished *last wins over a higher step; an unfinished one is skipped.
  ckpt("m--val_loss=0.9-epoch=0-step=149-consumed_samples=1200.0-last");
  ckpt("m--val_loss=0.8-epoch=0-step=249-consumed_samples=2000.0-last");
  WriteFile(t.path() + "/m--val_loss=0.8-epoch=0-step=249-consumed_samples=2000.0-last-unfinished", "");
  it = megatron::FindIterDir(t.path());
  ASSERT_TRUE(it.ok()) << it.status().message();
  EXPECT_EQ(it->rel, "m--val_loss=0.9-epoch=0-step=149-consumed_samples=1200.0-last/weights");
  EXPECT_NE(it->wrapper.find("1 unfinished skipped"), std::string::npos) << it->wrapper;
  // *end over *last.
  ckpt("m--val_loss=0.7-epoch=1-step=300-consumed_samples=2400.0-end");
  it = megatron::FindIterDir(t.path());
  ASSERT_TRUE(it.ok());
  EXPECT_EQ(it->step, 300);
}

TEST(MegatronTrackerTest, Nemo2OnlyUnfinishedOrNoStepIsAnError) {
  TempDir t;
  for (const char* name : {"a", "b"}) {
    fs::create_directories(t.path() + "/" + name + "/weights");
    WriteFile(t.path() + "/" + name + "/weights/metadata.json", "{}");
  }
  auto it = megatron::FindIterDir(t.path());
  ASSERT_FALSE(it.ok());
  EXPECT_NE(it.status().message().find("cannot choose among the 2 NeMo 2 checkpoints"), std::string::npos)
      << it.status().message();
  WriteFile(t.path() + "/a-unfinished", "");
  WriteFile(t.path() + "/b-unfinished", "");
  it = megatron::FindIterDir(t.path());
  ASSERT_FALSE(it.ok());
  EXPECT_NE(it.status().message().find("unfinished"), std::string::npos) << it.status().message();
}

TEST(MegatronRunConfigTest, YamlScalarsFlattenMappingsAndSkipSequences) {
  auto kv = megatron::YamlScalars(
      "_target_: megatron.bridge.training.config.ConfigContainer\n"
      "model:\n  num_layers: 4\n  gated_linear_unit: true\n  tensor_model_parallel_size: 2\n"
      "  virtual_pipeline_model_parallel_size: null\n  num_query_groups: 4\n"
      "  transformer_layer_spec:\n    submodules:\n      mlp: {module: MLP}\n"
      "  layers: [1, 2, {num_layers: 99}]\n  anchored: &a 5\n  aliased: *a\n"
      "ddp:\n  overlap_grad_reduce: true\n  bucket_size: 40000000\n",
      "run_config.yaml");
  ASSERT_TRUE(kv.ok()) << kv.status().message();
  EXPECT_EQ(kv->at("model.num_layers"), "4");
  EXPECT_EQ(kv->at("model.transformer_layer_spec.submodules.mlp.module"), "MLP");
  EXPECT_EQ(kv->at("model.anchored"), "5");
  EXPECT_EQ(kv->count("model.aliased"), 0u);  // an alias is not expanded
  EXPECT_EQ(kv->count("model.layers.num_layers"), 0u);
  megatron::ModelFacts f = megatron::FactsOfConfig(*kv, "model.", "ddp.");
  EXPECT_EQ(f.tp, 2);
  EXPECT_EQ(f.pp, 1);
  EXPECT_EQ(f.vp, 1);  // null
  EXPECT_EQ(f.num_layers, 4);
  EXPECT_TRUE(f.swiglu);
  EXPECT_EQ(f.qkv_groups, 4);
  EXPECT_TRUE(f.overlap_grad_reduce);
  EXPECT_EQ(f.ddp_bucket_size, 40000000);
  EXPECT_EQ(f.dp, -1);
}

TEST(MegatronRunConfigTest, HostileYamlIsAnErrorNamingTheFile) {
  auto bad = megatron::YamlScalars("model: {a: [1, 2}\n", "x/run_config.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("x/run_config.yaml"), std::string::npos) << bad.status().message();
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "{a: ";
  deep += "1";
  for (int i = 0; i < 1000; ++i) deep += "}";
  auto d = megatron::YamlScalars(deep, "deep.yaml");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("nested deeper"), std::string::npos) << d.status().message();
  // Refused before libyaml sees it (libyaml is quadratic in flow depth).
  std::string seqs(1 << 20, '[');
  auto q = megatron::YamlScalars(seqs, "seq.yaml");
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("nested deeper"), std::string::npos) << q.status().message();
  // Block mappings nest by indentation only.
  std::string block;
  for (int i = 0; i < 200; ++i) block += std::string(static_cast<size_t>(i), ' ') + "k:\n";
  block += std::string(200, ' ') + "k: 1\n";
  auto b = megatron::YamlScalars(block, "block.yaml");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("nested deeper"), std::string::npos) << b.status().message();
}

std::string Zarray(const std::string& dtype, const std::string& shape, const std::string& chunks,
                   const std::string& compressor = "null") {
  return "{\"zarr_format\": 2, \"dtype\": \"" + dtype + "\", \"shape\": " + shape + ", \"chunks\": " + chunks +
         ", \"compressor\": " + compressor + ", \"fill_value\": null, \"filters\": null, \"order\": \"C\"}";
}

TEST(ZarrReaderTest, ChunksBecomeFragmentsAndAMissingChunkIsAHole) {
  TempDir t;
  // 3x4 bf16 array in 2x4 chunks: chunk 1.0 is an edge chunk (1 real row, stored full).
  WriteFile(t.path() + "/it/w/.zarray", Zarray("bfloat16", "[3, 4]", "[2, 4]"));
  WriteFile(t.path() + "/it/w/0.0", std::string(16, 'a'));
  WriteFile(t.path() + "/it/w/1.0", std::string(16, 'b'));
  WriteFile(t.path() + "/it/v/.zarray", Zarray("<f4", "[4]", "[2]"));
  WriteFile(t.path() + "/it/v/0", std::string(8, 'c'));  // chunk 1 missing
  WriteFile(t.path() + "/it/z/.zarray", Zarray("<f4", "[4]", "[4]", "{\"id\": \"blosc\"}"));
  WriteFile(t.path() + "/it/u/.zarray", Zarray("<V2", "[4]", "[4]"));
  WriteFile(t.path() + "/it/s/.zarray", Zarray("<f4", "[4]", "[4]"));
  WriteFile(t.path() + "/it/s/0", std::string(10, 'd'));  // wrong size
  Checkpoint ck;
  ASSERT_TRUE(ReadZarrArrays(t.path(), "it", ck).ok());
  auto find = [&](const std::string& k) -> size_t {
    for (size_t i = 0; i < ck.tensors.size(); ++i) {
      if (ck.tensors[i].key == k) return i;
    }
    return SIZE_MAX;
  };
  size_t w = find("w");
  ASSERT_NE(w, SIZE_MAX);
  EXPECT_EQ(ck.tensors[w].dtype, DType::kBF16);
  const std::vector<Fragment> wf = ck.fragments.Get(w);
  ASSERT_EQ(wf.size(), 2u);
  EXPECT_EQ(wf[1].offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(wf[1].lengths, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(wf[1].strides, (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(ck.files[wf[1].file.v].rel_path, "it/w/1.0");
  size_t v = find("v");
  const std::vector<Fragment> vf = ck.fragments.Get(v);
  ASSERT_EQ(vf.size(), 2u);  // the hole points at the missing file: reads of it fail naming it
  EXPECT_EQ(ck.files[vf[1].file.v].mtime_ns, -1);
  EXPECT_TRUE(ck.tensors[v].error.empty());
  EXPECT_NE(ck.tensors[find("z")].error.find("compressed"), std::string::npos);
  EXPECT_NE(ck.tensors[find("u")].error.find("void"), std::string::npos);
  EXPECT_TRUE(ck.fragments.Empty(find("s")));
  // Holes are coverage findings naming the chunk file and its region.
  std::string found;
  for (const auto& f : ck.info.findings) {
    EXPECT_EQ(f.check, Check::kCoverage);
    found += f.file + ": " + f.message + " " + f.detail + "\n";
  }
  EXPECT_NE(found.find("it/v/1: zarr chunk it/v/1 is missing: a hole at [2:4]"), std::string::npos) << found;
  EXPECT_NE(found.find("it/s/0: zarr chunk it/s/0 has 10 bytes"), std::string::npos) << found;
  EXPECT_NE(found.find(R"("holes":["[2:4]"])"), std::string::npos) << found;
}

}  // namespace
}  // namespace ckptfs::formats
