// hf/'s generic planner: options, the target config (--hf-config, what a
// source convention records, a config.json beside the weights), the tensors
// (a convention's rules split into boxes by OpBoxes, or Hugging Face names as
// they are), dtypes, completeness, side files and ERRORS. Every family's
// names and records reach it through the family table's HfConvention hooks
// (ckptfs/hf_names.h); it includes nothing from src/formats/<family>/.
#include "views/hf_export.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_set>

#include "ckptfs/formats.h"
#include "ckptfs/hf_names.h"
#include "common/json_text.h"
#include "formats/byte_reader.h"

namespace ckptfs::hf {
namespace {

std::string JoinNames(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
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
  int64_t layers = 0, heads = 0, kv_heads = 0, head_dim = 0, hidden = 0, vocab = 0, experts = 0;
  bool tied = false, qkv_bias = false, o_bias = false, mlp_bias = false, qk_norm = false;
};

Shape ShapeOf(const json& c, const Arch& a) {
  Shape s;
  const bool gpt2 = a.layout == Layout::kGpt2;  // GPT-2's own key names
  s.layers = JsonGet<int64_t>(c, gpt2 ? "n_layer" : "num_hidden_layers", 0);
  s.heads = JsonGet<int64_t>(c, gpt2 ? "n_head" : "num_attention_heads", 0);
  s.kv_heads = JsonGet<int64_t>(c, "num_key_value_heads", s.heads);
  s.hidden = JsonGet<int64_t>(c, gpt2 ? "n_embd" : "hidden_size", 0);
  s.head_dim = JsonGet<int64_t>(c, "head_dim", s.heads > 0 ? s.hidden / s.heads : 0);
  s.vocab = JsonGet<int64_t>(c, "vocab_size", 0);
  s.experts = a.moe == Moe::kMixtral ? JsonGet<int64_t>(c, "num_local_experts", 0)
              : a.moe == Moe::kQwen3 ? JsonGet<int64_t>(c, "num_experts", 0)
                                     : 0;
  // transformers' default: Gemma 2 ties its embedding, the rest do not.
  s.tied = JsonGet<bool>(c, "tie_word_embeddings", a.layout == Layout::kGemma2);
  const std::string mt = a.model_type;
  if (mt == "llama") {
    s.qkv_bias = s.o_bias = JsonGet<bool>(c, "attention_bias", false);
    s.mlp_bias = JsonGet<bool>(c, "mlp_bias", false);
  } else if (mt == "qwen2") {
    s.qkv_bias = true;
  } else if (mt == "qwen3" || mt == "qwen3_moe") {
    s.qkv_bias = s.o_bias = JsonGet<bool>(c, "attention_bias", false);
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

// File `name` of `dir` when it exists (lstat: a dangling or escaping
// symlink is present, and its refusal is the answer), read whole through
// OpenSourceFile and held to `max_bytes`; nullopt when absent.
std::optional<Result<std::string>> ReadIfPresent(const std::string& dir, const std::string& name, uint64_t max_bytes) {
  struct stat st {};
  if (::lstat((dir + "/" + name).c_str(), &st) != 0) return std::nullopt;
  return formats::ReadWholeSourceFile(dir, name, max_bytes);
}

constexpr uint64_t kMaxConfigBytes = 16u << 20, kMaxSideFileBytes = 64u << 20;

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
  if (op == Op::kFlaxT || op == Op::kFlaxOutT || op == Op::kFlaxRopeQT || op == Op::kFlaxRopeKT) {
    // The kernel as a matrix [in, out]: `out` is that matrix, the caller
    // transposes it.
    if (shape.size() < 2) return Invalid(ShapeStr(shape) + " is not a Flax kernel (at least 2 axes)");
    if (op == Op::kFlaxRopeQT || op == Op::kFlaxRopeKT) {
      const int64_t heads = op == Op::kFlaxRopeQT ? s.heads : s.kv_heads;
      if (shape.size() != 3 || shape[1] != heads || shape[2] != s.head_dim || s.head_dim % 2 != 0) {
        return Invalid(ShapeStr(shape) + " is not [hidden, " + std::to_string(heads) + " heads, an even head_dim " +
                       std::to_string(s.head_dim) + "]");
      }
    }
    const size_t cols_from = op == Op::kFlaxOutT ? shape.size() - 1 : 1;
    int64_t rows = 1, cols = 1;
    for (size_t d = 0; d < shape.size(); ++d) (d < cols_from ? rows : cols) *= shape[d];
    out = {rows, cols};
    return std::vector<Box>{Box{std::vector<int64_t>(shape.size(), 0), shape}};
  }
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
    case Op::kFlaxT:
    case Op::kFlaxOutT:
    case Op::kFlaxRopeQT:
    case Op::kFlaxRopeKT:
      break;
  }
  return Invalid("unknown op");
}

bool IsFlax(Op op) { return op == Op::kFlaxT || op == Op::kFlaxOutT || op == Op::kFlaxRopeQT || op == Op::kFlaxRopeKT; }

// The op a rule's op becomes when the source rotates halves, as transformers
// does: its rotary rows are not permuted.
Op Unpermuted(Op op) {
  switch (op) {
    case Op::kRopeQ:
    case Op::kRopeK:
      return Op::kCopy;
    case Op::kFlaxRopeQT:
    case Op::kFlaxRopeKT:
      return Op::kFlaxT;
    default:
      return op;
  }
}

// How one Hugging Face tensor comes from its source: the op, kExpert's
// expert, the layer of a stacked source (its axis, -1: not stacked), and
// what every element is multiplied by and then added to.
struct Take {
  Op op = Op::kCopy;
  int64_t expert = -1;
  int stack_axis = -1;
  int64_t layer = -1;
  Scale scale = Scale::kOne;
  int add = 0;
};

// --hf-rope: how the source pairs rotary dimensions; its names in
// RopeChoice order.
enum class RopeChoice { kAuto, kInterleaved, kHalves };
constexpr const char* kRopeNames[] = {"auto", "interleaved", "halves"};

Result<RopeChoice> ParseRope(const std::string& s) {
  if (s.empty()) return RopeChoice::kAuto;
  for (size_t i = 0; i < std::size(kRopeNames); ++i) {
    if (s == kRopeNames[i]) return static_cast<RopeChoice>(i);
  }
  return Invalid("--hf-rope '" + s + "': expected one of " + JoinNames(HfRopeNames()));
}

// The registered source conventions, in the family table's order (one on
// several rows counted once).
std::vector<const HfConvention*> Conventions() {
  std::vector<const HfConvention*> v;
  for (const FamilyReader& r : FamilyReaders()) {
    if (r.hf != nullptr && std::find(v.begin(), v.end(), r.hf) == v.end()) v.push_back(r.hf);
  }
  return v;
}

}  // namespace

}  // namespace ckptfs::hf

