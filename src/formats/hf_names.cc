// hf/'s target vocabulary (ckptfs/hf_names.h): the architectures --hf-arch
// names, the Hugging Face tensors each has (what the planner's completeness
// check expects, whatever the source convention), name templates, and the
// config spellings two conventions share. No family's names live here: they
// are in src/formats/<family>/*_hf.cc.
#include "ckptfs/hf_names.h"

#include <iterator>

namespace ckptfs::hf {

const std::vector<Arch>& Archs() {
  static const std::vector<Arch> kArchs = {
      {"llama", "llama", "LlamaForCausalLM", Moe::kNone, Layout::kLlama},
      {"mistral", "mistral", "MistralForCausalLM", Moe::kNone, Layout::kLlama},
      {"qwen2", "qwen2", "Qwen2ForCausalLM", Moe::kNone, Layout::kLlama},
      {"qwen3", "qwen3", "Qwen3ForCausalLM", Moe::kNone, Layout::kLlama},
      {"mixtral", "mixtral", "MixtralForCausalLM", Moe::kMixtral, Layout::kLlama},
      {"qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", Moe::kQwen3, Layout::kLlama},
      {"gpt_neox", "gpt_neox", "GPTNeoXForCausalLM", Moe::kNone, Layout::kNeox},
      {"gpt2", "gpt2", "GPT2LMHeadModel", Moe::kNone, Layout::kGpt2},
      {"gemma2", "gemma2", "Gemma2ForCausalLM", Moe::kNone, Layout::kGemma2},
  };
  return kArchs;
}

const Arch* ArchByName(std::string_view name) {
  for (const Arch& a : Archs()) {
    if (name == a.name || name == a.model_type || name == a.cls) return &a;
  }
  return nullptr;
}

namespace {

// The Llama family's tensors (Llama, Mistral, Qwen2, Qwen3 and the MoE ones'
// attention and norms); the biases and QK norms by the config.
constexpr ArchTensor kLlamaCommon[] = {
    {"model.embed_tokens.weight", When::kAlways},
    {"model.norm.weight", When::kAlways},
    {"lm_head.weight", When::kUntied},
    {"model.layers.{L}.input_layernorm.weight", When::kAlways},
    {"model.layers.{L}.self_attn.q_proj.weight", When::kAlways},
    {"model.layers.{L}.self_attn.k_proj.weight", When::kAlways},
    {"model.layers.{L}.self_attn.v_proj.weight", When::kAlways},
    {"model.layers.{L}.self_attn.q_proj.bias", When::kQkvBias},
    {"model.layers.{L}.self_attn.k_proj.bias", When::kQkvBias},
    {"model.layers.{L}.self_attn.v_proj.bias", When::kQkvBias},
    {"model.layers.{L}.self_attn.o_proj.weight", When::kAlways},
    {"model.layers.{L}.self_attn.o_proj.bias", When::kOBias},
    {"model.layers.{L}.self_attn.q_norm.weight", When::kQkNorm},
    {"model.layers.{L}.self_attn.k_norm.weight", When::kQkNorm},
    {"model.layers.{L}.post_attention_layernorm.weight", When::kAlways},
};

constexpr ArchTensor kLlamaDenseMlp[] = {
    {"model.layers.{L}.mlp.gate_proj.weight", When::kAlways}, {"model.layers.{L}.mlp.up_proj.weight", When::kAlways},
    {"model.layers.{L}.mlp.gate_proj.bias", When::kMlpBias},  {"model.layers.{L}.mlp.up_proj.bias", When::kMlpBias},
    {"model.layers.{L}.mlp.down_proj.weight", When::kAlways}, {"model.layers.{L}.mlp.down_proj.bias", When::kMlpBias},
};

// Mixtral as its Hub checkpoints name it (every transformers release loads
// these names; 5.x fuses the experts on load).
constexpr ArchTensor kMixtralMlp[] = {
    {"model.layers.{L}.block_sparse_moe.gate.weight", When::kAlways},
    {"model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight", When::kAlways},
    {"model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight", When::kAlways},
    {"model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight", When::kAlways},
};

// Qwen3-MoE as its Hub checkpoints name it (mlp.gate is the router; no
// shared experts).
constexpr ArchTensor kQwen3MoeMlp[] = {
    {"model.layers.{L}.mlp.gate.weight", When::kAlways},
    {"model.layers.{L}.mlp.experts.{E}.gate_proj.weight", When::kAlways},
    {"model.layers.{L}.mlp.experts.{E}.up_proj.weight", When::kAlways},
    {"model.layers.{L}.mlp.experts.{E}.down_proj.weight", When::kAlways},
};

constexpr ArchTensor kNeox[] = {
    {"gpt_neox.embed_in.weight", When::kAlways},
    {"gpt_neox.final_layer_norm.weight", When::kAlways},
    {"gpt_neox.final_layer_norm.bias", When::kAlways},
    {"embed_out.weight", When::kUntied},
    {"gpt_neox.layers.{L}.input_layernorm.weight", When::kAlways},
    {"gpt_neox.layers.{L}.input_layernorm.bias", When::kAlways},
    {"gpt_neox.layers.{L}.attention.query_key_value.weight", When::kAlways},
    {"gpt_neox.layers.{L}.attention.query_key_value.bias", When::kAlways},
    {"gpt_neox.layers.{L}.attention.dense.weight", When::kAlways},
    {"gpt_neox.layers.{L}.attention.dense.bias", When::kAlways},
    {"gpt_neox.layers.{L}.post_attention_layernorm.weight", When::kAlways},
    {"gpt_neox.layers.{L}.post_attention_layernorm.bias", When::kAlways},
    {"gpt_neox.layers.{L}.mlp.dense_h_to_4h.weight", When::kAlways},
    {"gpt_neox.layers.{L}.mlp.dense_h_to_4h.bias", When::kAlways},
    {"gpt_neox.layers.{L}.mlp.dense_4h_to_h.weight", When::kAlways},
    {"gpt_neox.layers.{L}.mlp.dense_4h_to_h.bias", When::kAlways},
};

// Gemma 2's norms around the MLP, beside Llama's dense tensors (which its
// config gives no biases or QK norms, and a tied embedding by default); its
// post_attention_layernorm normalises the attention's output.
constexpr ArchTensor kGemma2Norms[] = {
    {"model.layers.{L}.pre_feedforward_layernorm.weight", When::kAlways},
    {"model.layers.{L}.post_feedforward_layernorm.weight", When::kAlways},
};

constexpr ArchTensor kGpt2[] = {
    {"transformer.wte.weight", When::kAlways},
    {"transformer.wpe.weight", When::kAlways},
    {"transformer.ln_f.weight", When::kAlways},
    {"transformer.ln_f.bias", When::kAlways},
    {"lm_head.weight", When::kUntied},
    {"transformer.h.{L}.ln_1.weight", When::kAlways},
    {"transformer.h.{L}.ln_1.bias", When::kAlways},
    {"transformer.h.{L}.attn.c_attn.weight", When::kAlways},
    {"transformer.h.{L}.attn.c_attn.bias", When::kAlways},
    {"transformer.h.{L}.attn.c_proj.weight", When::kAlways},
    {"transformer.h.{L}.attn.c_proj.bias", When::kAlways},
    {"transformer.h.{L}.ln_2.weight", When::kAlways},
    {"transformer.h.{L}.ln_2.bias", When::kAlways},
    {"transformer.h.{L}.mlp.c_fc.weight", When::kAlways},
    {"transformer.h.{L}.mlp.c_fc.bias", When::kAlways},
    {"transformer.h.{L}.mlp.c_proj.weight", When::kAlways},
    {"transformer.h.{L}.mlp.c_proj.bias", When::kAlways},
};

}  // namespace

std::vector<ArchTensor> ArchTensors(const Arch& a) {
  std::vector<ArchTensor> v;
  auto use = [&](const auto& table) { v.insert(v.end(), std::begin(table), std::end(table)); };
  switch (a.layout) {
    case Layout::kNeox:
      use(kNeox);
      return v;
    case Layout::kGpt2:
      use(kGpt2);
      return v;
    case Layout::kGemma2:
      use(kGemma2Norms);
      break;
    case Layout::kLlama:
      break;
  }
  use(kLlamaCommon);
  switch (a.moe) {
    case Moe::kNone:
      use(kLlamaDenseMlp);
      break;
    case Moe::kMixtral:
      use(kMixtralMlp);
      break;
    case Moe::kQwen3:
      use(kQwen3MoeMlp);
      break;
  }
  return v;
}

bool MatchTemplate(std::string_view tmpl, std::string_view name, int64_t& layer, int64_t& expert) {
  size_t i = 0, j = 0;
  while (i < tmpl.size()) {
    if (tmpl[i] == '{' && i + 2 < tmpl.size() && tmpl[i + 2] == '}') {
      const size_t start = j;
      int64_t v = 0;
      while (j < name.size() && name[j] >= '0' && name[j] <= '9' && j - start < 9) v = v * 10 + (name[j++] - '0');
      if (j == start || (j - start > 1 && name[start] == '0')) return false;
      (tmpl[i + 1] == 'L' ? layer : expert) = v;
      i += 3;
      continue;
    }
    if (j >= name.size() || tmpl[i] != name[j]) return false;
    ++i;
    ++j;
  }
  return j == name.size();
}

std::string Expand(std::string_view tmpl, int64_t layer, int64_t expert) {
  std::string out;
  for (size_t i = 0; i < tmpl.size(); ++i) {
    if (tmpl[i] == '{' && i + 2 < tmpl.size() && tmpl[i + 2] == '}') {
      out += std::to_string(tmpl[i + 1] == 'L' ? layer : expert);
      i += 2;
    } else {
      out.push_back(tmpl[i]);
    }
  }
  return out;
}

void SetRope(json& c, double theta, std::optional<double> llama3_factor) {
  json rope = {{"rope_type", "default"}, {"rope_theta", theta}};
  if (llama3_factor) {
    rope = {{"rope_type", "llama3"},  {"rope_theta", theta},     {"factor", *llama3_factor},
            {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
    c["rope_scaling"] = rope;
  }
  c["rope_theta"] = theta;
  c["rope_parameters"] = rope;
}

}  // namespace ckptfs::hf
