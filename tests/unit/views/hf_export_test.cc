#include "views/hf_export.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>

#include "../test_util.h"

namespace ckptfs::hf {
namespace {

using ckptfs::testing::TempDir;

// A synthetic Megatron (mcore names) Llama: hidden 8, 4 heads in 2 query
// groups of head_dim 2, ffn 6, vocabulary 10 padded to 12, one layer.
class HfExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    args_ = {{"num_layers", 1},
             {"hidden_size", 8},
             {"num_attention_heads", 4},
             {"num_query_groups", 2},
             {"group_query_attention", true},
             {"kv_channels", 2},
             {"ffn_hidden_size", 6},
             {"swiglu", true},
             {"vocab_size", 10},
             {"padded_vocab_size", 12},
             {"add_bias_linear", false},
             {"normalization", "RMSNorm"},
             {"position_embedding_type", "rope"},
             {"rotary_base", 500000},
             {"norm_epsilon", 1e-6},
             {"untie_embeddings_and_output_weights", true},
             {"bf16", true}};
    params_ = {{"embedding.word_embeddings.weight", {12, 8}},
               {"decoder.layers.0.input_layernorm.weight", {8}},
               {"decoder.layers.0.self_attention.linear_qkv.weight", {16, 8}},
               {"decoder.layers.0.self_attention.linear_proj.weight", {8, 8}},
               {"decoder.layers.0.pre_mlp_layernorm.weight", {8}},
               {"decoder.layers.0.mlp.linear_fc1.weight", {12, 8}},
               {"decoder.layers.0.mlp.linear_fc2.weight", {8, 6}},
               {"decoder.final_layernorm.weight", {8}},
               {"output_layer.weight", {12, 8}}};
  }
  Result<HfPlan> Plan(const TopoOptions& opts = {}, DType dtype = DType::kBF16) {
    Checkpoint ck;
    uint64_t off = 0;
    for (const auto& [fqn, shape] : params_) {
      TensorRecord r;
      r.key = fqn;
      r.role = Role::kParam;
      r.fqn = fqn;
      r.state = "param";
      r.dtype = dtype;
      r.shape = shape;
      Fragment f = ckptfs::testing::WholeFragment(shape, dtype, off);
      off += f.data_length;
      ck.AddTensor(r, {f});
    }
    ckptfs::testing::WriteFile(dir_.path() + "/d", std::string(off, '\0'));
    ck.files.push_back(SourceFile{"d", 0, 0, 0});
    ckptfs::testing::FillStat(dir_.path(), &ck.files[0]);
    ck.info.family = family_;
    if (!args_.is_null()) {
      ExportPart p;
      p.literal = args_.dump();
      p.size = p.literal.size();
      ck.exports.push_back(ExportFile{"args.json", {p}});
    }
    const std::string ix = dir_.path() + "/ix" + std::to_string(builds_++);
    if (Status st = Index::Build(ck, ix); !st.ok()) return st;
    ASSIGN_OR_RETURN(index_, Index::Open(ix, dir_.path()));
    return PlanHf(*index_, opts);
  }
  static const HfTensor* Find(const HfPlan& p, const std::string& name) {
    for (const HfTensor& t : p.tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
  static std::vector<std::pair<int64_t, int64_t>> Rows(const HfTensor& t) {
    std::vector<std::pair<int64_t, int64_t>> v;
    for (const Box& b : t.pieces) v.emplace_back(b.offsets[0], b.offsets[0] + b.lengths[0]);
    return v;
  }
  static std::string Errors(const HfPlan& p) {
    std::string s;
    for (const std::string& e : p.errors) s += e + "\n";
    return s;
  }

  TempDir dir_;
  nlohmann::json args_;
  Family family_ = Family::kMegatronLegacy;
  std::map<std::string, std::vector<int64_t>> params_;
  std::unique_ptr<Index> index_;
  int builds_ = 0;
};

TEST_F(HfExportTest, MegatronLlamaSplitsQkvPerGroupAndFc1IntoGateAndUp) {
  auto p = Plan();
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->architecture, "LlamaForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  ASSERT_EQ(p->tensors.size(), 12u);  // q, k, v and gate, up from two sources
  // Each query group is [q (2 heads x 2) | k (2) | v (2)] = 8 rows.
  const HfTensor* q = Find(*p, "model.layers.0.self_attn.q_proj.weight");
  const HfTensor* k = Find(*p, "model.layers.0.self_attn.k_proj.weight");
  const HfTensor* v = Find(*p, "model.layers.0.self_attn.v_proj.weight");
  ASSERT_TRUE(q && k && v);
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(Rows(*q), (R{{0, 4}, {8, 12}}));
  EXPECT_EQ(Rows(*k), (R{{4, 6}, {12, 14}}));
  EXPECT_EQ(Rows(*v), (R{{6, 8}, {14, 16}}));
  EXPECT_EQ(q->shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(k->shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(q->pieces[0].lengths, (std::vector<int64_t>{4, 8}));  // whole rows
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.mlp.gate_proj.weight")), (R{{0, 6}}));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.mlp.up_proj.weight")), (R{{6, 12}}));
  // The padded vocabulary rows are cut from both ends of the model.
  EXPECT_EQ(Find(*p, "model.embed_tokens.weight")->shape, (std::vector<int64_t>{10, 8}));
  EXPECT_EQ(Find(*p, "lm_head.weight")->shape, (std::vector<int64_t>{10, 8}));
  EXPECT_EQ(Find(*p, "model.layers.0.post_attention_layernorm.weight")->id.v, 4u);  // pre_mlp_layernorm
  for (const HfTensor& t : p->tensors) EXPECT_EQ(t.out, DType::kBF16) << t.name;

  auto c = nlohmann::json::parse(p->config_json);
  EXPECT_EQ(c["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["head_dim"], 2);
  EXPECT_EQ(c["intermediate_size"], 6);
  EXPECT_EQ(c["vocab_size"], 10);
  EXPECT_EQ(c["rms_norm_eps"], 1e-6);
  EXPECT_EQ(c["rope_parameters"]["rope_theta"], 500000.0);
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
}

TEST_F(HfExportTest, LegacyNamesMapLikeMcoreNames) {
  params_ = {{"language_model.embedding.word_embeddings.weight", {12, 8}},
             {"language_model.encoder.layers.0.input_layernorm.weight", {8}},
             {"language_model.encoder.layers.0.self_attention.query_key_value.weight", {16, 8}},
             {"language_model.encoder.layers.0.self_attention.dense.weight", {8, 8}},
             {"language_model.encoder.layers.0.post_attention_layernorm.weight", {8}},
             {"language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", {12, 8}},
             {"language_model.encoder.layers.0.mlp.dense_4h_to_h.weight", {8, 6}},
             {"language_model.encoder.final_layernorm.weight", {8}},
             {"language_model.output_layer.weight", {12, 8}}};
  auto p = Plan();
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(Errors(*p), "");
  EXPECT_EQ(p->tensors.size(), 12u);
  EXPECT_TRUE(Find(*p, "model.layers.0.self_attn.o_proj.weight"));
  EXPECT_TRUE(Find(*p, "model.layers.0.post_attention_layernorm.weight"));
}

TEST_F(HfExportTest, ArchitectureFromArgs) {
  args_["add_qkv_bias"] = true;
  params_["decoder.layers.0.self_attention.linear_qkv.bias"] = {16};
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  ASSERT_TRUE(Find(*p, "model.layers.0.self_attn.k_proj.bias"));
  EXPECT_EQ(Find(*p, "model.layers.0.self_attn.k_proj.bias")->shape, (std::vector<int64_t>{4}));

  // A Qwen2 run has a QKV bias the Llama tables would leave out: --hf-arch
  // llama is refused with the reason.
  TopoOptions o;
  o.hf_arch = "llama";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "");
  EXPECT_EQ(p->config_json, "");
  EXPECT_NE(Errors(*p).find("--hf-arch llama does not fit: the run's args describe a qwen2 model"), std::string::npos)
      << Errors(*p);

  args_["add_qkv_bias"] = false;
  params_.erase("decoder.layers.0.self_attention.linear_qkv.bias");
  o.hf_arch = "mistral";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "MistralForCausalLM");
  EXPECT_EQ(Errors(*p), "");

  o.hf_arch = "gpt-j";
  EXPECT_FALSE(Plan(o).ok());
}

TEST_F(HfExportTest, UnrecognisedRunsKeepSourceNamesAndSayWhy) {
  args_["normalization"] = "LayerNorm";
  args_.erase("position_embedding_type");  // Megatron's default: learned_absolute
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "");
  EXPECT_EQ(p->config_json, "");
  EXPECT_EQ(p->tensors.size(), params_.size());
  EXPECT_TRUE(Find(*p, "decoder.layers.0.self_attention.linear_qkv.weight"));
  const std::string e = Errors(*p);
  EXPECT_NE(e.find("position_embedding_type is 'learned_absolute'"), std::string::npos) << e;
  EXPECT_NE(e.find("normalization is 'LayerNorm'"), std::string::npos) << e;