namespace ckptfs {

std::vector<std::string> HfArchNames() {
  std::vector<std::string> v;
  for (const hf::Arch& a : hf::Archs()) v.push_back(a.name);
  return v;
}

std::vector<std::string> HfDtypeNames() { return {std::begin(hf::kDtypeNames), std::end(hf::kDtypeNames)}; }

std::vector<std::string> HfRopeNames() { return {std::begin(hf::kRopeNames), std::end(hf::kRopeNames)}; }

}  // namespace ckptfs

namespace ckptfs::hf {

namespace {

// config.json and the tokenizer files: beside the weights, or where a
// convention keeps them.
std::string ConfigDir(const Index& index, const std::vector<const HfConvention*>& conventions) {
  for (const HfConvention* c : conventions) {
    std::string dir = c->config_dir != nullptr ? c->config_dir(index.src_dir()) : "";
    if (!dir.empty()) return dir;
  }
  return index.src_dir();
}

// Every entry of `dir` (not below it) but `skip` (an index kept inside the
// checkpoint's directory changes as plans are saved into it) as
// "name mode size mtime ctime ino\n", sorted; "(unreadable errno)" when it
// cannot be listed.
std::string DirSnapshot(const std::string& dir, const std::string& skip) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = fd < 0 ? nullptr : ::fdopendir(fd);
  if (d == nullptr) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    return "(unreadable " + std::to_string(e) + ")\n";
  }
  std::vector<std::string> lines;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    if (n == "." || n == ".." ||
        (skip.size() == dir.size() + 1 + n.size() && skip.starts_with(dir) && skip[dir.size()] == '/' &&
         skip.ends_with(n))) {
      continue;
    }
    struct stat st {};
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      lines.push_back(std::string(n) + " ?\n");
      continue;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, " %o %lld %lld.%09ld %lld.%09ld %llu\n", static_cast<unsigned>(st.st_mode),
                  static_cast<long long>(st.st_size), static_cast<long long>(st.st_mtim.tv_sec), st.st_mtim.tv_nsec,
                  static_cast<long long>(st.st_ctim.tv_sec), st.st_ctim.tv_nsec,
                  static_cast<unsigned long long>(st.st_ino));
    lines.push_back(std::string(n) + buf);
  }
  ::closedir(d);
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const std::string& l : lines) out += l;
  return out;
}

}  // namespace

