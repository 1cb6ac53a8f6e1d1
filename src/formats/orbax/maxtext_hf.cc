// MaxText's names for hf/ (docs/formats/orbax.md, "MaxText"): its Llama,
// Mistral and Gemma 2 decoders. MaxText keeps a Flax model: kernels are [in..., out...] (a query kernel [emb, heads,
// head_dim], the attention output [heads, head_dim, emb]), and with
// scan_layers (its default) every per-layer tensor is one stack with the
// layers on axis 1 (param_scan_axis); without it, decoder.layers_<N>. Its
// query kernel holds 1/sqrt(head_dim) (folded into the initializer, never
// applied to QK^T), so the Hugging Face q_proj is it times sqrt(head_dim).
// Its RoPE is chosen by model_name, which the checkpoint does not record:
// llama3.1-* rotate interleaved pairs (permuted for Hugging Face), the rest
// halves (copied). Nor does it record the model config: the target comes
// from --hf-config, checked against the tensors' shapes.
#include "formats/orbax/maxtext_hf.h"

#include <string>
#include <vector>

#include "ckptfs/formats.h"

namespace ckptfs::formats {
namespace {

using hf::Arch;
using hf::json;
using hf::JsonGet;
using hf::MapRule;
using hf::MatchTemplate;
using hf::Op;
using hf::Scale;
using hf::When;

// MaxText's Llama / Mistral decoder (models/llama2.py, mistral.py) ->
// Hugging Face, as checkpoint_conversion's LLAMA31 mapping takes it: scanned
// layers (one stack, axis 1).
constexpr MapRule kMaxTextLlama[] = {
    {"token_embedder.embedding", "model.embed_tokens.weight", Op::kCopy, When::kAlways},
    {"decoder.decoder_norm.scale", "model.norm.weight", Op::kCopy, When::kAlways},
    {"decoder.logits_dense.kernel", "lm_head.weight", Op::kT, When::kUntied},
    {"decoder.layers.self_attention.query.kernel", "model.layers.{L}.self_attn.q_proj.weight", Op::kFlaxRopeQT,
     When::kAlways, 1, Scale::kSqrtHeadDim},
    {"decoder.layers.self_attention.key.kernel", "model.layers.{L}.self_attn.k_proj.weight", Op::kFlaxRopeKT,
     When::kAlways, 1},
    {"decoder.layers.self_attention.value.kernel", "model.layers.{L}.self_attn.v_proj.weight", Op::kFlaxT,
     When::kAlways, 1},
    {"decoder.layers.self_attention.out.kernel", "model.layers.{L}.self_attn.o_proj.weight", Op::kFlaxOutT,
     When::kAlways, 1},
    {"decoder.layers.pre_self_attention_layer_norm.scale", "model.layers.{L}.input_layernorm.weight", Op::kCopy,
     When::kAlways, 1},
    {"decoder.layers.post_self_attention_layer_norm.scale", "model.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways, 1},
    {"decoder.layers.mlp.wi_0.kernel", "model.layers.{L}.mlp.gate_proj.weight", Op::kFlaxT, When::kAlways, 1},
    {"decoder.layers.mlp.wi_1.kernel", "model.layers.{L}.mlp.up_proj.weight", Op::kFlaxT, When::kAlways, 1},
    {"decoder.layers.mlp.wo.kernel", "model.layers.{L}.mlp.down_proj.weight", Op::kFlaxOutT, When::kAlways, 1},
    // scan_layers=False: one tensor per layer, decoder.layers_<N>.
    {"decoder.layers_{L}.self_attention.query.kernel", "model.layers.{L}.self_attn.q_proj.weight", Op::kFlaxRopeQT,
     When::kAlways, -1, Scale::kSqrtHeadDim},
    {"decoder.layers_{L}.self_attention.key.kernel", "model.layers.{L}.self_attn.k_proj.weight", Op::kFlaxRopeKT,
     When::kAlways},
    {"decoder.layers_{L}.self_attention.value.kernel", "model.layers.{L}.self_attn.v_proj.weight", Op::kFlaxT,
     When::kAlways},
    {"decoder.layers_{L}.self_attention.out.kernel", "model.layers.{L}.self_attn.o_proj.weight", Op::kFlaxOutT,
     When::kAlways},
    {"decoder.layers_{L}.pre_self_attention_layer_norm.scale", "model.layers.{L}.input_layernorm.weight", Op::kCopy,
     When::kAlways},
    {"decoder.layers_{L}.post_self_attention_layer_norm.scale", "model.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways},
    {"decoder.layers_{L}.mlp.wi_0.kernel", "model.layers.{L}.mlp.gate_proj.weight", Op::kFlaxT, When::kAlways},
    {"decoder.layers_{L}.mlp.wi_1.kernel", "model.layers.{L}.mlp.up_proj.weight", Op::kFlaxT, When::kAlways},
    {"decoder.layers_{L}.mlp.wo.kernel", "model.layers.{L}.mlp.down_proj.weight", Op::kFlaxOutT, When::kAlways},
};

// MaxText's Gemma 2 decoder (models/gemma2.py), scanned: each MaxText layer
// is a local (sliding-window) block and a global one, Hugging Face layers 2l
// and 2l + 1. Its norms multiply by their scale where Gemma's multiply by
// 1 + weight (so -1), and its input embedding is Hugging Face's times
// sqrt(emb_dim) (MaxText divides the tied logits instead), as
// GEMMA2_MAXTEXT_TO_HF_PARAM_HOOK_FN converts them.
constexpr MapRule kMaxTextGemma2[] = {
    {"token_embedder.embedding", "model.embed_tokens.weight", Op::kCopy, When::kAlways, -1, Scale::kInvSqrtHidden},
    {"decoder.decoder_norm.scale", "model.norm.weight", Op::kCopy, When::kAlways, -1, Scale::kOne, -1},
    // The local block: Hugging Face layer 2l + 0.
    {"decoder.layers.pre_self_attention_norm_local.scale", "model.layers.{L}.input_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 0},
    {"decoder.layers.self_attention_local.query.kernel", "model.layers.{L}.self_attn.q_proj.weight", Op::kFlaxRopeQT,
     When::kAlways, 1, Scale::kSqrtHeadDim, 0, 2, 0},
    {"decoder.layers.self_attention_local.key.kernel", "model.layers.{L}.self_attn.k_proj.weight", Op::kFlaxRopeKT,
     When::kAlways, 1, Scale::kOne, 0, 2, 0},
    {"decoder.layers.self_attention_local.value.kernel", "model.layers.{L}.self_attn.v_proj.weight", Op::kFlaxT,
     When::kAlways, 1, Scale::kOne, 0, 2, 0},
    {"decoder.layers.self_attention_local.out.kernel", "model.layers.{L}.self_attn.o_proj.weight", Op::kFlaxOutT,
     When::kAlways, 1, Scale::kOne, 0, 2, 0},
    {"decoder.layers.post_self_attention_norm_local.scale", "model.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways, 1, Scale::kOne, -1, 2, 0},
    {"decoder.layers.pre_ffw_norm_local.scale", "model.layers.{L}.pre_feedforward_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 0},
    {"decoder.layers.post_ffw_norm_local.scale", "model.layers.{L}.post_feedforward_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 0},
    {"decoder.layers.mlp_local.wi_0.kernel", "model.layers.{L}.mlp.gate_proj.weight", Op::kFlaxT, When::kAlways, 1,
     Scale::kOne, 0, 2, 0},
    {"decoder.layers.mlp_local.wi_1.kernel", "model.layers.{L}.mlp.up_proj.weight", Op::kFlaxT, When::kAlways, 1,
     Scale::kOne, 0, 2, 0},
    {"decoder.layers.mlp_local.wo.kernel", "model.layers.{L}.mlp.down_proj.weight", Op::kFlaxOutT, When::kAlways, 1,
     Scale::kOne, 0, 2, 0},
    // The global block: Hugging Face layer 2l + 1.
    {"decoder.layers.pre_self_attention_norm_global.scale", "model.layers.{L}.input_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 1},
    {"decoder.layers.self_attention_global.query.kernel", "model.layers.{L}.self_attn.q_proj.weight", Op::kFlaxRopeQT,
     When::kAlways, 1, Scale::kSqrtHeadDim, 0, 2, 1},
    {"decoder.layers.self_attention_global.key.kernel", "model.layers.{L}.self_attn.k_proj.weight", Op::kFlaxRopeKT,
     When::kAlways, 1, Scale::kOne, 0, 2, 1},
    {"decoder.layers.self_attention_global.value.kernel", "model.layers.{L}.self_attn.v_proj.weight", Op::kFlaxT,
     When::kAlways, 1, Scale::kOne, 0, 2, 1},
    {"decoder.layers.self_attention_global.out.kernel", "model.layers.{L}.self_attn.o_proj.weight", Op::kFlaxOutT,
     When::kAlways, 1, Scale::kOne, 0, 2, 1},
    {"decoder.layers.post_self_attention_norm_global.scale", "model.layers.{L}.post_attention_layernorm.weight",
     Op::kCopy, When::kAlways, 1, Scale::kOne, -1, 2, 1},
    {"decoder.layers.pre_ffw_norm_global.scale", "model.layers.{L}.pre_feedforward_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 1},
    {"decoder.layers.post_ffw_norm_global.scale", "model.layers.{L}.post_feedforward_layernorm.weight", Op::kCopy,
     When::kAlways, 1, Scale::kOne, -1, 2, 1},
    {"decoder.layers.mlp_global.wi_0.kernel", "model.layers.{L}.mlp.gate_proj.weight", Op::kFlaxT, When::kAlways, 1,
     Scale::kOne, 0, 2, 1},
    {"decoder.layers.mlp_global.wi_1.kernel", "model.layers.{L}.mlp.up_proj.weight", Op::kFlaxT, When::kAlways, 1,
     Scale::kOne, 0, 2, 1},
    {"decoder.layers.mlp_global.wo.kernel", "model.layers.{L}.mlp.down_proj.weight", Op::kFlaxOutT, When::kAlways, 1,
     Scale::kOne, 0, 2, 1},
};

// A parameter's shape by name, or nullptr.
const std::vector<int64_t>* ShapeOf(const hf::HfSource& in, const std::string& fqn) {
  auto it = in.params.find(fqn);
  return it == in.params.end() ? nullptr : &in.tensors[it->second].shape;
}

// MaxText's names: the token embedder beside a decoder's query kernel.
bool Recognises(const hf::HfSource& in) {
  if (Traits(in.family).names != NameConvention::kJax || !in.params.count("token_embedder.embedding")) return false;
  for (const auto& [fqn, id] : in.params) {
    int64_t l = -1, e = -1;
    if (fqn == "decoder.layers.self_attention.query.kernel" ||
        fqn == "decoder.layers.self_attention_local.query.kernel" ||
        MatchTemplate("decoder.layers_{L}.self_attention.query.kernel", fqn, l, e)) {
      return true;
    }
  }
  return false;
}

bool IsGemma2(const Arch& arch) { return arch.layout == hf::Layout::kGemma2; }

// The rope type a config.json names (transformers 5.x rope_parameters, 4.x
// rope_scaling); "default" when neither.
std::string RopeType(const json& config) {
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = config.find(key);
    if (it != config.end() && it->is_object()) {
      const std::string t = JsonGet<std::string>(*it, "rope_type", JsonGet<std::string>(*it, "type", ""));
      if (!t.empty()) return t;
    }
  }
  return "default";
}

hf::HfRules Rules(const Arch& arch, const json& config) {
  hf::HfRules r;
  if (IsGemma2(arch)) {
    for (const MapRule& m : kMaxTextGemma2) r.rules.push_back(&m);
  } else {
    for (const MapRule& m : kMaxTextLlama) r.rules.push_back(&m);
  }
  // MaxText's RotaryEmbedding (llama2, llama3, mistral, gemma) rotates halves
  // as transformers does; only model_name llama3.1-* takes
  // LLaMARotaryEmbedding (interleaved pairs). Hugging Face's Llama 3.1, 3.2
  // and 3.3 configs all say rope_type llama3, while MaxText's llama3.3-70b
  // rotates halves.
  r.permute_rope = false;
  if (RopeType(config) == "llama3") {
    r.rope_undecided =
        "the config is a Llama 3.x with llama3 RoPE scaling, and MaxText rotates interleaved pairs for its llama3.1-* "
        "models but halves for llama3.3-70b; its checkpoint does not record model_name";
  }
  return r;
}

// The config must be the model the tensors are: its sizes against the
// embedding, the query, key and MLP kernels and the layer count.
bool Fits(const hf::HfSource& in, const Arch& arch, const json& config, std::vector<std::string>& why) {
  const std::string mt = arch.model_type;
  const bool gemma2 = IsGemma2(arch);
  if (mt != "llama" && mt != "mistral" && !gemma2) {
    why.push_back("MaxText's names map to llama, mistral or gemma2, not " + mt);
    return false;
  }
  if (JsonGet<bool>(config, "attention_bias", false) || JsonGet<bool>(config, "mlp_bias", false)) {
    why.push_back("the config has linear biases, which MaxText's decoders have not");
    return false;
  }
  const std::vector<int64_t>* emb = ShapeOf(in, "token_embedder.embedding");
  const bool scanned = gemma2 || ShapeOf(in, "decoder.layers.self_attention.query.kernel") != nullptr;
  const std::string layer = scanned ? "decoder.layers." : "decoder.layers_0.";
  const std::string block = gemma2 ? "_local" : "";
  const std::vector<int64_t>* q = ShapeOf(in, layer + "self_attention" + block + ".query.kernel");
  const std::vector<int64_t>* k = ShapeOf(in, layer + "self_attention" + block + ".key.kernel");
  const std::vector<int64_t>* wi = ShapeOf(in, layer + "mlp" + block + ".wi_0.kernel");
  const size_t rank = scanned ? 4 : 3;
  if (emb == nullptr || emb->size() != 2 || q == nullptr || q->size() != rank || k == nullptr || k->size() != rank ||
      wi == nullptr || wi->size() != rank - 1) {
    why.push_back(std::string("the checkpoint lacks MaxText's ") +
                  (gemma2 ? "Gemma 2 (scanned, local and global) " : "") +
                  "embedding, query, key or MLP kernels in their usual ranks");
    return false;
  }
  int64_t layers = scanned ? (*q)[1] * (gemma2 ? 2 : 1) : 0;
  if (!scanned) {
    while (ShapeOf(in, "decoder.layers_" + std::to_string(layers) + ".self_attention.query.kernel") != nullptr)
      ++layers;
  }
  const int64_t heads = JsonGet<int64_t>(config, "num_attention_heads", 0);
  const int64_t hidden = JsonGet<int64_t>(config, "hidden_size", 0);
  const struct {
    const char* key;
    int64_t want;
    int64_t def;
  } checks[] = {
      {"vocab_size", (*emb)[0], 0},
      {"hidden_size", (*emb)[1], 0},
      {"num_hidden_layers", layers, 0},
      {"num_attention_heads", (*q)[rank - 2], 0},
      {"num_key_value_heads", (*k)[rank - 2], heads},
      {"head_dim", (*q)[rank - 1], heads > 0 ? hidden / heads : 0},
      {"intermediate_size", wi->back(), 0},
  };
  bool ok = true;
  for (const auto& c : checks) {
    const int64_t got = JsonGet<int64_t>(config, c.key, c.def);
    if (got != c.want) {
      why.push_back("the config's " + std::string(c.key) + " is " + std::to_string(got) + ", the checkpoint's " +
                    std::to_string(c.want));
      ok = false;
    }
  }
  const bool untied = ShapeOf(in, "decoder.logits_dense.kernel") != nullptr;
  if (JsonGet<bool>(config, "tie_word_embeddings", gemma2) == untied) {
    why.push_back(std::string("the config ") + (untied ? "ties" : "unties") + " the output head, and the checkpoint " +
                  (untied ? "has its own (decoder.logits_dense)" : "has none (logits_via_embedding)"));
    ok = false;
  }
  // q_proj is scaled by sqrt(head_dim) to undo MaxText's folded 1/sqrt(head_dim);
  // Gemma 2 then scales QK^T by query_pre_attn_scalar^-1/2, which must be it.
  if (gemma2 && JsonGet<int64_t>(config, "query_pre_attn_scalar", 0) != (*q)[rank - 1]) {
    why.push_back("the config's query_pre_attn_scalar is " +
                  std::to_string(JsonGet<int64_t>(config, "query_pre_attn_scalar", 0)) +
                  ", and MaxText's Gemma 2 query kernel holds 1/sqrt(head_dim): set it to head_dim (" +
                  std::to_string((*q)[rank - 1]) + ")");
    ok = false;
  }
  return ok;
}

}  // namespace

const hf::HfConvention& MaxTextHfConvention() {
  static const hf::HfConvention kConvention = [] {
    hf::HfConvention c;
    c.name = "maxtext";
    c.recognises = &Recognises;
    c.rules = &Rules;
    c.fits = &Fits;
    c.no_config_why =
        "MaxText names (token_embedder, decoder.layers...), and MaxText saves no model config in its checkpoint "
        "(model_name, RoPE, norm epsilon); pass --hf-config FILE (the model's config.json, checked against the "
        "tensors' shapes) and, for a Llama 3.x config, --hf-rope";
    return c;
  }();
  return kConvention;
}

}  // namespace ckptfs::formats