  args_ = nullptr;  // no args at all: --hf-config is the way
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("pass --hf-config FILE"), std::string::npos) << Errors(*p);
}

TEST_F(HfExportTest, AMissingLayerTensorIsNamedNotRandomlyInitialised) {
  params_.erase("decoder.layers.0.self_attention.linear_proj.weight");
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("'model.layers.0.self_attn.o_proj.weight' is missing"), std::string::npos) << Errors(*p);
  // A QKV that is not whole query groups cannot be split.
  SetUp();
  params_["decoder.layers.0.self_attention.linear_qkv.weight"] = {14, 8};
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("14 rows are not 2 query groups of (2 + 2) x 2"), std::string::npos) << Errors(*p);
  EXPECT_FALSE(Find(*p, "model.layers.0.self_attn.q_proj.weight"));
}

// RoPE + LayerNorm + a GELU MLP with biases and one key-value head per query
// head: GPT-NeoX, whose query_key_value is Megatron's fused QKV as it is; with
// learned positions, GPT-2.
TEST_F(HfExportTest, MegatronGeluRunsAreGptNeoxOrGpt2) {
  args_.update({{"swiglu", false},
                {"normalization", "LayerNorm"},
                {"add_bias_linear", true},
                {"num_query_groups", 4},
                {"group_query_attention", false},
                {"rotary_percent", 0.5},
                {"norm_epsilon", 1e-5},
                {"ffn_hidden_size", 16}});
  params_ = {{"embedding.word_embeddings.weight", {12, 8}},
             {"decoder.layers.0.input_layernorm.weight", {8}},
             {"decoder.layers.0.input_layernorm.bias", {8}},
             {"decoder.layers.0.self_attention.linear_qkv.weight", {24, 8}},
             {"decoder.layers.0.self_attention.linear_qkv.bias", {24}},
             {"decoder.layers.0.self_attention.linear_proj.weight", {8, 8}},
             {"decoder.layers.0.self_attention.linear_proj.bias", {8}},
             {"decoder.layers.0.pre_mlp_layernorm.weight", {8}},
             {"decoder.layers.0.pre_mlp_layernorm.bias", {8}},
             {"decoder.layers.0.mlp.linear_fc1.weight", {16, 8}},
             {"decoder.layers.0.mlp.linear_fc1.bias", {16}},
             {"decoder.layers.0.mlp.linear_fc2.weight", {8, 16}},
             {"decoder.layers.0.mlp.linear_fc2.bias", {8}},
             {"decoder.final_layernorm.weight", {8}},
             {"decoder.final_layernorm.bias", {8}},
             {"output_layer.weight", {12, 8}}};
  auto p = Plan();
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->architecture, "GPTNeoXForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  EXPECT_EQ(p->tensors.size(), params_.size());
  const HfTensor* qkv = Find(*p, "gpt_neox.layers.0.attention.query_key_value.weight");
  ASSERT_TRUE(qkv);
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(Rows(*qkv), (R{{0, 24}}));
  EXPECT_EQ(Rows(*Find(*p, "gpt_neox.embed_in.weight")), (R{{0, 10}}));  // the padding rows cut
  EXPECT_TRUE(Find(*p, "embed_out.weight") && Find(*p, "gpt_neox.final_layer_norm.bias") &&
              Find(*p, "gpt_neox.layers.0.post_attention_layernorm.bias") &&
              Find(*p, "gpt_neox.layers.0.mlp.dense_4h_to_h.bias"));
  const auto c = nlohmann::json::parse(p->config_json);
  EXPECT_EQ(c["model_type"], "gpt_neox");
  EXPECT_EQ(c["use_parallel_residual"], false);
  EXPECT_EQ(c["hidden_act"], "gelu");
  EXPECT_EQ(c["rotary_pct"], 0.5);
  EXPECT_EQ(c["rope_parameters"]["partial_rotary_factor"], 0.5);
  EXPECT_EQ(c["intermediate_size"], 16);
  EXPECT_EQ(c["vocab_size"], 10);
  EXPECT_EQ(c["tie_word_embeddings"], false);
  // Megatron's openai_gelu is transformers' gelu_new.
  args_["openai_gelu"] = true;
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(nlohmann::json::parse(p->config_json)["hidden_act"], "gelu_new");
  // Grouped-query attention has no GPT-NeoX form: named, and no config.json.
  args_.update({{"num_query_groups", 2}, {"group_query_attention", true}});
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->config_json.empty());
  EXPECT_NE(Errors(*p).find("grouped-query attention (2 key-value heads for 4 query heads"), std::string::npos)
      << Errors(*p);
  // Learned absolute positions instead of RoPE: GPT-2, whose Conv1D weights
  // are transposes, and c_attn the per-head [q | k | v] rows regrouped.
  args_.update({{"num_query_groups", 4},
                {"group_query_attention", false},
                {"openai_gelu", false},
                {"position_embedding_type", "learned_absolute"},
                {"max_position_embeddings", 16}});
  params_["embedding.position_embeddings.weight"] = {16, 8};
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "GPT2LMHeadModel");
  EXPECT_EQ(Errors(*p), "");
  const HfTensor* attn = Find(*p, "transformer.h.0.attn.c_attn.weight");
  ASSERT_TRUE(attn);
  EXPECT_TRUE(attn->transposed);
  EXPECT_EQ(attn->shape, (std::vector<int64_t>{8, 24}));
  // 4 heads of 2 rows, per head [q | k | v]: q rows 0-1, 6-7, 12-13, 18-19 first.
  EXPECT_EQ(Rows(*attn), (R{{0, 2},
                            {6, 8},
                            {12, 14},
                            {18, 20},
                            {2, 4},
                            {8, 10},
                            {14, 16},
                            {20, 22},
                            {4, 6},
                            {10, 12},
                            {16, 18},
                            {22, 24}}));
  const HfTensor* attn_b = Find(*p, "transformer.h.0.attn.c_attn.bias");
  ASSERT_TRUE(attn_b);
  EXPECT_FALSE(attn_b->transposed);
  EXPECT_EQ(Rows(*attn_b), Rows(*attn));
  const HfTensor* fc = Find(*p, "transformer.h.0.mlp.c_fc.weight");
  ASSERT_TRUE(fc && fc->transposed);
  EXPECT_EQ(fc->shape, (std::vector<int64_t>{8, 16}));
  EXPECT_FALSE(Find(*p, "transformer.wpe.weight")->transposed);
  const auto g = nlohmann::json::parse(p->config_json);
  EXPECT_EQ(g["model_type"], "gpt2");
  EXPECT_EQ(g["n_head"], 4);
  EXPECT_EQ(g["n_inner"], 16);
  EXPECT_EQ(g["n_positions"], 16);
  // --hf-arch gpt_neox on a Llama run says what does not fit.
  SetUp();
  TopoOptions o;
  o.hf_arch = "gpt_neox";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("normalization is 'RMSNorm' (GPTNeoXForCausalLM uses 'LayerNorm')"), std::string::npos)
      << Errors(*p);
  EXPECT_NE(Errors(*p).find("the MLP is SwiGLU"), std::string::npos) << Errors(*p);
}

