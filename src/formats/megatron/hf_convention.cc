// Megatron's names, args and config.json for hf/: the rule tables from mcore
// names to each target's, legacy names rewritten to mcore's, which target a
// run is by its args (argparse defaults where a field is absent) and the
// config.json it gets. Registered on the Megatron readers' rows (detect.cc
// WithMegatronHooks); recognised by the family's naming trait.
#include "formats/megatron/hf_convention.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/formats.h"

namespace ckptfs::formats::megatron {
namespace {

using hf::Arch;
using hf::ArchByName;
using hf::json;
using hf::JsonGet;
using hf::Layout;
using hf::MapRule;
using hf::Moe;
using hf::Op;
using hf::SetRope;
using hf::When;

// Megatron (mcore names) -> Hugging Face; several rules may produce the same
// dst from alternative source names: local-spec norms vs Transformer
// Engine's fused layer_norm_weight.
constexpr MapRule kMegatronCommon[] = {
    {"embedding.word_embeddings.weight", "model.embed_tokens.weight", Op::kVocab, When::kAlways},
    {"decoder.final_layernorm.weight", "model.norm.weight", Op::kCopy, When::kAlways},
    {"output_layer.weight", "lm_head.weight", Op::kVocab, When::kUntied},
    {"decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.weight", "model.layers.{L}.self_attn.q_proj.weight", Op::kQ,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.weight", "model.layers.{L}.self_attn.k_proj.weight", Op::kK,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.weight", "model.layers.{L}.self_attn.v_proj.weight", Op::kV,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.bias", "model.layers.{L}.self_attn.q_proj.bias", Op::kQ,
     When::kQkvBias},
    {"decoder.layers.{L}.self_attention.linear_qkv.bias", "model.layers.{L}.self_attn.k_proj.bias", Op::kK,
     When::kQkvBias},
    {"decoder.layers.{L}.self_attention.linear_qkv.bias", "model.layers.{L}.self_attn.v_proj.bias", Op::kV,
     When::kQkvBias},
    {"decoder.layers.{L}.self_attention.linear_proj.weight", "model.layers.{L}.self_attn.o_proj.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_proj.bias", "model.layers.{L}.self_attn.o_proj.bias", Op::kCopy,
     When::kOBias},
    {"decoder.layers.{L}.self_attention.q_layernorm.weight", "model.layers.{L}.self_attn.q_norm.weight", Op::kCopy,
     When::kQkNorm},
    {"decoder.layers.{L}.self_attention.k_layernorm.weight", "model.layers.{L}.self_attn.k_norm.weight", Op::kCopy,
     When::kQkNorm},
    {"decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight", "model.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways},
};

constexpr MapRule kMegatronDenseMlp[] = {
    {"decoder.layers.{L}.mlp.linear_fc1.weight", "model.layers.{L}.mlp.gate_proj.weight", Op::kGate, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.weight", "model.layers.{L}.mlp.up_proj.weight", Op::kUp, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.bias", "model.layers.{L}.mlp.gate_proj.bias", Op::kGate, When::kMlpBias},
    {"decoder.layers.{L}.mlp.linear_fc1.bias", "model.layers.{L}.mlp.up_proj.bias", Op::kUp, When::kMlpBias},
    {"decoder.layers.{L}.mlp.linear_fc2.weight", "model.layers.{L}.mlp.down_proj.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc2.bias", "model.layers.{L}.mlp.down_proj.bias", Op::kCopy, When::kMlpBias},
};

// Mixtral as its Hub checkpoints name it (every transformers release loads
// these names; 5.x fuses the experts on load).
constexpr MapRule kMegatronMixtralMlp[] = {
    {"decoder.layers.{L}.mlp.router.weight", "model.layers.{L}.block_sparse_moe.gate.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
     "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight", Op::kGate, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
     "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight", Op::kUp, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
     "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight", Op::kCopy, When::kAlways},
    // Transformer Engine's grouped GEMM (TEGroupedMLP): weight<E>.
    {"decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}", "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
     Op::kGate, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}", "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
     Op::kUp, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}", "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
     Op::kCopy, When::kAlways},
};

// Qwen3-MoE as its Hub checkpoints name it (mlp.gate is the router; no
// shared experts): Megatron's Qwen3-MoE runs (qk_layernorm with experts).
constexpr MapRule kMegatronQwen3MoeMlp[] = {
    {"decoder.layers.{L}.mlp.router.weight", "model.layers.{L}.mlp.gate.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
     "model.layers.{L}.mlp.experts.{E}.gate_proj.weight", Op::kGate, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
     "model.layers.{L}.mlp.experts.{E}.up_proj.weight", Op::kUp, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
     "model.layers.{L}.mlp.experts.{E}.down_proj.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}", "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
     Op::kGate, When::kAlways},
    {"decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}", "model.layers.{L}.mlp.experts.{E}.up_proj.weight", Op::kUp,
     When::kAlways},
    {"decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}", "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
     Op::kCopy, When::kAlways},
};

// Megatron GPT with RoPE, LayerNorm, a GELU MLP and linear biases -> GPT-NeoX
// (use_parallel_residual false: Megatron adds attention and MLP one after the
// other). With one key-value head per query head, Megatron's fused QKV rows
// are per head [q | k | v], the layout of NeoX's query_key_value (its forward
// views the output as [heads, 3 * head_size] and chunks q, k, v): copied as is.
constexpr MapRule kMegatronNeox[] = {
    {"embedding.word_embeddings.weight", "gpt_neox.embed_in.weight", Op::kVocab, When::kAlways},
    {"decoder.final_layernorm.weight", "gpt_neox.final_layer_norm.weight", Op::kCopy, When::kAlways},
    {"decoder.final_layernorm.bias", "gpt_neox.final_layer_norm.bias", Op::kCopy, When::kAlways},
    {"output_layer.weight", "embed_out.weight", Op::kVocab, When::kUntied},
    {"decoder.layers.{L}.input_layernorm.weight", "gpt_neox.layers.{L}.input_layernorm.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.input_layernorm.bias", "gpt_neox.layers.{L}.input_layernorm.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight", "gpt_neox.layers.{L}.input_layernorm.weight",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.layer_norm_bias", "gpt_neox.layers.{L}.input_layernorm.bias",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.weight", "gpt_neox.layers.{L}.attention.query_key_value.weight",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.bias", "gpt_neox.layers.{L}.attention.query_key_value.bias",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_proj.weight", "gpt_neox.layers.{L}.attention.dense.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_proj.bias", "gpt_neox.layers.{L}.attention.dense.bias", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.pre_mlp_layernorm.weight", "gpt_neox.layers.{L}.post_attention_layernorm.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.pre_mlp_layernorm.bias", "gpt_neox.layers.{L}.post_attention_layernorm.bias", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight", "gpt_neox.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_bias", "gpt_neox.layers.{L}.post_attention_layernorm.bias",
     Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.weight", "gpt_neox.layers.{L}.mlp.dense_h_to_4h.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.bias", "gpt_neox.layers.{L}.mlp.dense_h_to_4h.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc2.weight", "gpt_neox.layers.{L}.mlp.dense_4h_to_h.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc2.bias", "gpt_neox.layers.{L}.mlp.dense_4h_to_h.bias", Op::kCopy, When::kAlways},
};

// Megatron GPT with learned absolute positions, LayerNorm, a GELU MLP and
// linear biases -> GPT-2 (GPT2LMHeadModel). GPT-2's Conv1D layers store the
// transpose of Megatron's [out, in] weights, and c_attn's output is
// [all q | all k | all v] where Megatron's fused QKV is per head [q | k | v].
constexpr MapRule kMegatronGpt2[] = {
    {"embedding.word_embeddings.weight", "transformer.wte.weight", Op::kVocab, When::kAlways},
    {"embedding.position_embeddings.weight", "transformer.wpe.weight", Op::kCopy, When::kAlways},
    {"decoder.final_layernorm.weight", "transformer.ln_f.weight", Op::kCopy, When::kAlways},
    {"decoder.final_layernorm.bias", "transformer.ln_f.bias", Op::kCopy, When::kAlways},
    {"output_layer.weight", "lm_head.weight", Op::kVocab, When::kUntied},
    {"decoder.layers.{L}.input_layernorm.weight", "transformer.h.{L}.ln_1.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.input_layernorm.bias", "transformer.h.{L}.ln_1.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight", "transformer.h.{L}.ln_1.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.layer_norm_bias", "transformer.h.{L}.ln_1.bias", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.weight", "transformer.h.{L}.attn.c_attn.weight", Op::kQkvT,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_qkv.bias", "transformer.h.{L}.attn.c_attn.bias", Op::kQkv,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_proj.weight", "transformer.h.{L}.attn.c_proj.weight", Op::kT,
     When::kAlways},
    {"decoder.layers.{L}.self_attention.linear_proj.bias", "transformer.h.{L}.attn.c_proj.bias", Op::kCopy,
     When::kAlways},
    {"decoder.layers.{L}.pre_mlp_layernorm.weight", "transformer.h.{L}.ln_2.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.pre_mlp_layernorm.bias", "transformer.h.{L}.ln_2.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight", "transformer.h.{L}.ln_2.weight", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_bias", "transformer.h.{L}.ln_2.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.weight", "transformer.h.{L}.mlp.c_fc.weight", Op::kT, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc1.bias", "transformer.h.{L}.mlp.c_fc.bias", Op::kCopy, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc2.weight", "transformer.h.{L}.mlp.c_proj.weight", Op::kT, When::kAlways},
    {"decoder.layers.{L}.mlp.linear_fc2.bias", "transformer.h.{L}.mlp.c_proj.bias", Op::kCopy, When::kAlways},
};

// Legacy Megatron GPTModel names (megatron/legacy/model) -> mcore names.
constexpr std::pair<const char*, const char*> kLegacyNames[] = {
    {"language_model.embedding.", "embedding."},
    {"language_model.encoder.final_layernorm.", "decoder.final_layernorm."},
    {"language_model.encoder.final_norm.", "decoder.final_layernorm."},
    {"language_model.encoder.layers.", "decoder.layers."},
    {"language_model.output_layer.", "output_layer."},
    {".self_attention.query_key_value.", ".self_attention.linear_qkv."},
    {".self_attention.dense.", ".self_attention.linear_proj."},
    {".post_attention_layernorm.", ".pre_mlp_layernorm."},
    {".post_attention_norm.", ".pre_mlp_layernorm."},
    {".input_norm.", ".input_layernorm."},
    {".mlp.dense_h_to_4h.", ".mlp.linear_fc1."},
    {".mlp.dense_4h_to_h.", ".mlp.linear_fc2."},
};

std::string McoreName(std::string name) {
  // NeMo 2 / Lightning wrap the model: "module." (possibly repeated).
  while (name.rfind("module.", 0) == 0) name.erase(0, 7);
  if (name.rfind("language_model.", 0) != 0) return name;
  for (const auto& [from, to] : kLegacyNames) {
    const size_t p = name.find(from);
    if (p != std::string::npos) name.replace(p, std::char_traits<char>::length(from), to);
  }
  return name;
}

// A run with LayerNorm, a plain GELU MLP and linear biases: GPT-NeoX with
// RoPE, GPT-2 with learned absolute positions. Both have one key-value head
// per query head of hidden_size / heads channels.
const Arch* RecogniseMegatronGelu(const json& args, const Arch& target, std::vector<std::string>& why) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  };
  const std::string cls = target.cls;
  const bool neox = target.layout == Layout::kNeox;
  const std::string pos = JsonGet<std::string>(args, "position_embedding_type", "learned_absolute");
  const std::string want_pos = neox ? "rope" : "learned_absolute";
  need(pos == want_pos, "position_embedding_type is '" + pos + "' (" + cls + " uses '" + want_pos + "')");
  const std::string norm = JsonGet<std::string>(args, "normalization", "LayerNorm");
  need(norm == "LayerNorm", "normalization is '" + norm + "' (" + cls + " uses 'LayerNorm')");
  need(!JsonGet<bool>(args, "swiglu", false), "the MLP is SwiGLU (" + cls + "'s is a plain GELU MLP)");
  need(!JsonGet<bool>(args, "squared_relu", false), "the activation is squared ReLU (" + cls + " uses GELU)");
  need(JsonGet<bool>(args, "add_bias_linear", true),
       "add_bias_linear is false (" + cls + "'s linear layers have biases)");
  const int64_t hidden = JsonGet<int64_t>(args, "hidden_size", 0),
                heads = JsonGet<int64_t>(args, "num_attention_heads", 0);
  const int64_t head_size = heads > 0 ? hidden / heads : 0;
  const int64_t groups =
      JsonGet<bool>(args, "group_query_attention", false) ? JsonGet<int64_t>(args, "num_query_groups", heads) : heads;
  need(groups == heads, "grouped-query attention (" + std::to_string(groups) + " key-value heads for " +
                            std::to_string(heads) + " query heads; " + cls + " has one per query head)");
  need(head_size > 0 && hidden % heads == 0 && JsonGet<int64_t>(args, "kv_channels", head_size) == head_size,
       "kv_channels is not hidden_size / num_attention_heads (" + cls + "'s head size)");
  if (neox) {
    const double pct = JsonGet<double>(args, "rotary_percent", 1.0);
    need(pct > 0.0 && pct <= 1.0, "rotary_percent " + std::to_string(pct) + " is not in (0, 1]");
    need(!JsonGet<bool>(args, "rotary_interleaved", false), "rotary_interleaved is set (GPT-NeoX rotates halves)");
    need(!JsonGet<bool>(args, "use_rope_scaling", false),
         "use_rope_scaling (Llama 3.1 RoPE scaling) on a GPT-NeoX model");
  }
  need(!JsonGet<bool>(args, "apply_layernorm_1p", false), "apply_layernorm_1p is set (zero-centered norm weights)");
  need(!JsonGet<bool>(args, "qk_layernorm", false), "QK layer norms (" + cls + " has none)");
  need(!JsonGet<bool>(args, "multi_latent_attention", false), "multi-latent attention has no mapping here");
  need(JsonGet<int64_t>(args, "num_experts", 0) == 0, "an MoE model (" + cls + " is dense)");
  return why.empty() ? &target : nullptr;
}

// Which architecture a Megatron run is, from its args (argparse defaults of
// megatron/training/arguments.py where a field is absent). `forced`: the
// --hf-arch choice. Returns null and fills `why` when none fits.
const Arch* RecogniseMegatron(const json& args, const Arch* forced, std::vector<std::string>& why) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  };
  const std::string pos = JsonGet<std::string>(args, "position_embedding_type", "learned_absolute");
  const std::string norm = JsonGet<std::string>(args, "normalization", "LayerNorm");
  // LayerNorm without SwiGLU is GPT-NeoX (RoPE) or GPT-2 (learned positions);
  // the rest is judged as the Llama family.
  const bool gelu = norm == "LayerNorm" && !JsonGet<bool>(args, "swiglu", false);
  if (forced != nullptr ? forced->layout != Layout::kLlama : gelu && (pos == "rope" || pos == "learned_absolute")) {
    return RecogniseMegatronGelu(args, forced != nullptr ? *forced : *ArchByName(pos == "rope" ? "gpt_neox" : "gpt2"),
                                 why);
  }
  need(pos == "rope", "position_embedding_type is '" + pos + "' (the Llama family uses 'rope')");
  need(norm == "RMSNorm", "normalization is '" + norm + "' (the Llama family uses 'RMSNorm')");
  need(JsonGet<bool>(args, "swiglu", false), "the MLP is not SwiGLU (args.swiglu is false)");
  need(JsonGet<double>(args, "rotary_percent", 1.0) == 1.0, "rotary_percent is not 1.0 (partial RoPE)");
  need(!JsonGet<bool>(args, "rotary_interleaved", false), "rotary_interleaved is set (Hugging Face rotates halves)");
  need(!JsonGet<bool>(args, "apply_layernorm_1p", false), "apply_layernorm_1p is set (zero-centered norm weights)");
  need(!JsonGet<bool>(args, "multi_latent_attention", false), "multi-latent attention has no mapping here");
  need(!JsonGet<bool>(args, "add_position_embedding", false) || pos == "rope", "learned position embeddings");
  const bool qkv_bias = JsonGet<bool>(args, "add_qkv_bias", false);
  const bool linear_bias = JsonGet<bool>(args, "add_bias_linear", true);
  const bool qk_norm = JsonGet<bool>(args, "qk_layernorm", false);
  const int64_t experts = JsonGet<int64_t>(args, "num_experts", 0);
  if (experts > 0) {
    // Mixtral and Qwen3-MoE route alike: softmax over the experts, the top-k
    // renormalised (Qwen3-MoE's norm_topk_prob), no shared experts.
    need(JsonGet<int64_t>(args, "moe_shared_expert_intermediate_size", 0) == 0,
         "MoE shared experts (no Mixtral or Qwen3-MoE equivalent)");
    need(!JsonGet<bool>(args, "moe_router_pre_softmax", false),
         "moe_router_pre_softmax is set (Mixtral and Qwen3-MoE "
         "renormalize the top-k)");
    const std::string score = JsonGet<std::string>(args, "moe_router_score_function", "softmax");
    need(score == "softmax", "moe_router_score_function is '" + score + "' (Mixtral and Qwen3-MoE use softmax)");
    need(JsonGet<double>(args, "moe_router_topk_scaling_factor", 1.0) == 1.0, "moe_router_topk_scaling_factor is set");
    need(!linear_bias && !qkv_bias, "an MoE model with linear biases (Mixtral and Qwen3-MoE have none)");
    const auto lf = args.find("moe_layer_freq");
    need(lf == args.end() || lf->is_null() || (lf->is_number() && lf->get<double>() == 1.0),
         "moe_layer_freq: not every layer is MoE");
  }
  const Arch* a = ArchByName("llama");
  if (experts > 0) {
    a = ArchByName(qk_norm ? "qwen3_moe" : "mixtral");
  } else if (qk_norm) {
    need(!qkv_bias, "both QKV biases and QK layer norms");
    a = ArchByName("qwen3");
  } else if (qkv_bias && !linear_bias) {
    a = ArchByName("qwen2");
  }
  if (forced != nullptr && forced != a) {
    const std::string f = forced->name;
    const bool compatible = (f == "mistral" && std::string(a->name) == "llama" && !linear_bias) ||
                            (f == "llama" && std::string(a->name) == "mistral");
    if (!compatible) {
      why.push_back("--hf-arch " + f + " does not fit: the run's args describe a " + a->name + " model");
    }
    a = forced;
  }
  if (JsonGet<bool>(args, "use_rope_scaling", false) && std::string(a->model_type) != "llama") {
    why.push_back("use_rope_scaling (Llama 3.1 RoPE scaling) on a " + std::string(a->name) + " model");
  }
  return why.empty() ? a : nullptr;
}