std::string InputsKey(const Index& index, const TopoOptions& opts) {
  std::string in = "hf-1\narch " + opts.hf_arch + "\nconfig " + opts.hf_config + "\ndtype " + opts.hf_dtype +
                   "\nrope " + opts.hf_rope + "\nshard " + std::to_string(opts.hf_shard_bytes) + "\n";
  std::vector<std::string> dirs = {index.src_dir(), ConfigDir(index, Conventions())};
  if (!opts.hf_config.empty()) {
    const size_t slash = opts.hf_config.rfind('/');
    dirs.push_back(slash == std::string::npos ? "." : opts.hf_config.substr(0, std::max<size_t>(slash, 1)));
  }
  std::sort(dirs.begin(), dirs.end());
  dirs.erase(std::unique(dirs.begin(), dirs.end()), dirs.end());
  for (const std::string& d : dirs) in += "dir " + d + "\n" + DirSnapshot(d, index.dir());
  const XXH128_hash_t h = XXH3_128bits(in.data(), in.size());
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}

Result<HfPlan> PlanHf(const Index& index, const TopoOptions& opts) {
  HfPlan plan;
  ASSIGN_OR_RETURN(DtypeChoice choice, ParseDtype(opts.hf_dtype));
  ASSIGN_OR_RETURN(RopeChoice rope, ParseRope(opts.hf_rope));
  const Arch* forced = nullptr;
  if (!opts.hf_arch.empty()) {
    forced = ArchByName(opts.hf_arch);
    if (forced == nullptr)
      return Invalid("--hf-arch '" + opts.hf_arch + "': expected one of " + JoinNames(HfArchNames()));
  }
  const Sources src = CollectSources(index);
  const std::vector<const HfConvention*> conventions = Conventions();
  const std::string config_dir = ConfigDir(index, conventions);
  const HfSource in{index.info().family, index.tensors(), index.exports(), src.param, config_dir};
  // The convention that names the tensors (none: Hugging Face names, served
  // as they are), and the one whose record of the model gives the target.
  const HfConvention* naming = nullptr;
  const HfConvention* own = nullptr;
  for (const HfConvention* c : conventions) {
    const bool for_names = naming == nullptr && c->rules != nullptr;
    const bool for_config = own == nullptr && c->config != nullptr;
    if (c->recognises == nullptr || !(for_names || for_config) || !c->recognises(in)) continue;
    if (for_names) naming = c;
    if (for_config) own = c;
  }

  // The target config: --hf-config, else what the checkpoint records.
  json config;
  const Arch* arch = nullptr;
  std::vector<std::string> why;
  // The target `own` records, if it records one.
  auto from_own = [&]() {
    std::optional<HfTarget> t = own->config(in, forced, why);
    if (!t) return false;
    arch = t->arch;
    config = std::move(t->config);
    return true;
  };
  std::optional<Result<std::string>> text;
  if (!opts.hf_config.empty()) {
    ASSIGN_OR_RETURN(std::string text, formats::ReadWholeFile(opts.hf_config, kMaxConfigBytes));
    ASSIGN_OR_RETURN(config, ParseConfig(text, opts.hf_config));
    const std::string mt = JsonGet<std::string>(config, "model_type", "");
    arch = forced != nullptr ? forced : ArchByName(mt);
    if (arch == nullptr) why.push_back(opts.hf_config + ": model_type '" + mt + "' is not one ckptfs maps");
  } else if (own != nullptr && own->config_before_config_json && from_own()) {
    // the checkpoint's own record decides
  } else if ((text = ReadIfPresent(config_dir, "config.json", kMaxConfigBytes))) {
    const std::string path = config_dir + "/config.json";
    auto c = text->ok() ? ParseConfig(**text, path) : Result<json>(text->status());
    if (!c.ok()) {
      why.push_back(c.status().message());
    } else {
      config = std::move(*c);
      const std::string mt = JsonGet<std::string>(config, "model_type", "");
      arch = forced != nullptr ? forced : ArchByName(mt);
      if (arch == nullptr && config.contains("architectures")) {
        // An architecture ckptfs has no table for, already under its
        // Hugging Face names: served as they are, with its config.
        const json& classes = config["architectures"];
        plan.architecture =
            classes.is_array() && !classes.empty() && classes[0].is_string() ? classes[0].get<std::string>() : "?";
      }
    }
  } else if (own != nullptr && !own->config_before_config_json && from_own()) {
    // what the checkpoint records beside its weights
  } else if (naming != nullptr && !naming->no_config_why.empty()) {
    why.emplace_back(naming->no_config_why);
  } else {
    why.push_back(
        "the checkpoint records no model architecture (no Megatron args, no config.json beside it); "
        "pass --hf-config FILE (a config.json) and, if needed, --hf-arch NAME");
  }
  // The naming convention's checks of the target against the tensors.
  if (arch != nullptr && naming != nullptr && naming->fits != nullptr && !naming->fits(in, *arch, config, why)) {
    arch = nullptr;
  }
  // Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) are not
  // mapped: every layer is taken to be sparse.
  if (arch != nullptr && arch->moe == Moe::kQwen3) {
    const auto only = config.find("mlp_only_layers");
    const bool mixed = (only != config.end() && only->is_array() && !only->empty()) ||
                       JsonGet<int64_t>(config, "decoder_sparse_step", 1) != 1;
    if (mixed) {
      why.push_back(
          "the config mixes dense and MoE layers (mlp_only_layers, decoder_sparse_step), which hf/ does "
          "not map");
      arch = nullptr;
    }
  }

  // The rules of the source convention for the target architecture, and how
  // its rotary dimensions pair (--hf-rope when the convention cannot tell).
  HfRules rules = arch != nullptr && naming != nullptr ? naming->rules(*arch, config) : HfRules{};
  if (rope != RopeChoice::kAuto) {
    rules.permute_rope = rope == RopeChoice::kInterleaved;
  } else if (!rules.rope_undecided.empty()) {
    why.push_back(rules.rope_undecided + ": pass --hf-rope interleaved or --hf-rope halves");
    arch = nullptr;
  }

  // The tensors: mapped (a convention's names) or as named (Hugging Face names).
  const bool mapped = arch != nullptr && naming != nullptr;
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
  // The names planned so far (views of plan.tensors' names, which never move).
  std::unordered_set<std::string_view> produced;
  produced.reserve(src.param.size());
  auto add = [&](const std::string& hf_name, const std::string& fqn, uint32_t id, const Take& take) {
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
    // A stacked source (its stack checked by the caller): the op applies to
    // the layer's slice, and each box is lifted back into the stack.
    // A padded vocabulary's true rows, as params/ serves it.
    std::vector<int64_t> sliced = t.VocabShape();
    const auto axis = static_cast<size_t>(std::max(take.stack_axis, 0));
    if (take.stack_axis >= 0) sliced.erase(sliced.begin() + static_cast<std::ptrdiff_t>(axis));
    auto boxes = OpBoxes(take.op, sliced, shape, h.shape, take.expert);
    if (!boxes.ok()) {
      plan.errors.push_back("hf/: '" + hf_name + "' is not included: cannot split '" + fqn +
                            "': " + boxes.status().message());
      plan.not_included.push_back(fqn);
      return;
    }
    h.pieces = std::move(*boxes);
    if (take.stack_axis >= 0) {
      for (Box& b : h.pieces) {
        b.offsets.insert(b.offsets.begin() + static_cast<std::ptrdiff_t>(axis), take.layer);
        b.lengths.insert(b.lengths.begin() + static_cast<std::ptrdiff_t>(axis), 1);
      }
    }
    if (take.scale != Scale::kOne || take.add != 0) {  // rendered through float32: the source must widen to it
      const bool floats = h.out == DType::kF32 || h.out == DType::kBF16 || h.out == DType::kF16;
      const int64_t by = take.scale == Scale::kSqrtHeadDim ? shape.head_dim : shape.hidden;
      if (!Renders(t.dtype, DType::kF32) || !floats || (take.scale != Scale::kOne && by <= 0)) {
        plan.errors.push_back("hf/: '" + hf_name + "' is not included: '" + fqn +
                              "' is scaled or offset, which ckptfs does only for floats rendered as "
                              "float32, bfloat16 or float16 (and a positive head_dim / hidden_size)");
        plan.not_included.push_back(fqn);
        return;
      }
      if (take.scale == Scale::kSqrtHeadDim) h.scale = std::sqrt(static_cast<double>(by));
      if (take.scale == Scale::kInvSqrtHidden) h.scale = 1.0 / std::sqrt(static_cast<double>(by));
      h.add = take.add;
    }
    if (IsFlax(take.op)) {  // [in, out] as a Linear weight [out, in]: the columns are the output axes
      h.shape = {h.shape[1], h.shape[0]};
      h.transposed = true;
      h.how.col_axes = static_cast<uint32_t>(take.op == Op::kFlaxOutT ? 1 : sliced.size() - 1);
      if (take.op == Op::kFlaxRopeQT || take.op == Op::kFlaxRopeKT) {
        h.how.rope_group = static_cast<uint32_t>(shape.head_dim);
      }
    } else if (take.op == Op::kT || take.op == Op::kQkvT) {  // the pieces' rows, transposed
      if (h.shape.size() != 2) {
        plan.errors.push_back("hf/: '" + hf_name + "' is not included: '" + fqn + "' is not 2-D (" + ShapeStr(t.shape) +
                              "), so it has no Conv1D transpose");
        plan.not_included.push_back(fqn);
        return;
      }
      h.shape = {h.shape[1], h.shape[0]};
      h.transposed = true;
    }
    if (produced.count(hf_name) != 0) {
      plan.errors.push_back("hf/: '" + hf_name + "' would come from two source tensors; the second, '" + fqn +
                            "', is left out");
      plan.not_included.push_back(fqn);
      return;
    }
    produced.insert(plan.tensors.emplace_back(std::move(h)).name);
  };

  for (const auto& [key, id] : src.param) {
    const std::string& fqn = index.tensors()[id].fqn;
    if (!mapped) {
      add(fqn, fqn, id, Take{});
      continue;
    }
    const std::string name = naming->normalize != nullptr ? naming->normalize(fqn) : fqn;
    bool any = false, skipped = false, tied = false;
    for (const MapRule* r : rules.rules) {
      int64_t layer = -1, expert = -1;
      if (!MatchTemplate(r->src, name, layer, expert)) continue;
      if (!Holds(r->when, shape)) {
        (r->when == When::kUntied ? tied : skipped) = true;
        continue;
      }
      any = true;
      const Take take{rules.permute_rope ? r->op : Unpermuted(r->op), -1, r->stack_axis, -1, r->scale, r->add};
      // The dst layer of source layer l.
      auto dst_layer = [&](int64_t l) { return l < 0 ? l : l * r->layer_stride + r->layer_offset; };
      if (r->stack_axis >= 0) {
        // A stack of every layer (MaxText's scanned layers): one tensor gives
        // each layer's dst, the config's layer count checked against the
        // stack's axis before looping over it.
        const std::vector<int64_t>& sh = index.tensors()[id].shape;
        const auto axis = static_cast<size_t>(r->stack_axis);
        const int64_t stride = std::max<int64_t>(r->layer_stride, 1), count = shape.layers / stride;
        if (sh.size() <= axis || shape.layers % stride != 0 || sh[axis] != count || shape.layers > bound) {
          plan.not_included.push_back(fqn);
          plan.errors.push_back("hf/: '" + fqn + "' is not included: its shape " + ShapeStr(sh) +
                                " does not stack the config's " + std::to_string(shape.layers) + " layers" +
                                (stride > 1 ? " (" + std::to_string(stride) + " per source layer)" : "") + " on axis " +
                                std::to_string(r->stack_axis));
          continue;
        }
        for (int64_t l = 0; l < count; ++l) {
          Take at = take;
          at.layer = l;
          add(Expand(r->dst, dst_layer(l), expert), fqn, id, at);
        }
        continue;
      }
      if (r->op != Op::kExpert) {
        add(Expand(r->dst, dst_layer(layer), expert), fqn, id, take);
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
      for (int64_t e = 0; e < shape.experts; ++e) {
        Take at = take;
        at.expert = e;
        add(Expand(r->dst, layer, e), fqn, id, at);
      }
    }
    if (!any && tied && !skipped) {
      // An output head the config ties to the embedding (a source that
      // saves both): transformers uses the embedding, as the source did.
      plan.not_included.push_back(fqn);
    } else if (!any) {
      std::string why_not = skipped ? std::string("the config has no such tensor (") + arch->cls + ", no bias)"
                                    : std::string("no ") + arch->cls + " tensor is mapped from it";
      for (const HfConvention* c : conventions) {  // a reason some convention knows
        const char* reason = c->unmapped_why != nullptr ? c->unmapped_why(name) : nullptr;
        if (reason != nullptr) {
          why_not = reason;
          break;
        }
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
    std::vector<std::string> missing;  // reported in name order, once each
    for (const ArchTensor& t : ArchTensors(*arch)) {
      if (!Holds(t.when, shape)) continue;
      const std::string_view dst_tmpl = t.name;
      const bool per_layer = dst_tmpl.find("{L}") != std::string_view::npos;
      const bool per_expert = dst_tmpl.find("{E}") != std::string_view::npos;
      for (int64_t l = 0; l < (per_layer ? shape.layers : 1); ++l) {
        for (int64_t e = 0; e < (per_expert ? shape.experts : 1); ++e) {
          std::string name = Expand(t.name, l, e);
          if (produced.count(name) == 0) missing.push_back(std::move(name));
        }
      }
    }
    std::sort(missing.begin(), missing.end());
    missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    for (const std::string& e : missing) {
      plan.errors.push_back("hf/: '" + e +
                            "' is missing: no source tensor provides it, so transformers would "
                            "initialise it at random");
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