TEST_F(HfExportTest, DtypeChoices) {
  TopoOptions o;
  o.hf_dtype = "fp32";  // bf16 widened
  auto p = Plan(o);
  ASSERT_TRUE(p.ok());
  for (const HfTensor& t : p->tensors) EXPECT_EQ(t.out, DType::kF32);
  EXPECT_EQ(nlohmann::json::parse(p->config_json)["torch_dtype"], "float32");
  // float32 narrows to bf16 / fp16 (round to nearest even in the read engine).
  for (const char* d : {"bf16", "fp16"}) {
    o.hf_dtype = d;
    p = Plan(o, DType::kF32);
    ASSERT_TRUE(p.ok());
    ASSERT_FALSE(p->tensors.empty());
    const DType want = std::string(d) == "bf16" ? DType::kBF16 : DType::kF16;
    for (const HfTensor& t : p->tensors) EXPECT_EQ(t.out, want);
    EXPECT_EQ(nlohmann::json::parse(p->config_json)["torch_dtype"], want == DType::kBF16 ? "bfloat16" : "float16");
  }
  // bf16 to fp16 is neither: each tensor says so.
  o.hf_dtype = "fp16";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->tensors.empty());
  EXPECT_NE(Errors(*p).find("float32 to bfloat16 / float16, not to float16"), std::string::npos) << Errors(*p);
  // master: the fp32 copies, which this checkpoint lacks.
  o.hf_dtype = "master";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("has no fp32 master copy"), std::string::npos) << Errors(*p);
  o.hf_dtype = "int4";
  EXPECT_FALSE(Plan(o).ok());
}

