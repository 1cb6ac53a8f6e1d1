// torchtitan's names for hf/: the rule tables of its Llama 3, Qwen3 and
// Qwen3-MoE, the checks that a target config is the model its tensors are
// (RoPE layout, biases), and the tensors Hugging Face has no place for.
// Recognised by name in any checkpoint whose family keeps module paths
// (torchtitan saves DCPs; Meta's consolidated.NN.pth share the names).
#include "formats/dcp/torchtitan_hf.h"

#include <string>
#include <utility>
#include <vector>

#include "ckptfs/formats.h"

namespace ckptfs::formats {
namespace {

using hf::Arch;
using hf::json;
using hf::JsonGet;
using hf::MapRule;
using hf::MatchTemplate;
using hf::Moe;
using hf::Op;
using hf::When;

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

// torchtitan's (and Meta's) names: the embedding or a layer's wq.
bool Recognises(const hf::HfSource& in) {
  if (Traits(in.family).names != NameConvention::kTorch) return false;
  for (const auto& [fqn, id] : in.params) {
    int64_t l = -1, e = -1;
    if (fqn == "tok_embeddings.weight" || MatchTemplate("layers.{L}.attention.wq.weight", fqn, l, e)) return true;
  }
  return false;
}

hf::HfRules Rules(const Arch& arch, const hf::json& /*config*/) {
  hf::HfRules r;
  auto use = [&](const auto& table) {
    for (const MapRule& m : table) r.rules.push_back(&m);
  };
  use(kTorchtitanLlama);
  if (arch.moe == Moe::kQwen3 || std::string_view(arch.model_type) == "qwen3") {
    use(kTorchtitanQkNorm);
    r.permute_rope = false;
  }
  if (arch.moe == Moe::kQwen3) {
    use(kTorchtitanQwen3MoeMlp);
  } else {
    use(kTorchtitanDenseMlp);
  }
  return r;
}

// torchtitan's Llama 3 and Qwen3 differ in their RoPE (interleaved pairs,
// permuted for Hugging Face, vs halves, copied): the config must name the
// model the checkpoint's tensors are (Qwen3 has QK norms).
bool Fits(const hf::HfSource& in, const Arch& arch, const json& config, std::vector<std::string>& why) {
  const std::string mt = arch.model_type;
  bool qk_norms = false;
  for (const auto& [fqn, id] : in.params) {
    int64_t l = -1, e = -1;
    qk_norms = qk_norms || MatchTemplate("layers.{L}.attention.q_norm.weight", fqn, l, e);
  }
  if (mt != "llama" && mt != "mistral" && mt != "qwen3" && mt != "qwen3_moe") {
    why.push_back("torchtitan's names map to llama, mistral, qwen3 or qwen3_moe, not " + mt);
    return false;
  }
  if (JsonGet<bool>(config, "attention_bias", false) || JsonGet<bool>(config, "mlp_bias", false)) {
    why.push_back("the config has linear biases, which torchtitan's Llama 3 and Qwen3 have not");
    return false;
  }
  if (qk_norms && (mt == "llama" || mt == "mistral")) {
    why.push_back("the checkpoint has QK norms (torchtitan's Qwen3), and the config is " + mt +
                  ": Qwen3's RoPE rotates halves, Llama's is permuted; pass Qwen3's config.json");
    return false;
  }
  return true;
}

const char* UnmappedWhy(std::string_view name) {
  const char* why = nullptr;
  for (const auto& [tmpl, reason] : kKnownUnmapped) {
    int64_t l = -1, e = -1;
    if (MatchTemplate(tmpl, name, l, e)) why = reason;
  }
  return why;
}

}  // namespace

const hf::HfConvention& TorchtitanHfConvention() {
  static const hf::HfConvention kConvention = [] {
    hf::HfConvention c;
    c.name = "torchtitan";
    c.recognises = &Recognises;
    c.rules = &Rules;
    c.fits = &Fits;
    c.no_config_why =
        "torchtitan names (tok_embeddings, layers.N.attention.wq), and no config beside "
        "them (torchtitan records none in its checkpoint; Meta's params.json is absent); "
        "pass --hf-config FILE (the model's config.json: Llama's heads and key-value heads "
        "decide the RoPE row permutation of wq and wk; Qwen3 and Qwen3-MoE rotate halves "
        "and are copied as they are)";
    c.unmapped_why = &UnmappedWhy;
    return c;
  }();
  return kConvention;
}

}  // namespace ckptfs::formats
