// hf/'s shared vocabulary: the target architectures and the Hugging Face
// tensors each has, the rules mapping a source name template onto one, and
// HfConvention, the hooks through which a family's naming (its tables, its
// renames, its own record of the model) reaches the generic planner
// (src/views/hf_export.cc) without the views knowing any family: each family
// registers its convention in the family table (formats.h FamilyReader::hf).
#ifndef CKPTFS_HF_NAMES_H_
#define CKPTFS_HF_NAMES_H_

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ckptfs/family.h"
#include "ckptfs/model.h"

namespace ckptfs::hf {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------
// Target architectures (--hf-arch) and what each has.

// The tensor layout family of an architecture: the Llama family (split q, k,
// v and gate, up), GPT-NeoX, GPT-2, Gemma 2 (Llama's plus pre- and
// post-feedforward norms, tied embeddings).
enum class Layout : uint8_t { kLlama, kNeox, kGpt2, kGemma2 };

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
// Every architecture, in --hf-arch's order.
const std::vector<Arch>& Archs();
// By --hf-arch name, model_type or class; nullptr if none.
const Arch* ArchByName(std::string_view name);

// When a tensor exists, by the target config (see the planner's Shape).
enum class When : uint8_t { kAlways, kUntied, kQkvBias, kOBias, kMlpBias, kQkNorm };

// A Hugging Face tensor of an architecture: {L} a layer number, {E} an expert.
struct ArchTensor {
  const char* name;
  When when;
};
// The tensors `a` has under the conditions they hold in; the planner checks
// that a mapped checkpoint provides every one.
std::vector<ArchTensor> ArchTensors(const Arch& a);

// ---------------------------------------------------------------------------
// Name mapping: a source template -> a Hugging Face template. {L} is a layer
// number, {E} an expert number. A rule applies when its condition holds for
// the target config; a rule's dst names a tensor the target must have
// (several rules may produce the same dst from alternative source names).

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
  // Grouped experts [E, out, in]: expert E's [out, in] slice (one source
  // tensor gives every {E} of the rule's dst).
  kExpert,
  // A Flax kernel (stored [in..., out...]) as a Linear weight [out, in]:
  // kFlaxT takes axis 0 as the input (MaxText's q/k/v [emb, heads, head_dim],
  // wi [emb, mlp]), kFlaxOutT the last axis as the output (out [heads,
  // head_dim, emb], wo [mlp, emb]); the rest flattened in C order. One piece
  // per output row, so nothing is transposed when read. kFlaxRopeQT /
  // kFlaxRopeKT: kFlaxT whose last axis is a query / key-value head's
  // dimensions, rotated in interleaved pairs (MaxText's LLaMARotaryEmbedding):
  // each head's rows in the order 0, 2, .., hd-2, 1, 3, .., hd-1, as kRopeQ.
  kFlaxT,
  kFlaxOutT,
  kFlaxRopeQT,
  kFlaxRopeKT,
};

// A factor every element of a tensor is multiplied by.
enum class Scale : uint8_t {
  kOne,
  // sqrt(head_dim): MaxText folds 1/sqrt(head_dim) into its query kernel and
  // never scales QK^T; transformers scales QK^T at run time.
  kSqrtHeadDim,
  // 1/sqrt(hidden_size): MaxText's Gemma divides its tied logits by
  // sqrt(emb_dim) and never scales the input embedding; transformers' Gemma
  // multiplies the input embedding by sqrt(hidden_size).
  kInvSqrtHidden,
};

struct MapRule {
  const char* src;
  const char* dst;
  Op op;
  When when;
  // >= 0: the source stacks every layer on this axis (MaxText's scanned
  // layers: 1), and one source tensor gives each {L} of dst; src then has no
  // {L}. The op applies to the layer's slice.
  int8_t stack_axis = -1;
  Scale scale = Scale::kOne;
  // Then added to every element (Gemma's RMSNorm multiplies by 1 + weight,
  // MaxText's by its scale: -1).
  int8_t add = 0;
  // The dst layer of source layer l is l * layer_stride + layer_offset (a
  // MaxText Gemma 2 layer is a local and a global block: Hugging Face layers
  // 2l and 2l + 1).
  uint8_t layer_stride = 1, layer_offset = 0;
};