TEST_F(HfExportTest, ConfigFileDecidesForOtherFamilies) {
  // A config.json beside a non-Megatron checkpoint whose parameters already
  // have Hugging Face names: served with its config, names unchanged.
  family_ = Family::kDeepSpeed;
  args_ = nullptr;
  params_ = {{"model.embed_tokens.weight", {10, 8}}, {"model.norm.weight", {8}}};
  ckptfs::testing::WriteFile(dir_.path() + "/config.json",
                             R"({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})");
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "GPTNeoXForCausalLM");
  EXPECT_TRUE(Find(*p, "model.norm.weight"));
  EXPECT_EQ(nlohmann::json::parse(p->config_json)["torch_dtype"], "bfloat16");
  // A known model_type is checked against its tables: every layer tensor of
  // the Llama layout is missing here.
  ckptfs::testing::WriteFile(dir_.path() + "/config.json",
                             R"({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "hidden_size": 8, "vocab_size": 10})");
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "LlamaForCausalLM");
  EXPECT_NE(Errors(*p).find("'model.layers.0.self_attn.q_proj.weight' is missing"), std::string::npos);
  EXPECT_NE(Errors(*p).find("'lm_head.weight' is missing"), std::string::npos);
  // Counts no checkpoint this size could hold are not looped over.
  ckptfs::testing::WriteFile(
      dir_.path() + "/config.json",
      R"({"model_type": "mixtral", "num_hidden_layers": 1000000000, "num_local_experts": 99999})");
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("completeness is not checked"), std::string::npos) << Errors(*p);
  ckptfs::testing::WriteFile(dir_.path() + "/config.json", "{not json");
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("cannot parse " + dir_.path() + "/config.json"), std::string::npos) << Errors(*p);
}

