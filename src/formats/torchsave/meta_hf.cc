// Meta's params.json for hf/: the config hook of Meta's reference names
// (which torchtitan keeps, so its tables in dcp/torchtitan_hf.cc name the
// tensors). params.json is read only when no config.json is beside the
// checkpoint, as transformers' convert_llama_weights_to_hf.py reads it.
#include "formats/torchsave/meta_hf.h"

#include <sys/stat.h>

#include <optional>
#include <string>
#include <vector>

#include "ckptfs/formats.h"
#include "formats/byte_reader.h"

namespace ckptfs::formats {
namespace {

using hf::Arch;
using hf::json;
using hf::JsonGet;
using hf::SetRope;

constexpr uint64_t kMaxParamsBytes = 16u << 20;  // as config.json

// A Llama config.json from Meta's params.json (dim, n_layers, n_heads,
// n_kv_heads, vocab_size, norm_eps, rope_theta, use_scaled_rope), as
// transformers' own convert_llama_weights_to_hf.py writes it. The sizes
// params.json leaves out or gives as -1 (Llama 2's vocab_size) come from the
// weights: the embedding's rows and feed_forward.w1's.
json MetaParamsConfig(const json& p, const Arch& a, int64_t embedding_rows, int64_t ffn_rows) {
  const int64_t hidden = JsonGet<int64_t>(p, "dim", 0);
  const int64_t heads = JsonGet<int64_t>(p, "n_heads", 0);
  int64_t kv = heads;
  if (p.contains("n_kv_heads") && p["n_kv_heads"].is_number_integer()) kv = p["n_kv_heads"].get<int64_t>();
  int64_t vocab = JsonGet<int64_t>(p, "vocab_size", -1);
  if (vocab <= 0) vocab = embedding_rows;
  const double theta = JsonGet<double>(p, "rope_theta", 10000.0);
  const bool scaled = JsonGet<bool>(p, "use_scaled_rope", false);
  json c;
  c["architectures"] = json::array({a.cls});
  c["model_type"] = a.model_type;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = ffn_rows;
  c["num_hidden_layers"] = JsonGet<int64_t>(p, "n_layers", 0);
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = kv;
  c["head_dim"] = heads > 0 ? hidden / heads : 0;
  c["hidden_act"] = "silu";
  // The converter's choice: Llama 3.1 (scaled RoPE) 131072, Llama 3 8192, Llama 2 4096.
  c["max_position_embeddings"] = scaled ? 131072 : theta >= 500000.0 ? 8192 : 4096;
  c["rms_norm_eps"] = JsonGet<double>(p, "norm_eps", 1e-5);
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

// Meta's reference names: the embedding or a layer's wq.
bool Recognises(const hf::HfSource& in) {
  if (Traits(in.family).names != NameConvention::kTorch) return false;
  for (const auto& [fqn, id] : in.params) {
    int64_t l = -1, e = -1;
    if (fqn == "tok_embeddings.weight" || hf::MatchTemplate("layers.{L}.attention.wq.weight", fqn, l, e)) return true;
  }
  return false;
}

// params.json beside the weights (lstat: a dangling or escaping symlink is
// present, and its refusal is the answer; read through OpenSourceFile).
std::optional<hf::HfTarget> Config(const hf::HfSource& in, const Arch* forced, std::vector<std::string>& why) {
  struct stat st {};
  if (::lstat((in.config_dir + "/params.json").c_str(), &st) != 0) return std::nullopt;
  auto text = ReadWholeSourceFile(in.config_dir, "params.json", kMaxParamsBytes);
  json params = text.ok() ? json::parse(*text, nullptr, false) : json();
  hf::HfTarget t;
  if (params.is_object() && JsonGet<int64_t>(params, "dim", 0) > 0 && JsonGet<int64_t>(params, "n_heads", 0) > 0) {
    t.arch = forced != nullptr ? forced : hf::ArchByName("llama");
    auto rows = [&](const char* name) -> int64_t {
      auto it = in.params.find(name);
      return it == in.params.end() || in.tensors[it->second].shape.empty() ? 0 : in.tensors[it->second].shape[0];
    };
    t.config =
        MetaParamsConfig(params, *t.arch, rows("tok_embeddings.weight"), rows("layers.0.feed_forward.w1.weight"));
  } else {
    why.push_back(in.config_dir + "/params.json: not a Meta params.json (an object with dim and n_heads)");
  }
  return t;
}

}  // namespace

const hf::HfConvention& MetaHfConvention() {
  static const hf::HfConvention kConvention = [] {
    hf::HfConvention c;
    c.name = "meta";
    c.recognises = &Recognises;
    c.config = &Config;  // after a config.json beside the checkpoint
    return c;
  }();
  return kConvention;
}

}  // namespace ckptfs::formats