// Matches `name` against a template with {L} / {E} (decimal numbers, no
// leading zeros), setting `layer` / `expert` to the numbers found.
bool MatchTemplate(std::string_view tmpl, std::string_view name, int64_t& layer, int64_t& expert);
// The template with {L} / {E} replaced.
std::string Expand(std::string_view tmpl, int64_t layer, int64_t expert);

// ---------------------------------------------------------------------------
// Config helpers shared by the planner and the conventions' config hooks.

// `j[key]` when present and of T's JSON type, else `def`.
template <typename T>
T JsonGet(const json& j, const char* key, T def) {
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

// RoPE in both transformers spellings: rope_theta (4.x) and rope_parameters
// (5.x); with `llama3_factor`, Llama 3.1's frequency scaling (the constants
// mcore's apply_rope_scaling and llama-models' apply_scaling share) as
// rope_scaling too.
void SetRope(json& c, double theta, std::optional<double> llama3_factor);

// ---------------------------------------------------------------------------
// Source conventions.

// What a convention's hooks read: the index's plain data (the formats layer
// knows no Index).
struct HfSource {
  Family family = Family::kUnknown;
  const std::vector<TensorRecord>& tensors;
  const std::vector<ExportFile>& exports;  // what the reader exported (Megatron: args.json)
  // The parameter records (the "param" state) by FQN: indices into tensors.
  const std::map<std::string_view, uint32_t>& params;
  // Where config.json and the tokenizer's files are looked for (the
  // checkpoint directory, or where a convention's config_dir points).
  const std::string& config_dir;
};

// The target a convention reads from the checkpoint itself.
struct HfTarget {
  const Arch* arch = nullptr;  // nullptr: none fits, and the hook said why
  json config;                 // config.json (without its dtype)
};

// A convention's rules for one target architecture, in the order tried.
struct HfRules {
  std::vector<const MapRule*> rules;
  // kRopeQ / kRopeK / kFlaxRope*: the source rotates interleaved pairs (Meta's
  // convention), so rows are permuted; false: it rotates halves, as
  // transformers does (kRope* copied, kFlaxRope* as kFlaxT).
  bool permute_rope = true;
  // Non-empty: which pairing the source used is not recorded, and why; hf/
  // needs --hf-rope then.
  std::string rope_undecided;
};

// A source naming convention (a family's, or one a family's checkpoints may
// use) for hf/. Every hook may be null. The planner asks the registered
// conventions in the family table's order: the first that recognises a
// checkpoint and has `rules` names its tensors (none: Hugging Face names,
// served as they are); the first that recognises it and has `config` gives
// its config when --hf-config is absent; `config_dir` and `unmapped_why` are
// asked of every convention, for every checkpoint.
struct HfConvention {
  std::string_view name;  // "megatron", "torchtitan"
  // Whether the checkpoint follows this convention (from its family's traits
  // or its parameter names).
  bool (*recognises)(const HfSource& in) = nullptr;
  // A source name rewritten before the rules match it (Megatron's legacy
  // names to mcore's).
  std::string (*normalize)(std::string name) = nullptr;
  // The rules mapping this convention's names onto `arch`'s, under the
  // target `config`.
  HfRules (*rules)(const Arch& arch, const json& config) = nullptr;
  // Checks of a target (from any config) against the checkpoint; false with
  // lines in `why` when it does not fit.
  bool (*fits)(const HfSource& in, const Arch& arch, const json& config, std::vector<std::string>& why) = nullptr;
  // The target the checkpoint records, `forced` the --hf-arch choice (may be
  // null). nullopt: the checkpoint holds nothing this hook reads.
  std::optional<HfTarget> (*config)(const HfSource& in, const Arch* forced, std::vector<std::string>& why) = nullptr;
  // Whether `config` decides before a config.json beside the checkpoint
  // (Megatron's args do; Meta's params.json is read only without one).
  bool config_before_config_json = false;
  // Why no target exists when neither `config` nor a config.json found one
  // (empty: the planner's generic reason).
  std::string_view no_config_why;
  // Where a checkpoint directory `src` keeps its config.json and tokenizer
  // when not beside the weights (verl: huggingface/); empty: not here.
  std::string (*config_dir)(const std::string& src) = nullptr;
  // Why a source tensor (normalized name) has no Hugging Face place; nullptr:
  // no reason known.
  const char* (*unmapped_why)(std::string_view name) = nullptr;
};

}  // namespace ckptfs::hf

#endif  // CKPTFS_HF_NAMES_H_