// Meta's reference names (torchtitan 0.2's too) of one layer: dim 8, 2 query
// heads and 1 key-value head of head_dim 4, ffn 6, vocabulary 10.
std::map<std::string, std::vector<int64_t>> MetaLayerNames() {
  return {{"tok_embeddings.weight", {10, 8}},
          {"norm.weight", {8}},
          {"output.weight", {10, 8}},
          {"layers.0.attention_norm.weight", {8}},
          {"layers.0.attention.wq.weight", {8, 8}},
          {"layers.0.attention.wk.weight", {4, 8}},
          {"layers.0.attention.wv.weight", {4, 8}},
          {"layers.0.attention.wo.weight", {8, 8}},
          {"layers.0.ffn_norm.weight", {8}},
          {"layers.0.feed_forward.w1.weight", {6, 8}},
          {"layers.0.feed_forward.w2.weight", {8, 6}},
          {"layers.0.feed_forward.w3.weight", {6, 8}}};
}

TEST_F(HfExportTest, TorchtitanNamesWithTheirRopePermutation) {
  family_ = Family::kPytorchDcp;
  args_ = nullptr;
  // dim 8, 2 query heads and 1 key-value head of head_dim 4, ffn 6, vocabulary 10.
  params_ = MetaLayerNames();
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "");
  EXPECT_NE(Errors(*p).find("torchtitan records none in its checkpoint"), std::string::npos) << Errors(*p);

  const std::string cfg = dir_.path() + "/llama.json";
  ckptfs::testing::WriteFile(cfg, R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
      "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
      "intermediate_size": 6, "vocab_size": 10})");
  TopoOptions o;
  o.hf_config = cfg;
  p = Plan(o);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->architecture, "LlamaForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  EXPECT_EQ(p->tensors.size(), 12u);
  using R = std::vector<std::pair<int64_t, int64_t>>;
  // Per head: even rows, then odd rows (interleaved pairs -> halves).
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.q_proj.weight")),
            (R{{0, 1}, {2, 3}, {1, 2}, {3, 4}, {4, 5}, {6, 7}, {5, 6}, {7, 8}}));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.k_proj.weight")), (R{{0, 1}, {2, 3}, {1, 2}, {3, 4}}));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.v_proj.weight")), (R{{0, 4}}));
  EXPECT_EQ(Find(*p, "model.layers.0.mlp.up_proj.weight")->id.v,
            Find(*p, "model.layers.0.mlp.gate_proj.weight")->id.v + 2);  // w3 is up, w1 gate
  // A head_dim that is odd cannot be a RoPE layout.
  ckptfs::testing::WriteFile(cfg, R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 3, "vocab_size": 10})");
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("8 rows are not 2 heads of an even head_dim 3"), std::string::npos) << Errors(*p);
}

