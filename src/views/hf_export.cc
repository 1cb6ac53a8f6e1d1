#include "views/hf_export.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "common/json_text.h"
#include "formats/byte_reader.h"

namespace ckptfs::hf {
namespace {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------
// Target architectures (--hf-arch) and what each has.

// The tensor layout family of an architecture: the Llama family (split q, k,
// v and gate, up; kMegatronCommon), GPT-NeoX (kMegatronNeox), GPT-2
// (kMegatronGpt2).
enum class Layout : uint8_t { kLlama, kNeox, kGpt2 };

// The sparse MLP of an MoE architecture: none (dense), Mixtral's
// (block_sparse_moe.experts.E.w1/w3/w2, num_local_experts) or Qwen3-MoE's
// (mlp.experts.E.gate_proj/up_proj/down_proj, num_experts).
enum class Moe : uint8_t { kNone, kMixtral, kQwen3 };

struct Arch {
  const char* name;        // --hf-arch
  const char* model_type;  // config.json "model_type"
  const char* cls;         // config.json "architectures"
  Moe moe;
  Layout layout;
};
constexpr Arch kArchs[] = {
    {"llama", "llama", "LlamaForCausalLM", Moe::kNone, Layout::kLlama},
    {"mistral", "mistral", "MistralForCausalLM", Moe::kNone, Layout::kLlama},
    {"qwen2", "qwen2", "Qwen2ForCausalLM", Moe::kNone, Layout::kLlama},
    {"qwen3", "qwen3", "Qwen3ForCausalLM", Moe::kNone, Layout::kLlama},
    {"mixtral", "mixtral", "MixtralForCausalLM", Moe::kMixtral, Layout::kLlama},
    {"qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", Moe::kQwen3, Layout::kLlama},
    {"gpt_neox", "gpt_neox", "GPTNeoXForCausalLM", Moe::kNone, Layout::kNeox},
    {"gpt2", "gpt2", "GPT2LMHeadModel", Moe::kNone, Layout::kGpt2},
};

std::string JoinNames(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

const Arch* ArchByName(const std::string& name) {
  for (const Arch& a : kArchs) {
    if (name == a.name || name == a.model_type || name == a.cls) return &a;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Name mapping: Megatron (mcore names) -> Hugging Face. {L} is a layer
// number, {E} an expert number. A rule applies when its condition holds for
// the target config; a rule's dst names a tensor the target must have
// (several rules may produce the same dst from alternative source names:
// local-spec norms vs Transformer Engine's fused layer_norm_weight).

enum class Op : uint8_t {
  kCopy,   // the whole tensor
  kVocab,  // rows [0, vocab_size): the padded vocabulary cut
  kQ,      // fused QKV, per query group [q (qpg*hd) | k (hd) | v (hd)] rows
  kK,
  kV,
  kGate,  // SwiGLU fc1 [gate; up]: rows [0, n/2)
  kUp,    //                        rows [n/2, n)
  // Meta / torchtitan RoPE rotates interleaved pairs (2j, 2j+1) of each head;
  // Hugging Face rotates halves (j, j + hd/2). Per head, the rows in the
  // order 0, 2, .., hd-2, 1, 3, .., hd-1 (convert_llama_weights_to_hf's
  // permute): query heads (kRopeQ) or key-value heads (kRopeK).
  kRopeQ,
  kRopeK,
  // GPT-2: the fused QKV's rows regrouped into [all q | all k | all v] (the
  // kQ, kK, kV boxes in turn), for c_attn's bias; kQkvT: the same rows then
  // transposed, for c_attn's Conv1D weight; kT: the whole 2-D weight
  // transposed (Conv1D stores [in, out]).
  kQkv,
  kQkvT,
  kT,
  // torchtitan's grouped experts [E, out, in]: expert E's [out, in] slice
  // (one source tensor gives every {E} of the rule's dst).
  kExpert,
};
enum class When : uint8_t { kAlways, kUntied, kQkvBias, kOBias, kMlpBias, kQkNorm };

struct MapRule {
  const char* src;
  const char* dst;
  Op op;
  When when;
};

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

// torchtitan's Llama 3 (torchtitan/models/llama3; 0.2 keeps the names of
// Meta's reference implementation, 0.3 puts wq/wk/wv under qkv_linear and
// names the output lm_head) -> Hugging Face Llama, as its own
// Llama3StateDictAdapter.to_hf maps them. Qwen3 shares these names (with
// kTorchtitanQkNorm, and its wq / wk rows copied, not permuted).
constexpr MapRule kTorchtitanLlama[] = {
    {"tok_embeddings.weight", "model.embed_tokens.weight", Op::kVocab, When::kAlways},
    {"norm.weight", "model.norm.weight", Op::kCopy, When::kAlways},
    {"output.weight", "lm_head.weight", Op::kVocab, When::kUntied},
    {"lm_head.weight", "lm_head.weight", Op::kVocab, When::kUntied},
    {"layers.{L}.attention.qkv_linear.wq.weight", "model.layers.{L}.self_attn.q_proj.weight", Op::kRopeQ,
     When::kAlways},
    {"layers.{L}.attention.qkv_linear.wk.weight", "model.layers.{L}.self_attn.k_proj.weight", Op::kRopeK,
     When::kAlways},
    {"layers.{L}.attention.qkv_linear.wv.weight", "model.layers.{L}.self_attn.v_proj.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.attention_norm.weight", "model.layers.{L}.input_layernorm.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.attention.wq.weight", "model.layers.{L}.self_attn.q_proj.weight", Op::kRopeQ, When::kAlways},
    {"layers.{L}.attention.wk.weight", "model.layers.{L}.self_attn.k_proj.weight", Op::kRopeK, When::kAlways},
    {"layers.{L}.attention.wv.weight", "model.layers.{L}.self_attn.v_proj.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.attention.wo.weight", "model.layers.{L}.self_attn.o_proj.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.ffn_norm.weight", "model.layers.{L}.post_attention_layernorm.weight", Op::kCopy, When::kAlways},
};

// torchtitan's Qwen3 (torchtitan/models/qwen3): Llama 3's names (above) plus
// the QK norms. Its CosSinRoPE rotates halves as Hugging Face does, so the
// kRopeQ / kRopeK rows are copied as they are (Qwen3StateDictAdapter.to_hf
// permutes nothing).
constexpr MapRule kTorchtitanQkNorm[] = {
    {"layers.{L}.attention.q_norm.weight", "model.layers.{L}.self_attn.q_norm.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.attention.k_norm.weight", "model.layers.{L}.self_attn.k_norm.weight", Op::kCopy, When::kAlways},
};

// torchtitan's dense SwiGLU feed-forward (Llama 3 and Qwen3).
constexpr MapRule kTorchtitanDenseMlp[] = {
    {"layers.{L}.feed_forward.w1.weight", "model.layers.{L}.mlp.gate_proj.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.feed_forward.w3.weight", "model.layers.{L}.mlp.up_proj.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.feed_forward.w2.weight", "model.layers.{L}.mlp.down_proj.weight", Op::kCopy, When::kAlways},
};

// torchtitan's Qwen3 MoE layer: the router and GroupedExperts, whose weights
// hold every expert ([E, ffn, dim] for w1 / w3, [E, dim, ffn] for w2), split
// per expert with no transpose as Qwen3StateDictAdapter.to_hf splits them.
constexpr MapRule kTorchtitanQwen3MoeMlp[] = {
    {"layers.{L}.moe.router.gate.weight", "model.layers.{L}.mlp.gate.weight", Op::kCopy, When::kAlways},
    {"layers.{L}.moe.routed_experts.inner_experts.w1_EFD", "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
     Op::kExpert, When::kAlways},
    {"layers.{L}.moe.routed_experts.inner_experts.w3_EFD", "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
     Op::kExpert, When::kAlways},
    {"layers.{L}.moe.routed_experts.inner_experts.w2_EDF", "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
     Op::kExpert, When::kAlways},
};

// Source tensors a target has no place for, with the reason ERRORS gives.
constexpr char kExpertBiasWhy[] =
    "torchtitan's load-balancing bias (load_balance_coeff) only chooses the experts; Hugging Face's router has no "
    "such bias, so once training moved it from zero transformers routes tokens differently (torchtitan's own to_hf "
    "drops it too)";
constexpr std::pair<const char*, const char*> kKnownUnmapped[] = {
    {"layers.{L}.moe.expert_bias_E", kExpertBiasWhy},  // torchtitan 0.3
    {"layers.{L}.moe.expert_bias", kExpertBiasWhy},    // torchtitan 0.1 / 0.2
};

// Where the parameter names come from.
enum class Convention { kHf, kMegatron, kTorchtitan };

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

// Matches `name` against a template with {L} / {E} (decimal numbers).
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

// ---------------------------------------------------------------------------
// Reading a run's facts.

template <typename T>
T Get(const json& j, const char* key, T def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if constexpr (std::is_same_v<T, bool>) {
    return it->is_boolean() ? it->template get<bool>() : def;
  } else if constexpr (std::is_same_v<T, std::string>) {
    return it->is_string() ? it->template get<std::string>() : def;
  } else {
    return it->is_number() ? it->template get<T>() : def;
  }
}

const char* ConfigDtype(DType d) {
  switch (d) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    default:
      return nullptr;
  }
}

// The model facts the mapping needs, read from the target config.json.
struct Shape {
  int64_t layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, experts = 0;
  bool tied = false, qkv_bias = false, o_bias = false, mlp_bias = false, qk_norm = false;
};

Shape ShapeOf(const json& c, const Arch& a) {
  Shape s;
  const bool gpt2 = a.layout == Layout::kGpt2;  // GPT-2's own key names
  s.layers = Get<int64_t>(c, gpt2 ? "n_layer" : "num_hidden_layers", 0);
  s.heads = Get<int64_t>(c, gpt2 ? "n_head" : "num_attention_heads", 0);
  s.kv_heads = Get<int64_t>(c, "num_key_value_heads", s.heads);
  const int64_t hidden = Get<int64_t>(c, gpt2 ? "n_embd" : "hidden_size", 0);
  s.head_dim = Get<int64_t>(c, "head_dim", s.heads > 0 ? hidden / s.heads : 0);
  s.vocab = Get<int64_t>(c, "vocab_size", 0);
  s.experts = a.moe == Moe::kMixtral ? Get<int64_t>(c, "num_local_experts", 0)
              : a.moe == Moe::kQwen3 ? Get<int64_t>(c, "num_experts", 0)
                                     : 0;
  s.tied = Get<bool>(c, "tie_word_embeddings", false);
  const std::string mt = a.model_type;
  if (mt == "llama") {
    s.qkv_bias = s.o_bias = Get<bool>(c, "attention_bias", false);
    s.mlp_bias = Get<bool>(c, "mlp_bias", false);
  } else if (mt == "qwen2") {
    s.qkv_bias = true;
  } else if (mt == "qwen3" || mt == "qwen3_moe") {
    s.qkv_bias = s.o_bias = Get<bool>(c, "attention_bias", false);
    s.qk_norm = true;
  }
  return s;
}

bool Holds(When w, const Shape& s) {
  switch (w) {
    case When::kAlways:
      return true;
    case When::kUntied:
      return !s.tied;
    case When::kQkvBias:
      return s.qkv_bias;
    case When::kOBias:
      return s.o_bias;
    case When::kMlpBias:
      return s.mlp_bias;
    case When::kQkNorm:
      return s.qk_norm;
  }
  return false;
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
  const std::string pos = Get<std::string>(args, "position_embedding_type", "learned_absolute");
  const std::string want_pos = neox ? "rope" : "learned_absolute";
  need(pos == want_pos, "position_embedding_type is '" + pos + "' (" + cls + " uses '" + want_pos + "')");
  const std::string norm = Get<std::string>(args, "normalization", "LayerNorm");
  need(norm == "LayerNorm", "normalization is '" + norm + "' (" + cls + " uses 'LayerNorm')");
  need(!Get<bool>(args, "swiglu", false), "the MLP is SwiGLU (" + cls + "'s is a plain GELU MLP)");
  need(!Get<bool>(args, "squared_relu", false), "the activation is squared ReLU (" + cls + " uses GELU)");
  need(Get<bool>(args, "add_bias_linear", true), "add_bias_linear is false (" + cls + "'s linear layers have biases)");
  const int64_t hidden = Get<int64_t>(args, "hidden_size", 0), heads = Get<int64_t>(args, "num_attention_heads", 0);
  const int64_t head_size = heads > 0 ? hidden / heads : 0;
  const int64_t groups =
      Get<bool>(args, "group_query_attention", false) ? Get<int64_t>(args, "num_query_groups", heads) : heads;
  need(groups == heads, "grouped-query attention (" + std::to_string(groups) + " key-value heads for " +
                            std::to_string(heads) + " query heads; " + cls + " has one per query head)");
  need(head_size > 0 && hidden % heads == 0 && Get<int64_t>(args, "kv_channels", head_size) == head_size,
       "kv_channels is not hidden_size / num_attention_heads (" + cls + "'s head size)");
  if (neox) {
    const double pct = Get<double>(args, "rotary_percent", 1.0);
    need(pct > 0.0 && pct <= 1.0, "rotary_percent " + std::to_string(pct) + " is not in (0, 1]");
    need(!Get<bool>(args, "rotary_interleaved", false), "rotary_interleaved is set (GPT-NeoX rotates halves)");
    need(!Get<bool>(args, "use_rope_scaling", false), "use_rope_scaling (Llama 3.1 RoPE scaling) on a GPT-NeoX model");
  }
  need(!Get<bool>(args, "apply_layernorm_1p", false), "apply_layernorm_1p is set (zero-centered norm weights)");
  need(!Get<bool>(args, "qk_layernorm", false), "QK layer norms (" + cls + " has none)");
  need(!Get<bool>(args, "multi_latent_attention", false), "multi-latent attention has no mapping here");
  need(Get<int64_t>(args, "num_experts", 0) == 0, "an MoE model (" + cls + " is dense)");
  return why.empty() ? &target : nullptr;
}

// Which architecture a Megatron run is, from its args (argparse defaults of
// megatron/training/arguments.py where a field is absent). `forced`: the
// --hf-arch choice. Returns null and fills `why` when none fits.
const Arch* RecogniseMegatron(const json& args, const Arch* forced, std::vector<std::string>& why) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  };
  const std::string pos = Get<std::string>(args, "position_embedding_type", "learned_absolute");
  const std::string norm = Get<std::string>(args, "normalization", "LayerNorm");
  // LayerNorm without SwiGLU is GPT-NeoX (RoPE) or GPT-2 (learned positions);
  // the rest is judged as the Llama family.
  const bool gelu = norm == "LayerNorm" && !Get<bool>(args, "swiglu", false);
  if (forced != nullptr ? forced->layout != Layout::kLlama : gelu && (pos == "rope" || pos == "learned_absolute")) {
    return RecogniseMegatronGelu(args, forced != nullptr ? *forced : *ArchByName(pos == "rope" ? "gpt_neox" : "gpt2"),
                                 why);
  }
  need(pos == "rope", "position_embedding_type is '" + pos + "' (the Llama family uses 'rope')");
  need(norm == "RMSNorm", "normalization is '" + norm + "' (the Llama family uses 'RMSNorm')");
  need(Get<bool>(args, "swiglu", false), "the MLP is not SwiGLU (args.swiglu is false)");
  need(Get<double>(args, "rotary_percent", 1.0) == 1.0, "rotary_percent is not 1.0 (partial RoPE)");
  need(!Get<bool>(args, "rotary_interleaved", false), "rotary_interleaved is set (Hugging Face rotates halves)");
  need(!Get<bool>(args, "apply_layernorm_1p", false), "apply_layernorm_1p is set (zero-centered norm weights)");
  need(!Get<bool>(args, "multi_latent_attention", false), "multi-latent attention has no mapping here");
  need(!Get<bool>(args, "add_position_embedding", false) || pos == "rope", "learned position embeddings");
  const bool qkv_bias = Get<bool>(args, "add_qkv_bias", false);
  const bool linear_bias = Get<bool>(args, "add_bias_linear", true);
  const bool qk_norm = Get<bool>(args, "qk_layernorm", false);
  const int64_t experts = Get<int64_t>(args, "num_experts", 0);
  if (experts > 0) {
    // Mixtral and Qwen3-MoE route alike: softmax over the experts, the top-k
    // renormalised (Qwen3-MoE's norm_topk_prob), no shared experts.
    need(Get<int64_t>(args, "moe_shared_expert_intermediate_size", 0) == 0,
         "MoE shared experts (no Mixtral or Qwen3-MoE equivalent)");
    need(!Get<bool>(args, "moe_router_pre_softmax", false),
         "moe_router_pre_softmax is set (Mixtral and Qwen3-MoE "
         "renormalize the top-k)");
    const std::string score = Get<std::string>(args, "moe_router_score_function", "softmax");
    need(score == "softmax", "moe_router_score_function is '" + score + "' (Mixtral and Qwen3-MoE use softmax)");
    need(Get<double>(args, "moe_router_topk_scaling_factor", 1.0) == 1.0, "moe_router_topk_scaling_factor is set");
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
  if (Get<bool>(args, "use_rope_scaling", false) && std::string(a->model_type) != "llama") {
    why.push_back("use_rope_scaling (Llama 3.1 RoPE scaling) on a " + std::string(a->name) + " model");
  }
  return why.empty() ? a : nullptr;
}

// config.json for `a` from a Megatron run's args and its embedding.
// RoPE in both transformers spellings: rope_theta (4.x) and rope_parameters
// (5.x); with `llama3_factor`, Llama 3.1's frequency scaling (the constants
// mcore's apply_rope_scaling and llama-models' apply_scaling share) as
// rope_scaling too.
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

// The run's dropouts (Megatron's argparse defaults: 0.1), as Megatron-Bridge
// exports them; transformers applies them only in training mode.
double AttentionDropout(const json& args) { return Get<double>(args, "attention_dropout", 0.1); }
double HiddenDropout(const json& args) { return Get<double>(args, "hidden_dropout", 0.1); }

// GPT-NeoX's config.json from a Megatron run (RecogniseMegatronGelu held).
// RoPE in both spellings: rotary_pct / rotary_emb_base (4.x) and
// rope_parameters' partial_rotary_factor (5.x). Megatron's openai_gelu is the
// tanh approximation transformers calls gelu_new; its default is the exact GELU.
json MegatronNeoxConfig(const json& args, const Arch& a, int64_t vocab) {
  const double theta = Get<double>(args, "rotary_base", 10000.0), pct = Get<double>(args, "rotary_percent", 1.0);
  const int64_t hidden = Get<int64_t>(args, "hidden_size", 0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = Get<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  c["num_hidden_layers"] = Get<int64_t>(args, "num_layers", 0);
  c["num_attention_heads"] = Get<int64_t>(args, "num_attention_heads", 0);
  c["hidden_act"] = Get<bool>(args, "openai_gelu", false) ? "gelu_new" : "gelu";
  c["max_position_embeddings"] = Get<int64_t>(args, "max_position_embeddings", Get<int64_t>(args, "seq_length", 2048));
  c["layer_norm_eps"] = Get<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = Get<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !Get<bool>(args, "untie_embeddings_and_output_weights", false);
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
  const int64_t hidden = Get<int64_t>(args, "hidden_size", 0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["n_embd"] = hidden;
  c["n_inner"] = Get<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  c["n_layer"] = Get<int64_t>(args, "num_layers", 0);
  c["n_head"] = Get<int64_t>(args, "num_attention_heads", 0);
  c["n_positions"] = Get<int64_t>(args, "max_position_embeddings", Get<int64_t>(args, "seq_length", 1024));
  c["activation_function"] = Get<bool>(args, "openai_gelu", false) ? "gelu_new" : "gelu";
  c["layer_norm_epsilon"] = Get<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = Get<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !Get<bool>(args, "untie_embeddings_and_output_weights", false);
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

json MegatronConfig(const json& args, const Arch& a, int64_t embedding_rows) {
  const std::string mt = a.model_type;
  const int64_t hidden = Get<int64_t>(args, "hidden_size", 0);
  const int64_t heads = Get<int64_t>(args, "num_attention_heads", 0);
  const int64_t groups =
      Get<bool>(args, "group_query_attention", false) ? Get<int64_t>(args, "num_query_groups", heads) : heads;
  const int64_t head_dim = Get<int64_t>(args, "kv_channels", heads > 0 ? hidden / heads : 0);
  const int64_t ffn = Get<int64_t>(args, "ffn_hidden_size", 4 * hidden);
  // The tokenizer's vocabulary; Megatron pads the embedding past it
  // (make_vocab_size_divisible_by x TP), and those rows are left out.
  int64_t vocab = Get<int64_t>(args, "vocab_size", 0);
  if (vocab <= 0 || vocab > embedding_rows) vocab = embedding_rows;
  if (a.layout == Layout::kNeox) return MegatronNeoxConfig(args, a, vocab);
  if (a.layout == Layout::kGpt2) return MegatronGpt2Config(args, a, vocab);
  const int64_t max_pos = Get<int64_t>(args, "max_position_embeddings", Get<int64_t>(args, "seq_length", 4096));
  const double theta = Get<double>(args, "rotary_base", 10000.0);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  const int64_t moe_ffn = Get<int64_t>(args, "moe_ffn_hidden_size", ffn);
  c["intermediate_size"] = a.moe == Moe::kMixtral ? moe_ffn : ffn;
  c["num_hidden_layers"] = Get<int64_t>(args, "num_layers", 0);
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = groups;
  c["head_dim"] = head_dim;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = max_pos;
  c["rms_norm_eps"] = Get<double>(args, "norm_epsilon", 1e-5);
  c["initializer_range"] = Get<double>(args, "init_method_std", 0.02);
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = !Get<bool>(args, "untie_embeddings_and_output_weights", false);
  SetRope(c, theta,
          Get<bool>(args, "use_rope_scaling", false)
              ? std::optional<double>(Get<double>(args, "rope_scaling_factor", 8.0))
              : std::nullopt);
  c["attention_dropout"] = AttentionDropout(args);
  c["use_cache"] = true;
  if (mt == "llama") {
    const bool bias = Get<bool>(args, "add_bias_linear", true);
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
  if (a.moe == Moe::kMixtral) c["num_local_experts"] = Get<int64_t>(args, "num_experts", 0);
  if (a.moe == Moe::kQwen3) {
    c["num_experts"] = Get<int64_t>(args, "num_experts", 0);
    c["moe_intermediate_size"] = moe_ffn;
    c["norm_topk_prob"] = true;  // mcore's softmax over the top-k scores
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = json::array();
  }
  if (a.moe != Moe::kNone) {
    c["num_experts_per_tok"] = Get<int64_t>(args, "moe_router_topk", 2);
    c["router_aux_loss_coef"] = Get<double>(args, "moe_aux_loss_coeff", 0.0);
    c["output_router_logits"] = false;
  }
  c["ckptfs_source"] = "megatron";
  return c;
}

// File `name` of `dir` when it exists (lstat: a dangling or escaping
// symlink is present, and its refusal is the answer), read whole through
// OpenSourceFile and held to `max_bytes`; nullopt when absent.
// A Llama config.json from Meta's params.json (dim, n_layers, n_heads,
// n_kv_heads, vocab_size, norm_eps, rope_theta, use_scaled_rope), as
// transformers' own convert_llama_weights_to_hf.py writes it. The sizes
// params.json leaves out or gives as -1 (Llama 2's vocab_size) come from the
// weights: the embedding's rows and feed_forward.w1's.
json MetaParamsConfig(const json& p, const Arch& a, int64_t embedding_rows, int64_t ffn_rows) {
  const int64_t hidden = Get<int64_t>(p, "dim", 0);
  const int64_t heads = Get<int64_t>(p, "n_heads", 0);
  int64_t kv = heads;
  if (p.contains("n_kv_heads") && p["n_kv_heads"].is_number_integer()) kv = p["n_kv_heads"].get<int64_t>();
  int64_t vocab = Get<int64_t>(p, "vocab_size", -1);
  if (vocab <= 0) vocab = embedding_rows;
  const double theta = Get<double>(p, "rope_theta", 10000.0);
  const bool scaled = Get<bool>(p, "use_scaled_rope", false);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = ffn_rows;
  c["num_hidden_layers"] = Get<int64_t>(p, "n_layers", 0);
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = kv;
  c["head_dim"] = heads > 0 ? hidden / heads : 0;
  c["hidden_act"] = "silu";
  // The converter's choice: Llama 3.1 (scaled RoPE) 131072, Llama 3 8192, Llama 2 4096.
  c["max_position_embeddings"] = scaled ? 131072 : theta >= 500000.0 ? 8192 : 4096;
  c["rms_norm_eps"] = Get<double>(p, "norm_eps", 1e-5);
  c["initializer_range"] = 0.02;
  c["vocab_size"] = vocab;
  c["tie_word_embeddings"] = false;
  SetRope(c, theta, scaled ? std::optional<double>(8.0) : std::nullopt);
  c["attention_bias"] = false;
  c["mlp_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["use_cache"] = true;
  return c;
}

std::optional<Result<std::string>> ReadIfPresent(const std::string& dir, const std::string& name, uint64_t max_bytes) {
  struct stat st {};
  if (::lstat((dir + "/" + name).c_str(), &st) != 0) return std::nullopt;
  return formats::ReadWholeSourceFile(dir, name, max_bytes);
}

constexpr uint64_t kMaxConfigBytes = 16u << 20, kMaxSideFileBytes = 64u << 20;

// Where a checkpoint keeps its Hugging Face config and tokenizer: beside the
// weights, or (verl) in a huggingface/ directory of its own (a real
// directory: a symlink there is not followed).
std::string HfConfigDir(const std::string& src) {
  struct stat st {};
  if (::lstat((src + "/config.json").c_str(), &st) == 0) return src;
  if (::lstat((src + "/huggingface").c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
      ::lstat((src + "/huggingface/config.json").c_str(), &st) == 0) {
    return src + "/huggingface";
  }
  return src;
}

Result<json> ParseConfig(const std::string& text, const std::string& path) {
  json c = json::parse(text, nullptr, false);
  if (c.is_discarded() || !c.is_object()) return Invalid("cannot parse " + path + ": not a JSON object");
  return c;
}

// What from_pretrained / AutoTokenizer read beside config.json.
constexpr const char* kSideFiles[] = {
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
};

// The side files present in `dir` (read through OpenSourceFile: never a
// symlink out of it); a file that cannot be read is an ERRORS line.
void AddSideFiles(const std::string& dir, HfPlan& plan) {
  for (const char* name : kSideFiles) {
    auto text = ReadIfPresent(dir, name, kMaxSideFileBytes);
    if (!text) continue;
    if (!text->ok()) {
      plan.errors.push_back("hf/: " + std::string(name) + " is not passed through: " + text->status().message());
      continue;
    }
    plan.side_files.emplace_back(name, std::move(**text));
  }
}

// The output dtype of a tensor stored as `src` under --hf-dtype.
enum class DtypeChoice { kModel, kSource, kF32, kBF16, kF16, kMaster };

// --hf-dtype's names, in DtypeChoice order.
constexpr const char* kDtypeNames[] = {"model", "source", "fp32", "bf16", "fp16", "master"};

Result<DtypeChoice> ParseDtype(const std::string& s) {
  if (s.empty()) return DtypeChoice::kModel;
  for (size_t i = 0; i < std::size(kDtypeNames); ++i) {
    if (s == kDtypeNames[i]) return static_cast<DtypeChoice>(i);
  }
  return Invalid("--hf-dtype '" + s + "': expected one of " + JoinNames(HfDtypeNames()));
}

// The parameter records, by FQN (the "param" state), and by FQN the fp32
// master ("fp32" state) when there is one.
struct Sources {  // keys view the index's own FQN strings
  std::map<std::string_view, uint32_t> param, master;
};

Sources CollectSources(const Index& index) {
  Sources s;
  const auto& ts = index.tensors();
  for (uint32_t i = 0; i < ts.size(); ++i) {
    const TensorRecord& t = ts[i];
    if (t.encoding != Encoding::kTensor) continue;
    if (t.role == Role::kParam && t.state == "param") s.param.emplace(t.fqn, i);
    if (t.role == Role::kOptimState && t.state == "fp32") s.master.emplace(t.fqn, i);
  }
  return s;
}

// The boxes of op `op` over a source tensor of `shape` (`expert`: kExpert's
// slice); an error names what does not fit.
Result<std::vector<Box>> OpBoxes(Op op, const std::vector<int64_t>& shape, const Shape& s, std::vector<int64_t>& out,
                                 int64_t expert = -1) {
  auto whole_rows = [&](int64_t a, int64_t b) {
    Box x{std::vector<int64_t>(shape.size(), 0), shape};
    x.offsets[0] = a;
    x.lengths[0] = b - a;
    return x;
  };
  out = shape;
  if (op == Op::kCopy || op == Op::kT) return std::vector<Box>{Box{std::vector<int64_t>(shape.size(), 0), shape}};
  if (op == Op::kQkv || op == Op::kQkvT) {
    std::vector<Box> all;
    int64_t rows = 0;
    for (Op part : {Op::kQ, Op::kK, Op::kV}) {
      ASSIGN_OR_RETURN(std::vector<Box> b, OpBoxes(part, shape, s, out));
      rows += out[0];
      all.insert(all.end(), b.begin(), b.end());
    }
    out = shape;
    out[0] = rows;
    return all;
  }
  if (shape.empty()) return Invalid("a 0-d tensor cannot be split");
  const int64_t rows = shape[0];
  switch (op) {
    case Op::kVocab: {
      if (s.vocab <= 0 || s.vocab > rows) {
        return Invalid("vocab_size " + std::to_string(s.vocab) + " does not fit " + std::to_string(rows) + " rows");
      }
      out[0] = s.vocab;
      return std::vector<Box>{whole_rows(0, s.vocab)};
    }
    case Op::kGate:
    case Op::kUp: {
      if (rows % 2 != 0) return Invalid(std::to_string(rows) + " rows do not split into SwiGLU's gate and up halves");
      out[0] = rows / 2;
      return std::vector<Box>{op == Op::kGate ? whole_rows(0, rows / 2) : whole_rows(rows / 2, rows)};
    }
    case Op::kQ:
    case Op::kK:
    case Op::kV: {
      if (s.kv_heads <= 0 || s.heads <= 0 || s.head_dim <= 0 || s.heads % s.kv_heads != 0) {
        return Invalid("the config's heads (" + std::to_string(s.heads) + ") and key-value heads (" +
                       std::to_string(s.kv_heads) + ") do not describe grouped attention");
      }
      const int64_t qpg = s.heads / s.kv_heads, group = (qpg + 2) * s.head_dim;
      if (rows != s.kv_heads * group) {
        return Invalid(std::to_string(rows) + " rows are not " + std::to_string(s.kv_heads) + " query groups of (" +
                       std::to_string(qpg) + " + 2) x " + std::to_string(s.head_dim));
      }
      const int64_t first = op == Op::kQ ? 0 : op == Op::kK ? qpg * s.head_dim : (qpg + 1) * s.head_dim;
      const int64_t len = op == Op::kQ ? qpg * s.head_dim : s.head_dim;
      std::vector<Box> boxes;
      for (int64_t g = 0; g < s.kv_heads; ++g) boxes.push_back(whole_rows(g * group + first, g * group + first + len));
      out[0] = s.kv_heads * len;
      return boxes;
    }
    case Op::kExpert: {
      if (shape.size() != 3 || rows != s.experts || expert < 0 || expert >= rows) {
        return Invalid(ShapeStr(shape) + " is not " + std::to_string(s.experts) + " experts' 2-D weights");
      }
      Box b{std::vector<int64_t>(shape.size(), 0), shape};
      b.offsets[0] = expert;
      b.lengths[0] = 1;
      out = {shape[1], shape[2]};
      return std::vector<Box>{b};
    }
    case Op::kRopeQ:
    case Op::kRopeK: {
      const int64_t heads = op == Op::kRopeQ ? s.heads : s.kv_heads, hd = s.head_dim;
      if (heads <= 0 || hd <= 0 || hd % 2 != 0 || rows != heads * hd) {
        return Invalid(std::to_string(rows) + " rows are not " + std::to_string(heads) + " heads of an even head_dim " +
                       std::to_string(hd));
      }
      std::vector<Box> boxes;
      boxes.reserve(static_cast<size_t>(rows));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t a = 0; a < 2; ++a) {
          for (int64_t j = 0; j < hd / 2; ++j) boxes.push_back(whole_rows(h * hd + 2 * j + a, h * hd + 2 * j + a + 1));
        }
      }
      return boxes;
    }
    case Op::kCopy:
    case Op::kT:
    case Op::kQkv:
    case Op::kQkvT:
      break;
  }
  return Invalid("unknown op");
}

}  // namespace

}  // namespace ckptfs::hf

namespace ckptfs {

std::vector<std::string> HfArchNames() {
  std::vector<std::string> v;
  for (const hf::Arch& a : hf::kArchs) v.push_back(a.name);
  return v;
}

std::vector<std::string> HfDtypeNames() { return {std::begin(hf::kDtypeNames), std::end(hf::kDtypeNames)}; }

}  // namespace ckptfs

namespace ckptfs::hf {

Result<HfPlan> PlanHf(const Index& index, const TopoOptions& opts) {
  HfPlan plan;
  ASSIGN_OR_RETURN(DtypeChoice choice, ParseDtype(opts.hf_dtype));
  const Arch* forced = nullptr;
  if (!opts.hf_arch.empty()) {
    forced = ArchByName(opts.hf_arch);
    if (forced == nullptr)
      return Invalid("--hf-arch '" + opts.hf_arch + "': expected one of " + JoinNames(HfArchNames()));
  }
  const Sources src = CollectSources(index);
  const std::string config_dir = HfConfigDir(index.src_dir());  // config.json and the tokenizer files
  Convention conv = Convention::kHf;
  if (Traits(index.info().family).names == NameConvention::kMegatron) {
    conv = Convention::kMegatron;
  } else {
    for (const auto& [fqn, id] : src.param) {
      int64_t l = -1, e = -1;
      if (fqn == "tok_embeddings.weight" || MatchTemplate("layers.{L}.attention.wq.weight", fqn, l, e)) {
        conv = Convention::kTorchtitan;
        break;
      }
    }
  }
  const bool megatron = conv == Convention::kMegatron;

  // The target config: --hf-config, else what the checkpoint records.
  json config;
  const Arch* arch = nullptr;
  std::vector<std::string> why;
  if (!opts.hf_config.empty()) {
    ASSIGN_OR_RETURN(std::string text, formats::ReadWholeFile(opts.hf_config, kMaxConfigBytes));
    ASSIGN_OR_RETURN(config, ParseConfig(text, opts.hf_config));
    const std::string mt = Get<std::string>(config, "model_type", "");
    arch = forced != nullptr ? forced : ArchByName(mt);
    if (arch == nullptr) why.push_back(opts.hf_config + ": model_type '" + mt + "' is not one ckptfs maps");
  } else if (megatron) {
    const json* args = nullptr;
    json parsed;
    for (const ExportFile& x : index.exports()) {
      if (x.path == "args.json" && x.parts.size() == 1 && x.parts[0].kind == PartKind::kLiteral) {
        parsed = json::parse(x.parts[0].literal, nullptr, false);
        if (parsed.is_object()) args = &parsed;
      }
    }
    if (args == nullptr) {
      why.push_back("the checkpoint records no Megatron args; pass --hf-config FILE (a config.json)");
    } else {
      arch = RecogniseMegatron(*args, forced, why);
    }
    if (arch != nullptr) {
      int64_t rows = 0;
      for (const char* e : {"embedding.word_embeddings.weight", "language_model.embedding.word_embeddings.weight",
                            "module.embedding.word_embeddings.weight"}) {
        auto it = src.param.find(e);
        if (it != src.param.end() && !index.tensors()[it->second].shape.empty()) {
          rows = index.tensors()[it->second].shape[0];
        }
      }
      config = MegatronConfig(*args, *arch, rows);
    }
  } else {
    auto text = ReadIfPresent(config_dir, "config.json", kMaxConfigBytes);
    if (text) {
      const std::string path = config_dir + "/config.json";
      auto c = text->ok() ? ParseConfig(**text, path) : Result<json>(text->status());
      if (!c.ok()) {
        why.push_back(c.status().message());
      } else {
        config = std::move(*c);
        const std::string mt = Get<std::string>(config, "model_type", "");
        arch = forced != nullptr ? forced : ArchByName(mt);
        if (arch == nullptr && config.contains("architectures")) {
          // An architecture ckptfs has no table for, already under its
          // Hugging Face names: served as they are, with its config.
          const json& names = config["architectures"];
          plan.architecture =
              names.is_array() && !names.empty() && names[0].is_string() ? names[0].get<std::string>() : "?";
        }
      }
    } else if (conv == Convention::kTorchtitan) {
      // Meta's own checkpoints (consolidated.0X.pth) carry params.json.
      auto params_text = ReadIfPresent(config_dir, "params.json", kMaxConfigBytes);
      json params = params_text && params_text->ok() ? json::parse(**params_text, nullptr, false) : json();
      if (params.is_object() && Get<int64_t>(params, "dim", 0) > 0 && Get<int64_t>(params, "n_heads", 0) > 0) {
        arch = forced != nullptr ? forced : ArchByName("llama");
        auto rows = [&](const char* name) -> int64_t {
          auto it = src.param.find(name);
          return it == src.param.end() || index.tensors()[it->second].shape.empty()
                     ? 0
                     : index.tensors()[it->second].shape[0];
        };
        config =
            MetaParamsConfig(params, *arch, rows("tok_embeddings.weight"), rows("layers.0.feed_forward.w1.weight"));
      } else {
        why.push_back(params_text ? config_dir + "/params.json: not a Meta params.json (an object with dim and n_heads)"
                                  : "torchtitan names (tok_embeddings, layers.N.attention.wq), and no config beside "
                                    "them (torchtitan records none in its checkpoint; Meta's params.json is absent); "
                                    "pass --hf-config FILE (the model's config.json: Llama's heads and key-value heads "
                                    "decide the RoPE row permutation of wq and wk; Qwen3 and Qwen3-MoE rotate halves "
                                    "and are copied as they are)");
      }
    } else {
      why.push_back(
          "the checkpoint records no model architecture (no Megatron args, no config.json beside it); "
          "pass --hf-config FILE (a config.json) and, if needed, --hf-arch NAME");
    }
  }
  // torchtitan's Llama 3 and Qwen3 differ in their RoPE (interleaved pairs,
  // permuted for Hugging Face, vs halves, copied): the config must name the
  // model the checkpoint's tensors are (Qwen3 has QK norms).
  if (arch != nullptr && conv == Convention::kTorchtitan) {
    const std::string mt = arch->model_type;
    bool qk_norms = false;
    for (const auto& [fqn, id] : src.param) {
      int64_t l = -1, e = -1;
      qk_norms = qk_norms || MatchTemplate("layers.{L}.attention.q_norm.weight", fqn, l, e);
    }
    if (mt != "llama" && mt != "mistral" && mt != "qwen3" && mt != "qwen3_moe") {
      why.push_back("torchtitan's names map to llama, mistral, qwen3 or qwen3_moe, not " + mt);
      arch = nullptr;
    } else if (Get<bool>(config, "attention_bias", false) || Get<bool>(config, "mlp_bias", false)) {
      why.push_back("the config has linear biases, which torchtitan's Llama 3 and Qwen3 have not");
      arch = nullptr;
    } else if (qk_norms && (mt == "llama" || mt == "mistral")) {
      why.push_back("the checkpoint has QK norms (torchtitan's Qwen3), and the config is " + mt +
                    ": Qwen3's RoPE rotates halves, Llama's is permuted; pass Qwen3's config.json");
      arch = nullptr;
    }
  }
  // Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) are not
  // mapped: every layer is taken to be sparse.
  if (arch != nullptr && arch->moe == Moe::kQwen3) {
    const auto only = config.find("mlp_only_layers");
    const bool mixed = (only != config.end() && only->is_array() && !only->empty()) ||
                       Get<int64_t>(config, "decoder_sparse_step", 1) != 1;
    if (mixed) {
      why.push_back(
          "the config mixes dense and MoE layers (mlp_only_layers, decoder_sparse_step), which hf/ does "
          "not map");
      arch = nullptr;
    }
  }

  // The tensors: mapped (Megatron names) or as named (Hugging Face names).
  const bool mapped = arch != nullptr && conv != Convention::kHf;
  if (arch == nullptr && plan.architecture.empty()) {
    for (const std::string& w : why) plan.errors.push_back("hf/: not a transformers model directory: " + w);
    plan.errors.push_back("hf/: the parameters are served under their source names, without config.json");
  }
  Shape shape;
  if (arch != nullptr) shape = ShapeOf(config, *arch);

  // Output dtype per source tensor, and the model dtype for config.json.
  std::map<DType, uint64_t> dtype_bytes;
  for (const auto& [fqn, id] : src.param) dtype_bytes[index.tensors()[id].dtype] += index.tensors()[id].byte_size;
  DType model = DType::kInvalid;
  uint64_t best = 0;
  for (const auto& [d, n] : dtype_bytes) {
    if (n > best) best = n, model = d;
  }
  auto out_dtype = [&](DType d) -> DType {
    switch (choice) {
      case DtypeChoice::kModel:
        return model;
      case DtypeChoice::kSource:
        return d;
      case DtypeChoice::kF32:
      case DtypeChoice::kMaster:
        return DType::kF32;
      case DtypeChoice::kBF16:
        return DType::kBF16;
      case DtypeChoice::kF16:
        return DType::kF16;
    }
    return d;
  };

  // A config's counts are untrusted: at most one expected name per layer and
  // expert can exist for each source tensor, so more is refused, not looped.
  const int64_t bound = 4 * static_cast<int64_t>(src.param.size()) + 16;
  std::set<std::string> produced;
  auto add = [&](const std::string& hf_name, const std::string& fqn, uint32_t id, Op op, int64_t expert) {
    uint32_t read = id;
    if (choice == DtypeChoice::kMaster) {
      auto m = src.master.find(fqn);
      if (m == src.master.end()) {
        plan.errors.push_back("hf/: '" + hf_name + "' is not included: --hf-dtype master, and '" + fqn +
                              "' has no fp32 master copy in the checkpoint");
        plan.not_included.push_back(fqn);
        return;
      }
      read = m->second;
    }
    const TensorRecord& t = index.tensors()[read];
    if (!t.error.empty()) {
      plan.errors.push_back("hf/: '" + hf_name + "' is not included: " + t.error);
      plan.not_included.push_back(fqn);
      return;
    }
    HfTensor h;
    h.name = hf_name;
    h.id = TensorId{read};
    h.out = out_dtype(t.dtype);
    // The read engine's conversions: widening to float32, float32 narrowed
    // to bf16 / f16 with round to nearest even.
    if (!Renders(t.dtype, h.out)) {
      plan.errors.push_back("hf/: '" + hf_name + "' is not included: '" + fqn + "' is " +
                            std::string(DTypeName(t.dtype)) +
                            ", and ckptfs converts only floats to float32 and "
                            "float32 to bfloat16 / float16, not to " +
                            std::string(DTypeName(h.out)) + " (use --hf-dtype source or fp32)");
      plan.not_included.push_back(fqn);
      return;
    }
    if (SafetensorsDType(h.out).empty()) {
      plan.errors.push_back("hf/: '" + hf_name + "' is not included: safetensors has no dtype " +
                            std::string(DTypeName(h.out)));
      plan.not_included.push_back(fqn);
      return;
    }
    auto boxes = OpBoxes(op, t.shape, shape, h.shape, expert);
    if (!boxes.ok()) {
      plan.errors.push_back("hf/: '" + hf_name + "' is not included: cannot split '" + fqn +
                            "': " + boxes.status().message());
      plan.not_included.push_back(fqn);
      return;
    }
    h.pieces = std::move(*boxes);
    if (op == Op::kT || op == Op::kQkvT) {  // the pieces' rows, transposed
      if (h.shape.size() != 2) {
        plan.errors.push_back("hf/: '" + hf_name + "' is not included: '" + fqn + "' is not 2-D (" + ShapeStr(t.shape) +
                              "), so it has no Conv1D transpose");
        plan.not_included.push_back(fqn);
        return;
      }
      h.shape = {h.shape[1], h.shape[0]};
      h.transposed = true;
    }
    if (!produced.insert(hf_name).second) {
      plan.errors.push_back("hf/: '" + hf_name + "' would come from two source tensors; the second, '" + fqn +
                            "', is left out");
      plan.not_included.push_back(fqn);
      return;
    }
    plan.tensors.push_back(std::move(h));
  };

  // The tables of the source convention and target architecture.
  std::vector<const MapRule*> rules;
  bool permute_rope = true;  // kRopeQ / kRopeK: Meta's interleaved pairs; false: copied
  auto use = [&](const auto& table) {
    for (const MapRule& r : table) rules.push_back(&r);
  };
  if (arch != nullptr && conv == Convention::kTorchtitan) {
    use(kTorchtitanLlama);
    if (arch->moe == Moe::kQwen3 || std::string_view(arch->model_type) == "qwen3") {
      use(kTorchtitanQkNorm);
      permute_rope = false;
    }
    if (arch->moe == Moe::kQwen3) {
      use(kTorchtitanQwen3MoeMlp);
    } else {
      use(kTorchtitanDenseMlp);
    }
  } else if (arch != nullptr && arch->layout == Layout::kNeox) {
    use(kMegatronNeox);
  } else if (arch != nullptr && arch->layout == Layout::kGpt2) {
    use(kMegatronGpt2);
  } else if (arch != nullptr) {
    use(kMegatronCommon);
    switch (arch->moe) {
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
  for (const auto& [key, id] : src.param) {
    const std::string& fqn = index.tensors()[id].fqn;
    if (!mapped) {
      add(fqn, fqn, id, Op::kCopy, -1);
      continue;
    }
    const std::string name = McoreName(fqn);
    bool any = false, skipped = false, tied = false;
    for (const MapRule* r : rules) {
      int64_t layer = -1, expert = -1;
      if (!MatchTemplate(r->src, name, layer, expert)) continue;
      if (!Holds(r->when, shape)) {
        (r->when == When::kUntied ? tied : skipped) = true;
        continue;
      }
      any = true;
      if (r->op != Op::kExpert) {
        const bool rope = r->op == Op::kRopeQ || r->op == Op::kRopeK;
        add(Expand(r->dst, layer, expert), fqn, id, rope && !permute_rope ? Op::kCopy : r->op, -1);
        continue;
      }
      // Grouped experts: one tensor holds them all, [E, ...] with E the
      // config's expert count (checked before looping over it).
      const std::vector<int64_t>& sh = index.tensors()[id].shape;
      if (sh.size() != 3 || sh[0] != shape.experts || shape.experts > bound) {
        plan.not_included.push_back(fqn);
        plan.errors.push_back("hf/: '" + fqn + "' is not included: its shape " + ShapeStr(sh) + " is not the " +
                              std::to_string(shape.experts) + " experts the config has");
        continue;
      }
      for (int64_t e = 0; e < shape.experts; ++e) add(Expand(r->dst, layer, e), fqn, id, r->op, e);
    }
    if (!any && tied && !skipped) {
      // An output head the config ties to the embedding (torchtitan saves
      // both): transformers uses the embedding, as the source model did.
      plan.not_included.push_back(fqn);
    } else if (!any) {
      std::string why_not = skipped ? std::string("the config has no such tensor (") + arch->cls + ", no bias)"
                                    : std::string("no ") + arch->cls + " tensor is mapped from it";
      for (const auto& [tmpl, reason] : kKnownUnmapped) {
        int64_t l = -1, e = -1;
        if (MatchTemplate(tmpl, name, l, e)) why_not = reason;
      }
      plan.not_included.push_back(fqn);
      plan.errors.push_back("hf/: '" + fqn + "' is not included: " + why_not);
    }
  }

  // Every tensor the target architecture has must be there: a pipeline stage
  // that was not saved shows here, not as a model with random layers.
  if (arch != nullptr &&
      (shape.layers > bound || shape.experts > bound || shape.layers * std::max<int64_t>(shape.experts, 1) > bound)) {
    plan.errors.push_back("hf/: the config's num_hidden_layers (" + std::to_string(shape.layers) + ") and experts (" +
                          std::to_string(shape.experts) + ") are far more than the checkpoint's " +
                          std::to_string(src.param.size()) + " parameters hold; completeness is not checked");
  } else if (arch != nullptr) {
    std::set<std::string> expected;
    for (const MapRule* r : rules) {
      if (!Holds(r->when, shape)) continue;
      const std::string_view dst_tmpl = r->dst;
      const bool per_layer = dst_tmpl.find("{L}") != std::string_view::npos;
      const bool per_expert = dst_tmpl.find("{E}") != std::string_view::npos;
      for (int64_t l = 0; l < (per_layer ? shape.layers : 1); ++l) {
        for (int64_t e = 0; e < (per_expert ? shape.experts : 1); ++e) expected.insert(Expand(r->dst, l, e));
      }
    }
    for (const std::string& e : expected) {
      if (!produced.count(e)) {
        plan.errors.push_back("hf/: '" + e +
                              "' is missing: no source tensor provides it, so transformers would "
                              "initialise it at random");
      }
    }
    if (mapped) plan.architecture = arch->cls;
  }
  if (arch != nullptr || !plan.architecture.empty()) {
    if (plan.architecture.empty()) plan.architecture = arch->cls;
    // The dtype the files hold: what transformers loads them as by default.
    std::map<DType, uint64_t> served;
    for (const HfTensor& h : plan.tensors) {
      served[h.out] += static_cast<uint64_t>(NumelOf(h.shape));
    }
    DType top = DType::kInvalid;
    uint64_t most = 0;
    for (const auto& [d, n] : served) {
      if (n > most) most = n, top = d;
    }
    if (const char* d = ConfigDtype(top)) {
      config["torch_dtype"] = d;  // transformers 4.x
      config["dtype"] = d;        // transformers 5.x
    }
    plan.config_json = JsonText(config, 2) + "\n";
    const std::string& cfg = opts.hf_config;
    AddSideFiles(cfg.empty() ? config_dir : cfg.substr(0, std::max<size_t>(cfg.rfind('/'), 1)), plan);
  }
  return plan;
}

}  // namespace ckptfs::hf