// The run's dropouts (Megatron's argparse defaults: 0.1), as Megatron-Bridge
// exports them; transformers applies them only in training mode.
double AttentionDropout(const json& args) { return JsonGet<double>(args, "attention_dropout", 0.1); }
double HiddenDropout(const json& args) { return JsonGet<double>(args, "hidden_dropout", 0.1); }

// GPT-NeoX's config.json from a Megatron run (RecogniseMegatronGelu held).
// RoPE in both spellings: rotary_pct / rotary_emb_base (4.x) and
// rope_parameters' partial_rotary_factor (5.x). Megatron's openai_gelu is the
// tanh approximation transformers calls gelu_new; its default is the exact GELU.
json MegatronNeoxConfig(const json& args, const Arch& a, int64_t vocab) {
  const double theta = JsonGet<double>(args, "rotary_base", 10000.0),
               pct = JsonGet<double>(args, "rotary_percent", 1.0);
  const int64_t hidden = JsonGet<int64_t>(args, "hidden_size", 0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = JsonGet<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  c["num_hidden_layers"] = JsonGet<int64_t>(args, "num_layers", 0);
  c["num_attention_heads"] = JsonGet<int64_t>(args, "num_attention_heads", 0);
  c["hidden_act"] = JsonGet<bool>(args, "openai_gelu", false) ? "gelu_new" : "gelu";
  c["max_position_embeddings"] =
      JsonGet<int64_t>(args, "max_position_embeddings", JsonGet<int64_t>(args, "seq_length", 2048));
  c["layer_norm_eps"] = JsonGet<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = JsonGet<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !JsonGet<bool>(args, "untie_embeddings_and_output_weights", false);
  c["use_parallel_residual"] = false;
  c["attention_bias"] = true;
  c["rotary_pct"] = pct;
  c["rotary_emb_base"] = theta;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", theta}, {"partial_rotary_factor", pct}};
  c["attention_dropout"] = AttentionDropout(args);
  c["hidden_dropout"] = HiddenDropout(args);
  c["use_cache"] = true;
  c["ckptfs_source"] = "megatron";
  return c;
}

// GPT-2's config.json from a Megatron run (RecogniseMegatronGelu held).
json MegatronGpt2Config(const json& args, const Arch& a, int64_t vocab) {
  const int64_t hidden = JsonGet<int64_t>(args, "hidden_size", 0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["n_embd"] = hidden;
  c["n_inner"] = JsonGet<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  c["n_layer"] = JsonGet<int64_t>(args, "num_layers", 0);
  c["n_head"] = JsonGet<int64_t>(args, "num_attention_heads", 0);
  c["n_positions"] = JsonGet<int64_t>(args, "max_position_embeddings", JsonGet<int64_t>(args, "seq_length", 1024));
  c["activation_function"] = JsonGet<bool>(args, "openai_gelu", false) ? "gelu_new" : "gelu";
  c["layer_norm_epsilon"] = JsonGet<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = JsonGet<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !JsonGet<bool>(args, "untie_embeddings_and_output_weights", false);
  c["scale_attn_weights"] = true;
  c["resid_pdrop"] = HiddenDropout(args);
  c["embd_pdrop"] = HiddenDropout(args);  // Megatron's embedding dropout is hidden_dropout
  c["attn_pdrop"] = AttentionDropout(args);
  c["bos_token_id"] = nullptr;  // GPT-2's tokenizer's 50256 means nothing to another vocabulary
  c["eos_token_id"] = nullptr;
  c["use_cache"] = true;
  c["ckptfs_source"] = "megatron";
  return c;
}

// config.json for `a` from a Megatron run's args and its embedding's rows.
json MegatronConfig(const json& args, const Arch& a, int64_t embedding_rows) {
  const std::string mt = a.model_type;
  const int64_t hidden = JsonGet<int64_t>(args, "hidden_size", 0);
  const int64_t heads = JsonGet<int64_t>(args, "num_attention_heads", 0);
  const int64_t groups =
      JsonGet<bool>(args, "group_query_attention", false) ? JsonGet<int64_t>(args, "num_query_groups", heads) : heads;
  const int64_t head_dim = JsonGet<int64_t>(args, "kv_channels", heads > 0 ? hidden / heads : 0);
  const int64_t ffn = JsonGet<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  // The tokenizer's vocabulary; Megatron pads the embedding past it
  // (make_vocab_size_divisible_by x TP), and those rows are left out.
  int64_t vocab = JsonGet<int64_t>(args, "vocab_size", 0);
  if (vocab <= 0 || vocab > embedding_rows) vocab = embedding_rows;
  if (a.layout == Layout::kNeox) return MegatronNeoxConfig(args, a, vocab);
  if (a.layout == Layout::kGpt2) return MegatronGpt2Config(args, a, vocab);
  const int64_t max_pos = JsonGet<int64_t>(args, "max_position_embeddings", JsonGet<int64_t>(args, "seq_length", 4096));
  const double theta = JsonGet<double>(args, "rotary_base", 10000.0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  const int64_t moe_ffn = JsonGet<int64_t>(args, "moe_ffn_hidden_size", ffn);
  c["intermediate_size"] = a.moe == Moe::kMixtral ? moe_ffn : ffn;
  c["num_hidden_layers"] = JsonGet<int64_t>(args, "num_layers", 0);
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = groups;
  c["head_dim"] = head_dim;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = max_pos;
  c["rms_norm_eps"] = JsonGet<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = JsonGet<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !JsonGet<bool>(args, "untie_embeddings_and_output_weights", false);
  SetRope(c, theta,
          JsonGet<bool>(args, "use_rope_scaling", false)
              ? std::optional<double>(JsonGet<double>(args, "rope_scaling_factor", 8.0))
              : std::nullopt);
  c["attention_dropout"] = AttentionDropout(args);
  c["use_cache"] = true;
  if (mt == "llama") {
    const bool bias = JsonGet<bool>(args, "add_bias_linear", true);
    c["attention_bias"] = bias;
    c["mlp_bias"] = bias;
  } else if (mt == "qwen3" || mt == "qwen3_moe") {
    c["attention_bias"] = false;
  }
  if (mt == "mistral" || mt == "mixtral" || mt == "qwen2" || mt == "qwen3" || mt == "qwen3_moe") {
    const auto ws = args.find("window_size");
    json window = nullptr;
    if (ws != args.end() && ws->is_array() && !ws->empty() && (*ws)[0].is_number() && (*ws)[0].get<int64_t>() >= 0) {
      window = (*ws)[0].get<int64_t>() + 1;  // mcore's (left, right) window counts the token itself apart
    }
    c["sliding_window"] = window;
    if (mt != "mistral" && mt != "mixtral") c["use_sliding_window"] = !window.is_null();
  }
  if (a.moe == Moe::kMixtral) c["num_local_experts"] = JsonGet<int64_t>(args, "num_experts", 0);
  if (a.moe == Moe::kQwen3) {
    c["num_experts"] = JsonGet<int64_t>(args, "num_experts", 0);
    c["moe_intermediate_size"] = moe_ffn;
    c["norm_topk_prob"] = true;  // mcore's softmax over the top-k scores
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = json::array();
  }
  if (a.moe != Moe::kNone) {
    c["num_experts_per_tok"] = JsonGet<int64_t>(args, "moe_router_topk", 2);
    c["router_aux_loss_coef"] = JsonGet<double>(args, "moe_aux_loss_coeff", 0.0);
    c["output_router_logits"] = false;
  }
  c["ckptfs_source"] = "megatron";
  return c;
}

bool Recognises(const hf::HfSource& in) { return Traits(in.family).names == NameConvention::kMegatron; }

hf::HfRules Rules(const Arch& arch, const hf::json& /*config*/) {
  hf::HfRules r;
  auto use = [&](const auto& table) {
    for (const MapRule& m : table) r.rules.push_back(&m);
  };
  if (arch.layout == Layout::kNeox) {
    use(kMegatronNeox);
  } else if (arch.layout == Layout::kGpt2) {
    use(kMegatronGpt2);
  } else {
    use(kMegatronCommon);
    switch (arch.moe) {
      case Moe::kNone:
        use(kMegatronDenseMlp);
        break;
      case Moe::kMixtral:
        use(kMegatronMixtralMlp);
        break;
      case Moe::kQwen3:
        use(kMegatronQwen3MoeMlp);
        break;
    }
  }
  return r;
}

// Megatron has no Gemma 2 (its pre- and post-feedforward norms).
bool Fits(const hf::HfSource& /*in*/, const Arch& arch, const json& /*config*/, std::vector<std::string>& why) {
  if (arch.layout != Layout::kGemma2) return true;
  why.push_back("Megatron's names have no Gemma 2 mapping (pre- and post-feedforward norms)");
  return false;
}

// The target from the run's args (the readers' args.json export) and the
// embedding's rows (the padded vocabulary, cut to args.vocab_size).
std::optional<hf::HfTarget> Config(const hf::HfSource& in, const Arch* forced, std::vector<std::string>& why) {
  hf::HfTarget t;
  const json* args = nullptr;
  json parsed;
  for (const ExportFile& x : in.exports) {
    if (x.path == "args.json" && x.parts.size() == 1 && x.parts[0].kind == PartKind::kLiteral) {
      parsed = json::parse(x.parts[0].literal, nullptr, false);
      if (parsed.is_object()) args = &parsed;
    }
  }
  if (args == nullptr) {
    why.push_back("the checkpoint records no Megatron args; pass --hf-config FILE (a config.json)");
  } else {
    t.arch = RecogniseMegatron(*args, forced, why);
  }
  if (t.arch != nullptr) {
    int64_t rows = 0;
    for (const char* e : {"embedding.word_embeddings.weight", "language_model.embedding.word_embeddings.weight",
                          "module.embedding.word_embeddings.weight"}) {
      auto it = in.params.find(e);
      if (it != in.params.end() && !in.tensors[it->second].shape.empty()) rows = in.tensors[it->second].shape[0];
    }
    t.config = MegatronConfig(*args, *t.arch, rows);
  }
  return t;
}

}  // namespace

const hf::HfConvention& MegatronHfConvention() {
  static const hf::HfConvention kConvention = [] {
    hf::HfConvention c;
    c.name = "megatron";
    c.recognises = &Recognises;
    c.normalize = &McoreName;
    c.rules = &Rules;
    c.fits = &Fits;
    c.config = &Config;
    c.config_before_config_json = true;  // the run's args decide; a config.json beside them is not read
    return c;
  }();
  return kConvention;
}

}  // namespace ckptfs::formats::megatron