TEST_F(HfExportTest, TorchtitanQwen3IsCopiedAndItsGroupedExpertsSplitPerExpert) {
  family_ = Family::kPytorchDcp;
  args_ = nullptr;
  // dim 8, 2 query heads and 1 key-value head of head_dim 4, QK norms, one
  // MoE layer of 3 experts with ffn 6, vocabulary 10, tied.
  params_ = {{"tok_embeddings.weight", {10, 8}},
             {"norm.weight", {8}},
             {"lm_head.weight", {10, 8}},
             {"layers.0.attention_norm.weight", {8}},
             {"layers.0.attention.qkv_linear.wq.weight", {8, 8}},
             {"layers.0.attention.qkv_linear.wk.weight", {4, 8}},
             {"layers.0.attention.qkv_linear.wv.weight", {4, 8}},
             {"layers.0.attention.wo.weight", {8, 8}},
             {"layers.0.attention.q_norm.weight", {4}},
             {"layers.0.attention.k_norm.weight", {4}},
             {"layers.0.ffn_norm.weight", {8}},
             {"layers.0.moe.router.gate.weight", {3, 8}},
             {"layers.0.moe.expert_bias_E", {3}},
             {"layers.0.moe.routed_experts.inner_experts.w1_EFD", {3, 6, 8}},
             {"layers.0.moe.routed_experts.inner_experts.w3_EFD", {3, 6, 8}},
             {"layers.0.moe.routed_experts.inner_experts.w2_EDF", {3, 8, 6}}};
  const std::string cfg = dir_.path() + "/qwen3_moe.json";
  const char* kConfig = R"({"model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "moe_intermediate_size": 6,
      "num_experts": 3, "num_experts_per_tok": 2, "vocab_size": 10, "tie_word_embeddings": true})";
  ckptfs::testing::WriteFile(cfg, kConfig);
  TopoOptions o;
  o.hf_config = cfg;
  auto p = Plan(o);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->architecture, "Qwen3MoeForCausalLM");
  // wq / wk are copied (Qwen3 rotates halves), not permuted as Llama's are.
  using R = std::vector<std::pair<int64_t, int64_t>>;
  ASSERT_TRUE(Find(*p, "model.layers.0.self_attn.q_proj.weight"));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.q_proj.weight")), (R{{0, 8}}));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.k_proj.weight")), (R{{0, 4}}));
  ASSERT_TRUE(Find(*p, "model.layers.0.self_attn.q_norm.weight"));
  ASSERT_TRUE(Find(*p, "model.layers.0.mlp.gate.weight"));
  // Expert e of w1 [E, F, D] is the box [e, 0, 0] + [1, F, D], an [F, D] tensor.
  for (int64_t e = 0; e < 3; ++e) {
    for (const auto& [hf, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"gate_proj", {6, 8}}, {"up_proj", {6, 8}}, {"down_proj", {8, 6}}}) {
      const HfTensor* t = Find(*p, "model.layers.0.mlp.experts." + std::to_string(e) + "." + hf + ".weight");
      ASSERT_TRUE(t) << e << hf;
      EXPECT_EQ(t->shape, shape);
      ASSERT_EQ(t->pieces.size(), 1u);
      EXPECT_EQ(t->pieces[0].offsets, (std::vector<int64_t>{e, 0, 0}));
      EXPECT_EQ(t->pieces[0].lengths, (std::vector<int64_t>{1, shape[0], shape[1]}));
    }
  }
  EXPECT_EQ(Find(*p, "model.layers.0.mlp.experts.0.up_proj.weight")->id.v,
            Find(*p, "model.layers.0.mlp.experts.0.gate_proj.weight")->id.v + 2);  // w3 is up, w1 gate
  // Tied: lm_head left out; the load-balancing bias left out with its reason.
  EXPECT_FALSE(Find(*p, "lm_head.weight"));
  const std::string e = Errors(*p);
  EXPECT_NE(e.find("'layers.0.moe.expert_bias_E' is not included: torchtitan's load-balancing bias"), std::string::npos)
      << e;
  EXPECT_EQ(e.find("is missing"), std::string::npos) << e;
  EXPECT_EQ(p->tensors.size(), 11u + 9u);

  // The config's expert count must be the grouped weights' first dimension.
  ckptfs::testing::WriteFile(
      cfg, std::string(kConfig).replace(std::string(kConfig).find("\"num_experts\": 3"), 16, "\"num_experts\": 4"));
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("its shape [3, 6, 8] is not the 4 experts the config has"), std::string::npos)
      << Errors(*p);
  EXPECT_NE(Errors(*p).find("'model.layers.0.mlp.experts.3.gate_proj.weight' is missing"), std::string::npos);

  // A Llama config over Qwen3's tensors would permute wq / wk: refused.
  ckptfs::testing::WriteFile(cfg, R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10})");
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "");
  EXPECT_NE(Errors(*p).find("the checkpoint has QK norms (torchtitan's Qwen3), and the config is llama"),
            std::string::npos)
      << Errors(*p);
  // Dense Qwen3-MoE layers are not mapped.
  ckptfs::testing::WriteFile(cfg, R"({"model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 3, "vocab_size": 10,
      "mlp_only_layers": [0]})");
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("mixes dense and MoE layers"), std::string::npos) << Errors(*p);

  // Dense torchtitan Qwen3: feed_forward w1 / w3 / w2.
  for (const char* k :
       {"layers.0.moe.router.gate.weight", "layers.0.moe.expert_bias_E",
        "layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.routed_experts.inner_experts.w3_EFD",
        "layers.0.moe.routed_experts.inner_experts.w2_EDF"}) {
    params_.erase(k);
  }
  params_["layers.0.feed_forward.w1.weight"] = {6, 8};
  params_["layers.0.feed_forward.w3.weight"] = {6, 8};
  params_["layers.0.feed_forward.w2.weight"] = {8, 6};
  ckptfs::testing::WriteFile(cfg, R"({"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 6,
      "vocab_size": 10, "tie_word_embeddings": false})");
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  EXPECT_EQ(p->tensors.size(), 14u);
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.self_attn.q_proj.weight")), (R{{0, 8}}));
}

TEST_F(HfExportTest, MegatronMoeRunsAreMixtralOrQwen3MoeByTheirQkNorms) {
  args_["num_experts"] = 2;
  args_["moe_router_topk"] = 1;
  args_["moe_ffn_hidden_size"] = 4;
  params_.erase("decoder.layers.0.mlp.linear_fc1.weight");
  params_.erase("decoder.layers.0.mlp.linear_fc2.weight");
  params_["decoder.layers.0.mlp.router.weight"] = {2, 8};
  for (int e = 0; e < 2; ++e) {
    params_["decoder.layers.0.mlp.experts.local_experts." + std::to_string(e) + ".linear_fc1.weight"] = {8, 8};
    params_["decoder.layers.0.mlp.experts.local_experts." + std::to_string(e) + ".linear_fc2.weight"] = {8, 4};
  }
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "MixtralForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  EXPECT_TRUE(Find(*p, "model.layers.0.block_sparse_moe.experts.1.w3.weight"));
  auto c = nlohmann::json::parse(p->config_json);
  EXPECT_EQ(c["num_local_experts"], 2);
  EXPECT_EQ(c["intermediate_size"], 4);

  // QK layer norms make it Qwen3-MoE: its names, its config keys.
  args_["qk_layernorm"] = true;
  params_["decoder.layers.0.self_attention.q_layernorm.weight"] = {2};
  params_["decoder.layers.0.self_attention.k_layernorm.weight"] = {2};
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  using R = std::vector<std::pair<int64_t, int64_t>>;
  ASSERT_TRUE(Find(*p, "model.layers.0.mlp.experts.1.up_proj.weight"));
  EXPECT_EQ(Rows(*Find(*p, "model.layers.0.mlp.experts.1.up_proj.weight")), (R{{4, 8}}));
  EXPECT_TRUE(Find(*p, "model.layers.0.mlp.experts.0.down_proj.weight"));
  EXPECT_TRUE(Find(*p, "model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(Find(*p, "model.layers.0.self_attn.k_norm.weight"));
  c = nlohmann::json::parse(p->config_json);
  EXPECT_EQ(c["model_type"], "qwen3_moe");
  EXPECT_EQ(c["num_experts"], 2);
  EXPECT_EQ(c["moe_intermediate_size"], 4);
  EXPECT_EQ(c["intermediate_size"], 6);
  EXPECT_EQ(c["norm_topk_prob"], true);
  EXPECT_EQ(c["num_experts_per_tok"], 1);
  TopoOptions o;
  o.hf_arch = "mixtral";
  p = Plan(o);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(Errors(*p).find("--hf-arch mixtral does not fit: the run's args describe a qwen3_moe model"),
            std::string::npos)
      << Errors(*p);
}

// Meta's reference names (consolidated.NN.pth, torchtitan's too): config.json
// from the params.json beside them, when no config.json is there.
TEST_F(HfExportTest, MetaParamsJsonGivesTheConfig) {
  family_ = Family::kMetaConsolidated;
  args_ = nullptr;
  params_ = MetaLayerNames();
  ckptfs::testing::WriteFile(dir_.path() + "/params.json",
                             R"({"dim": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "vocab_size": -1,
                                 "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": true})");
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "LlamaForCausalLM");
  EXPECT_EQ(Errors(*p), "");
  EXPECT_EQ(p->tensors.size(), 12u);
  EXPECT_EQ(p->config_json, R"({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "model_type": "llama",
  "hidden_size": 8,
  "intermediate_size": 6,
  "num_hidden_layers": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 4,
  "hidden_act": "silu",
  "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05,
  "initializer_range": 0.02,
  "vocab_size": 10,
  "tie_word_embeddings": false,
  "rope_scaling": {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192
  },
  "rope_theta": 500000.0,
  "rope_parameters": {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192
  },
  "attention_bias": false,
  "mlp_bias": false,
  "attention_dropout": 0.0,
  "use_cache": true,
  "torch_dtype": "bfloat16",
  "dtype": "bfloat16"
}
)");
  // The same names as a torch.save directory's: the same path.
  family_ = Family::kTorchSave;
  auto q = Plan();
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->config_json, p->config_json);
  // A config.json beside the weights comes first.
  ckptfs::testing::WriteFile(dir_.path() + "/config.json", R"({"model_type": "qwen2"})");
  q = Plan();
  ASSERT_TRUE(q.ok());
  EXPECT_NE(Errors(*q).find("torchtitan's names map to llama, mistral, qwen3 or qwen3_moe, not qwen2"),
            std::string::npos)
      << Errors(*q);
  ASSERT_EQ(::unlink((dir_.path() + "/config.json").c_str()), 0);
  ckptfs::testing::WriteFile(dir_.path() + "/params.json", R"({"dim": 8})");
  q = Plan();
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(Errors(*q), "hf/: not a transformers model directory: " + dir_.path() +
                            "/params.json: not a Meta params.json (an object with dim and n_heads)\n"
                            "hf/: the parameters are served under their source names, without config.json\n");
  // Megatron's names are not Meta's, whatever the files beside them.
  family_ = Family::kMegatronLegacy;
  q = Plan();
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(Errors(*q),
            "hf/: not a transformers model directory: the checkpoint records no Megatron args; pass --hf-config FILE "
            "(a config.json)\n"
            "hf/: the parameters are served under their source names, without config.json\n");
}

// verl keeps the model's config.json and tokenizer in huggingface/; one
// beside the weights comes first.
TEST_F(HfExportTest, ConfigAndTokenizerFromHuggingfaceDirectory) {
  family_ = Family::kVerl;
  args_ = nullptr;
  params_ = {{"model.embed_tokens.weight", {10, 8}}, {"model.norm.weight", {8}}};
  ASSERT_EQ(::mkdir((dir_.path() + "/huggingface").c_str(), 0755), 0);
  ckptfs::testing::WriteFile(dir_.path() + "/huggingface/config.json",
                             R"({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})");
  ckptfs::testing::WriteFile(dir_.path() + "/huggingface/tokenizer.json", "{}");
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "GPTNeoXForCausalLM");
  ASSERT_EQ(p->side_files.size(), 1u);
  EXPECT_EQ(p->side_files[0].first, "tokenizer.json");
  ckptfs::testing::WriteFile(dir_.path() + "/config.json", R"({"model_type": "x", "architectures": ["XForY"]})");
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "XForY");
  EXPECT_TRUE(p->side_files.empty());
  // Any family's directory is looked at the same way.
  ASSERT_EQ(::unlink((dir_.path() + "/config.json").c_str()), 0);
  family_ = Family::kDeepSpeed;
  p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->architecture, "GPTNeoXForCausalLM");
}

// The Megatron fixture's config.json, whole.
TEST_F(HfExportTest, MegatronConfigJsonText) {
  auto p = Plan();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->config_json, R"({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "model_type": "llama",
  "hidden_size": 8,
  "intermediate_size": 6,
  "num_hidden_layers": 1,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 2,
  "hidden_act": "silu",
  "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-06,
  "initializer_range": 0.02,
  "vocab_size": 10,
  "tie_word_embeddings": false,
  "rope_theta": 500000.0,
  "rope_parameters": {
    "rope_type": "default",
    "rope_theta": 500000.0
  },
  "attention_dropout": 0.1,
  "use_cache": true,
  "attention_bias": false,
  "mlp_bias": false,
  "ckptfs_source": "megatron",
  "torch_dtype": "bfloat16",
  "dtype": "bfloat16"
}
)");
}

}  // namespace
}  // namespace ckptfs::hf
