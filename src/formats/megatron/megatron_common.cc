#include "formats/megatron/megatron_common.h"

#include <dirent.h>
#include <re2/re2.h>
#include <sys/stat.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <map>

#include "formats/byte_reader.h"
#include "formats/param_groups.h"
#include "formats/pickle_writer.h"

namespace ckptfs::formats::megatron {
namespace {

bool Exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

std::string JsonStr(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

// `name` with the index after the first "<component>." component (preceded by
// a dot or the start) moved by `offset`; unchanged (index -1) when absent or
// longer than `max_digits`.
std::string RenumberComponent(const std::string& name, const RE2& re, const char* component, size_t max_digits,
                              int64_t offset, int64_t* index) {
  *index = -1;
  re2::StringPiece m[3];
  if (!re.Match(name, 0, name.size(), RE2::UNANCHORED, m, 3)) return name;
  if (m[2].size() > max_digits) return name;  // not an index a model has
  *index = std::stoll(std::string(m[2].data(), m[2].size())) + offset;
  const size_t begin = m[0].data() - name.data(), end = begin + m[0].size();
  return name.substr(0, begin) + std::string(m[1].data(), m[1].size()) + component + "." + std::to_string(*index) +
         "." + name.substr(end);
}

}  // namespace

bool HasTracker(const std::string& dir) { return Exists(dir + "/latest_checkpointed_iteration.txt"); }

namespace {

bool IsNemo2Checkpoint(const std::string& dir) { return Exists(dir + "/weights/metadata.json"); }

// NeMo 2 (nemo.lightning): <log_dir>/checkpoints/<name>/{weights/, context/},
// <name> from ModelCheckpoint's pattern (...-step=<N>-...), "-last" on the
// save_last copy, "-end" on the final one, and a "<name>-unfinished" marker
// file beside a save in progress. nullopt: `dir` is neither a checkpoint nor a
// directory of them. Of several, the one AutoResume resumes from
// (nemo/lightning/resume.py): a finished *end, else the newest finished *last;
// without either, the highest step=<N>.
std::optional<Result<IterDir>> FindNemo2(const std::string& dir) {
  static const RE2 kStep(R"((?:^|-)step=(\d{1,15})(?:-|$))");
  IterDir it;
  if (IsNemo2Checkpoint(dir)) {
    it.rel = "weights";
    it.path = dir + "/weights";
    std::string base = dir;
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    base = base.substr(base.rfind('/') + 1);  // npos + 1 == 0
    RE2::PartialMatch(base, kStep, &it.step);
    it.wrapper = "NeMo 2 checkpoint '" + base + "'";
    return it;
  }
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return std::nullopt;
  struct Candidate {
    std::string name;
    int rank = 0;  // 2: *end, 1: *last, 0: other
    int64_t mtime_ns = 0, step = -1;
  };
  std::vector<Candidate> found;
  std::vector<std::string> unfinished;
  size_t entries = 0;
  while (dirent* e = ::readdir(d)) {
    if (++entries > 100000) break;  // a directory of checkpoints, not of everything
    const std::string name = e->d_name;
    if (name == "." || name == ".." || !IsNemo2Checkpoint(dir + "/" + name)) continue;
    if (Exists(dir + "/" + name + "-unfinished")) {
      unfinished.push_back(name);
      continue;
    }
    Candidate c;
    c.name = name;
    c.rank = EndsWith(name, "end") ? 2 : EndsWith(name, "last") ? 1 : 0;
    struct stat st {};
    if (::lstat((dir + "/" + name).c_str(), &st) == 0)
      c.mtime_ns = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    RE2::PartialMatch(name, kStep, &c.step);
    found.push_back(std::move(c));
  }
  ::closedir(d);
  if (found.empty()) {
    if (unfinished.empty()) return std::nullopt;
    return Result<IterDir>(NotFound("cannot read " + dir + ": its only NeMo 2 checkpoint" +
                                    (unfinished.size() > 1 ? "s ('" + unfinished.front() + "' and " +
                                                                 std::to_string(unfinished.size() - 1) + " more) are"
                                                           : " '" + unfinished.front() + "' is") +
                                    " unfinished (a '-unfinished' marker beside it: the save did not complete)"));
  }
  // The best: highest rank, then (NeMo's tie-break for *last) newest, then highest step, then name.
  const Candidate& best = *std::max_element(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    if (a.rank > 0 && a.mtime_ns != b.mtime_ns) return a.mtime_ns < b.mtime_ns;
    if (a.step != b.step) return a.step < b.step;
    return a.name < b.name;
  });
  if (best.rank == 0 && best.step < 0 && found.size() > 1) {
    return Result<IterDir>(Invalid("cannot choose among the " + std::to_string(found.size()) +
                                   " NeMo 2 checkpoints in " + dir + " ('" + found.front().name +
                                   "', ...): none ends in -last or -end and their names carry no step=<N>; mount one"));
  }
  it.rel = best.name + "/weights";
  it.path = dir + "/" + it.rel;
  it.step = best.step;
  it.wrapper = "NeMo 2 checkpoint '" + best.name + "' (of " + std::to_string(found.size()) + " in this directory" +
               (unfinished.empty() ? "" : ", " + std::to_string(unfinished.size()) + " unfinished skipped") + ")";
  return it;
}

}  // namespace

bool IsNemo2Root(const std::string& dir) { return FindNemo2(dir).has_value(); }

Result<IterDir> FindIterDir(const std::string& dir) {
  IterDir it;
  static const RE2 kIter(R"((?:^|/)iter_(\d+)/?$)");
  if (!HasTracker(dir) && !Exists(dir + "/metadata.json")) {
    if (auto nemo = FindNemo2(dir)) return *std::move(nemo);
  }
  if (!HasTracker(dir)) {
    it.path = dir;
    int64_t step = -1;
    if (RE2::PartialMatch(dir, kIter, &step)) it.step = step;
    return it;
  }
  const std::string tracker = dir + "/latest_checkpointed_iteration.txt";
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(tracker, 4096));
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text == "release") {
    it.rel = "release";
  } else {
    static const RE2 kNum(R"(\d{1,12})");
    if (!RE2::FullMatch(text, kNum)) {
      return Invalid("cannot parse " + tracker + ": '" + text.substr(0, 40) +
                     "' is neither an iteration nor 'release'");
    }
    it.step = std::stoll(text);
    char buf[32];
    std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(it.step));
    it.rel = buf;
  }
  it.path = dir + "/" + it.rel;
  if (!Exists(it.path)) {
    return NotFound("cannot open " + it.path + ": " + tracker +
                    " names it, but it does not exist (an interrupted save?)");
  }
  return it;
}

std::optional<Rule> SplitRule(const std::string& name, bool swiglu) {
  Rule r;
  const bool bias = EndsWith(name, ".bias");
  if (Contains(name, "layernorm") || Contains(name, "layer_norm") || Contains(name, "norm.") ||
      Contains(name, "position_embeddings")) {
    r.kind = Merge::kReplicated;
    return r;
  }
  if (Contains(name, ".mlp.router.")) {  // MoE router (weight, expert_bias): every TP rank holds all of it
    r.kind = Merge::kReplicated;
    return r;
  }
  for (const char* row :
       {".linear_proj.", ".self_attention.dense.", ".attention.dense.", ".linear_fc2.", ".dense_4h_to_h."}) {
    if (Contains(name, row)) {
      if (bias) {
        r.kind = Merge::kReplicated;
      } else {
        r.cat_dim = 1;
      }
      return r;
    }
  }
  for (const char* fc1 : {".linear_fc1.", ".dense_h_to_4h."}) {
    if (Contains(name, fc1)) {
      if (swiglu) r.kind = Merge::kSub2;
      return r;
    }
  }
  for (const char* col : {".linear_qkv.", ".query_key_value.", ".linear_q.", ".linear_kv."}) {
    if (Contains(name, col)) return r;
  }
  if (Contains(name, "word_embeddings") || EndsWith(name, "output_layer.weight") ||
      Contains(name, "word_embeddings_for_head")) {
    r.vocab = true;
    return r;
  }
  return std::nullopt;
}

ModelFacts FactsOf(const PyValue* args) {
  ModelFacts f;
  f.swiglu = ArgBool(args, "swiglu").value_or(false);
  f.qkv_groups = ArgInt(args, "num_attention_heads").value_or(0);
  if (ArgBool(args, "group_query_attention").value_or(false)) {
    f.qkv_groups = ArgInt(args, "num_query_groups").value_or(f.qkv_groups);
  }
  f.tp = ArgInt(args, "tensor_model_parallel_size").value_or(-1);
  f.dp = ArgInt(args, "data_parallel_size").value_or(-1);
  f.pp = ArgInt(args, "pipeline_model_parallel_size").value_or(1);
  f.vp = ArgInt(args, "virtual_pipeline_model_parallel_size").value_or(1);  // None: absent
  f.num_layers = ArgInt(args, "num_layers").value_or(-1);
  f.first_stage_layers = ArgInt(args, "decoder_first_pipeline_num_layers").value_or(-1);
  f.last_stage_layers = ArgInt(args, "decoder_last_pipeline_num_layers").value_or(-1);
  f.local_impl = ArgStr(args, "transformer_impl").value_or("") == "local";
  f.overlap_grad_reduce = ArgBool(args, "overlap_grad_reduce").value_or(false);
  f.ddp_bucket_size = ArgInt(args, "ddp_bucket_size").value_or(-1);
  f.tied = args != nullptr && !ArgBool(args, "untie_embeddings_and_output_weights").value_or(false);
  f.num_experts = ArgInt(args, "num_experts").value_or(0);
  f.ep = ArgInt(args, "expert_model_parallel_size").value_or(1);
  f.vocab = ArgInt(args, "vocab_size").value_or(-1);
  return f;
}

void SetSplits(const ModelFacts& facts, Checkpoint& ck) {
  for (TensorRecord& t : ck.tensors) {
    if (t.role != Role::kParam && t.role != Role::kOptimState) continue;
    auto rule = SplitRule(t.fqn, facts.swiglu);
    if (!rule) continue;
    t.split = SplitOf(*rule);
    t.split.pad_rows = false;  // Megatron saves the padded vocabulary
    t.vocab_rows = VocabRows(*rule, facts.vocab, t.shape);
    if (t.split.kind == SplitKind::kDim && (Contains(t.fqn, ".linear_qkv.") || Contains(t.fqn, ".query_key_value."))) {
      t.split.groups = facts.qkv_groups;
    }
  }
}

std::string RenumberLayer(const std::string& name, int64_t offset, int64_t* index) {
  static const RE2 kLayer(R"((^|\.)layers\.(\d+)\.)", RE2::Latin1);
  return RenumberComponent(name, kLayer, "layers", 15, offset, index);
}

std::string RenumberExpert(const std::string& name, int64_t offset, int64_t* index) {
  static const RE2 kExpert(R"((^|\.)local_experts\.(\d+)\.)", RE2::Latin1);
  return RenumberComponent(name, kExpert, "local_experts", 9, offset, index);
}

Result<int64_t> LayersPerChunk(const PipelineShape& s, int pp) {
  if (s.num_layers < 0) return Invalid("args has no num_layers");
  const bool first = s.first_stage_layers >= 0, last = s.last_stage_layers >= 0;
  if (!first && !last) {
    if (s.num_layers % (static_cast<int64_t>(s.pp) * s.vp) != 0) {
      return Invalid("num_layers " + std::to_string(s.num_layers) + " is not divisible by PP " + std::to_string(s.pp) +
                     " x virtual stages " + std::to_string(s.vp));
    }
    return s.num_layers / s.pp / s.vp;
  }
  if (s.vp > 1) return Unsupported("uneven first/last pipeline stages with virtual pipeline chunks");
  if (first && pp == 0) return s.first_stage_layers;
  if (last && pp == s.pp - 1) return s.last_stage_layers;
  const int64_t middle_stages = s.pp - (first ? 1 : 0) - (last ? 1 : 0);
  const int64_t middle_layers =
      s.num_layers - std::max<int64_t>(s.first_stage_layers, 0) - std::max<int64_t>(s.last_stage_layers, 0);
  if (middle_stages <= 0 || middle_layers < 0 || middle_layers % middle_stages != 0) {
    return Invalid("uneven pipeline stages do not divide num_layers " + std::to_string(s.num_layers));
  }
  return middle_layers / middle_stages;
}

Result<int64_t> LayerOffset(const PipelineShape& s, int pp, int vp) {
  ASSIGN_OR_RETURN(int64_t per_chunk, LayersPerChunk(s, pp));
  const bool first = s.first_stage_layers >= 0, last = s.last_stage_layers >= 0;
  if (!first && !last) {
    // Chunk v of every stage comes before chunk v+1 of any stage.
    return static_cast<int64_t>(vp) * (s.num_layers / s.vp) + static_cast<int64_t>(pp) * per_chunk;
  }
  if (first && pp == 0) return 0;
  const int64_t middle_rank = pp - (first ? 1 : 0);
  ASSIGN_OR_RETURN(int64_t per_middle, LayersPerChunk(s, first ? 1 : 0));
  if (last && pp == s.pp - 1) {
    return std::max<int64_t>(s.first_stage_layers, 0) + (s.pp - (first ? 1 : 0) - 1) * per_middle;
  }
  return std::max<int64_t>(s.first_stage_layers, 0) + middle_rank * per_middle;
}

std::optional<int64_t> ArgInt(const PyValue* args, const std::string& name) {
  if (args == nullptr) return std::nullopt;
  const PyValue* v = args->kind == PyKind::kDict ? args->Get(name) : args->Attr(name);
  if (v == nullptr || (v->kind != PyKind::kInt && v->kind != PyKind::kBool)) return std::nullopt;
  return v->kind == PyKind::kBool ? static_cast<int64_t>(v->b) : v->i;
}

std::optional<bool> ArgBool(const PyValue* args, const std::string& name) {
  auto v = ArgInt(args, name);
  if (!v.has_value()) return std::nullopt;
  return *v != 0;
}

std::optional<std::string> ArgStr(const PyValue* args, const std::string& name) {
  if (args == nullptr) return std::nullopt;
  const PyValue* v = args->kind == PyKind::kDict ? args->Get(name) : args->Attr(name);
  if (v == nullptr || v->kind != PyKind::kStr) return std::nullopt;
  return v->s;
}

std::string ToJson(const PyValue* v, int indent) {
  if (v == nullptr || v->depth > 64) return "null";
  const std::string pad(static_cast<size_t>(indent + 2), ' '), end_pad(static_cast<size_t>(indent), ' ');
  switch (v->kind) {
    case PyKind::kNone:
      return "null";
    case PyKind::kBool:
      return v->b ? "true" : "false";
    case PyKind::kInt:
      return std::to_string(v->i);
    case PyKind::kFloat: {
      if (!std::isfinite(v->f)) return JsonStr(std::isnan(v->f) ? "nan" : v->f > 0 ? "inf" : "-inf");
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.17g", v->f);
      return buf;
    }
    case PyKind::kStr:
      return JsonStr(v->s);
    case PyKind::kTuple:
    case PyKind::kList:
    case PyKind::kSet: {
      std::string o = "[";
      for (size_t i = 0; i < v->items.size(); ++i) o += (i ? ", " : "") + ToJson(v->items[i], indent);
      return o + "]";
    }
    case PyKind::kDict: {
      if (v->dict.empty()) return "{}";
      std::string o = "{\n";
      for (size_t i = 0; i < v->dict.size(); ++i) {
        const auto& [k, x] = v->dict[i];
        const std::string key = k->IsStr() ? k->s : ToJson(k, 0);
        o += pad + JsonStr(key) + ": " + ToJson(x, indent + 2) + (i + 1 < v->dict.size() ? ",\n" : "\n");
      }
      return o + end_pad + "}";
    }
    case PyKind::kGlobal:
      return JsonStr(v->s + "." + v->name());
    case PyKind::kObject:
      if (v->state != nullptr && v->state->kind == PyKind::kDict && v->ClassName() == "Namespace") {
        return ToJson(v->state, indent);
      }
      return JsonStr(std::string(v->ClassName()));
    default:
      return JsonStr("<" + std::string(v->kind == PyKind::kTensor ? "tensor" : "bytes") + ">");
  }
}

namespace {

// The optimizer entry of common.pt in the fully_reshardable layout, from the
// source's optimizer state dict (a distributed optimizer's: param groups with
// their step; the Adam tensors are served as sharded keys).
Status WriteReshardableOptimizer(const PyValue& opt, const PerDpRankGroups& per_dp_rank, PickleWriter& w,
                                 int depth = 0) {
  // A chained optimizer (MoE: the dense and the expert optimizer): common.pt
  // keeps {index: member's state}.
  ASSIGN_OR_RETURN(const std::vector<const PyValue*> members, ChainedMembers(opt));
  if (!members.empty()) {
    if (depth > 0) return Unsupported("a chained optimizer inside a chained optimizer");
    if (!per_dp_rank.empty() && per_dp_rank.members.size() != members.size()) {
      return Unsupported("the per-DP-rank objects keep param groups for " + std::to_string(per_dp_rank.members.size()) +
                         " chained optimizer(s), common.pt names " + std::to_string(members.size()));
    }
    w.BeginDict();
    for (size_t i = 0; i < members.size(); ++i) {
      w.Int(static_cast<int64_t>(i));
      PerDpRankGroups own;  // member i's groups: chained_<i>.'s objects
      if (!per_dp_rank.empty()) own.single = per_dp_rank.members[i];
      RETURN_IF_ERROR(WriteReshardableOptimizer(*members[i], own, w, depth + 1));
    }
    w.EndDict();
    return Status::Ok();
  }
  if (!per_dp_rank.members.empty()) {
    return Unsupported("the per-DP-rank objects are a chained optimizer's, common.pt's optimizer is not");
  }
  const std::string& groups_ops = per_dp_rank.single;
  if (opt.kind != PyKind::kDict) return Unsupported("the optimizer's state is not a dict");
  // A distributed or mixed-precision optimizer's {optimizer: {param_groups}},
  // or a plain one's own state dict.
  const PyValue* inner = opt.Get("optimizer") != nullptr ? opt.Get("optimizer") : &opt;
  const PyValue* groups = inner->Get("param_groups");
  if (groups == nullptr && !groups_ops.empty()) {  // read from the per-DP-rank objects
    w.BeginDict();
    w.Str("optimizer");
    w.BeginDict();
    w.Str("param_groups");
    w.Raw(groups_ops);
    w.EndDict();
    w.Str("param_state_sharding_type");
    w.Str("fully_reshardable");
    w.EndDict();
    return Status::Ok();
  }
  if (groups == nullptr || !groups->IsSeq() || groups->items.empty()) {
    return Unsupported("the optimizer's param groups are not in its common state (" +
                       std::string(opt.Get("param_state_sharding_type") != nullptr
                                       ? "its distributed-optimizer layout keeps them per DP rank"
                                       : "no optimizer.param_groups") +
                       ")");
  }
  for (const PyValue* g : groups->items) {
    if (g == nullptr || g->kind != PyKind::kDict || g->Get("step") == nullptr) {
      return Unsupported("a param group records no step (not Megatron's distributed optimizer)");
    }
  }
  auto no_tensor = [](PickleWriter&, const PyValue&) {
    return Unsupported("the optimizer's common state holds a tensor");
  };
  w.BeginDict();
  w.Str("optimizer");
  w.BeginDict();
  w.Str("param_groups");
  RETURN_IF_ERROR(w.Value(*groups, no_tensor));
  w.EndDict();
  for (const auto& [k, v] : opt.dict) {
    if (!k->IsStr() || k->s == "optimizer" || k->s == "param_state" || k->s == "param_state_sharding_type" ||
        k->s == "fp32_from_fp16_params") {
      continue;
    }
    w.Str(k->s);
    RETURN_IF_ERROR(w.Value(*v, no_tensor));
  }
  w.Str("param_state_sharding_type");
  w.Str("fully_reshardable");
  w.EndDict();
  return Status::Ok();
}

}  // namespace

const PyValue* CommonOptimizer(const PyValue* root) {
  const PyValue* opt = root != nullptr && root->kind == PyKind::kDict ? root->Get("optimizer") : nullptr;
  if (opt == nullptr || opt->kind == PyKind::kNone) return nullptr;
  return opt->IsSeq() && opt->items.size() == 1 && opt->items[0] != nullptr ? opt->items[0] : opt;
}

Result<std::vector<const PyValue*>> ChainedMembers(const PyValue& opt) {
  std::vector<const PyValue*> members;
  if (opt.IsSeq()) {
    members.assign(opt.items.begin(), opt.items.end());
  } else if (opt.kind == PyKind::kDict && !opt.dict.empty()) {
    std::map<int64_t, const PyValue*> by_index;
    size_t by_name = 0;  // keys chained_<i>, the others ints
    for (const auto& [k, v] : opt.dict) {
      int64_t i = -1;
      if (k->kind == PyKind::kInt) {
        i = k->i;
      } else if (k->IsStr() && k->s.starts_with("chained_") && std::sscanf(k->s.c_str(), "chained_%" SCNd64, &i) == 1) {
        ++by_name;
      } else {
        return members;  // one optimizer's state dict
      }
      if (i < 0 || !by_index.emplace(i, v).second) {
        return Invalid("a chained optimizer's members are not numbered 0, 1, ...");
      }
    }
    if (by_name != 0 && by_name != opt.dict.size()) {
      return Invalid("a chained optimizer's members are keyed both by number and by chained_<i>");
    }
    for (const auto& [i, m] : by_index) {
      if (i != static_cast<int64_t>(members.size())) {
        return Invalid("a chained optimizer's members are not numbered 0, 1, ...");
      }
      members.push_back(m);
    }
  }
  for (const PyValue* m : members) {
    if (m == nullptr || m->kind == PyKind::kNone) return Invalid("a chained optimizer's member is empty");
  }
  return members;
}

void ExportTorchDistCommon(const PyValue* root, Checkpoint& ck, const PerDpRankGroups& groups) {
  auto literal = [&](const char* path, std::string bytes) {
    const uint64_t n = bytes.size();
    ck.exports.push_back(
        ExportFile{path, {ExportPart{PartKind::kLiteral, std::move(bytes), 0, DType::kInvalid, n, {}}}});
  };
  if (root == nullptr || root->kind != PyKind::kDict) {
    literal(kCommonWhy, "the run's common state (args, iteration, optimizer param groups) was not read");
    return;
  }
  static const RE2 model_key(R"(model[0-9]*)");
  PickleWriter w;
  Status st;
  bool optimizer = false;
  w.BeginDict();
  // NeMo 2 saves Lightning's checkpoint dict: its step is global_step, and
  // Megatron-LM's load_checkpoint reads `iteration` (it exits without one).
  if (const PyValue* step = root->Get("global_step");
      root->Get("iteration") == nullptr && step != nullptr && step->kind == PyKind::kInt) {
    w.Str("iteration");
    w.Int(step->i);
  }
  for (const auto& [k, v] : root->dict) {
    if (!k->IsStr() || RE2::FullMatch(k->s, model_key) || k->s == "rng_state" || k->s == "content_metadata") continue;
    w.Str(k->s);
    if (k->s == "optimizer") {
      optimizer = true;
      const PyValue* opt = CommonOptimizer(root);
      st = opt != nullptr ? WriteReshardableOptimizer(*opt, groups, w)
                          : Unsupported("the checkpoint holds no optimizer state");
    } else {
      const std::string& name = k->s;  // a structured binding is not captured before C++20
      st = w.Value(
          *v, [&](PickleWriter&, const PyValue&) { return Unsupported("common entry '" + name + "' holds a tensor"); });
    }
    if (!st.ok()) break;
  }
  if (st.ok() && !optimizer) st = Unsupported("the checkpoint holds no optimizer state");
  if (!st.ok()) {
    literal(kCommonWhy, st.message());
    return;
  }
  // What Megatron-LM's load_checkpoint reads (load_content_metadata) to ask
  // for the optimizer in this layout; the source's other content metadata
  // described its own layout.
  w.Str("content_metadata");
  w.BeginDict();
  w.Str("distrib_optim_sharding_type");
  w.Str("fully_reshardable");
  w.EndDict();
  w.EndDict();
  literal(kCommonPickle, w.Fragment());
}

void ExportArgsJson(const PyValue* args, Checkpoint& ck) {
  ExportFile f;
  f.path = "args.json";
  std::string text = ToJson(args) + "\n";
  const uint64_t size = text.size();
  f.parts.push_back(ExportPart{PartKind::kLiteral, std::move(text), 0, DType::kInvalid, size, {}});
  ck.exports.push_back(std::move(f));
  PickleWriter w;
  Status st = w.Value(*args, [](PickleWriter&, const PyValue&) { return Invalid("args hold a tensor"); });
  if (!st.ok()) {
    ck.info.problems.push_back("the run's args cannot be re-pickled (" + st.message() +
                               "); topo/ views have no Megatron-native files");
    return;
  }
  std::string ops = w.Fragment();
  const uint64_t n = ops.size();
  ck.exports.push_back(
      ExportFile{kArgsPickle, {ExportPart{PartKind::kLiteral, std::move(ops), 0, DType::kInvalid, n, {}}}});
}

bool NoWeightDecay(const std::string& name, const std::vector<int64_t>& shape) {
  return name.ends_with(".bias") || shape.size() == 1;
}

bool IsExpert(const std::string& name) { return name.find(".experts.") != std::string::npos; }

Result<std::vector<GroupKey>> GroupKeysOf(const std::vector<const PyValue*>& groups) {
  std::vector<GroupKey> keys;
  for (size_t i = 0; i < groups.size(); ++i) {
    const PyValue* g = groups[i];
    if (g == nullptr || g->kind != PyKind::kDict) return Invalid("param group " + std::to_string(i) + " is not a dict");
    const PyValue* wd = g->Get("wd_mult") != nullptr ? g->Get("wd_mult") : g->Get("weight_decay");
    if (wd == nullptr || (wd->kind != PyKind::kFloat && wd->kind != PyKind::kInt)) {
      return Invalid("param group " + std::to_string(i) + " has neither wd_mult nor weight_decay");
    }
    const PyValue* ex = g->Get("is_expert_parallel");
    const GroupKey k{(wd->kind == PyKind::kFloat ? wd->f : static_cast<double>(wd->i)) == 0.0,
                     ex != nullptr && ex->kind == PyKind::kBool && ex->b};
    if (std::find(keys.begin(), keys.end(), k) != keys.end()) {
      return Unsupported(
          "several param groups share a weight-decay setting (lr scaling?), so their members cannot be "
          "told apart");
    }
    keys.push_back(k);
  }
  return keys;
}

Status ExportParamGroups(const PyValue& optimizer, const std::string& what, Checkpoint& ck) {
  if (!optimizer.IsSeq() && optimizer.kind != PyKind::kDict)
    return Invalid(what + ": the optimizer state is not a dict");
  auto chained = ChainedMembers(optimizer);
  if (!chained.ok()) return chained.status().Annotate(what);
  std::vector<const PyValue*> members = std::move(*chained);
  if (members.empty() && optimizer.kind == PyKind::kDict) members.push_back(&optimizer);
  // Their groups, one after another (what torch's get_state_dict gives for
  // one optimizer over all of them).
  PyValue all;
  all.kind = PyKind::kList;
  for (size_t i = 0; i < members.size(); ++i) {
    const PyValue* m = members[i];
    const std::string which = members.size() > 1 ? " (chained optimizer " + std::to_string(i) + ")" : "";
    if (m == nullptr || m->kind != PyKind::kDict) return Invalid(what + which + ": the optimizer state is not a dict");
    const PyValue* inner = m->Get("optimizer") != nullptr ? m->Get("optimizer") : m;
    const PyValue* groups = inner->kind == PyKind::kDict ? inner->Get("param_groups") : nullptr;
    if (groups == nullptr || !groups->IsSeq())
      return Invalid(what + which + ": the optimizer has no param_groups list");
    all.items.insert(all.items.end(), groups->items.begin(), groups->items.end());
  }
  return ExportParamGroupList(all, what, ck);
}

Status ExportParamGroupList(const PyValue& list, const std::string& what, Checkpoint& ck) {
  if (!list.IsSeq()) return Invalid(what + ": param_groups is not a list");
  auto keys = GroupKeysOf({list.items.begin(), list.items.end()});
  if (!keys.ok()) return keys.status().Annotate(what);
  std::vector<std::vector<std::string>> names(keys->size());
  std::string orphan;  // a parameter no group takes (its key has none)
  size_t orphans = 0;
  for (const TensorRecord& t : ck.tensors) {
    if (t.role != Role::kParam || !t.error.empty()) continue;
    size_t i = 0;
    while (i < keys->size() && !(*keys)[i].Takes(t.fqn, t.shape)) ++i;
    if (i < keys->size()) {
      names[i].push_back(t.fqn);
    } else if (orphans++ == 0) {
      orphan = t.fqn;
    }
  }
  if (orphans > 0) {
    return Invalid(what + ": no param group has the weight-decay setting of '" + orphan + "'" +
                   (orphans > 1 ? " (and " + std::to_string(orphans - 1) + " more parameters)" : ""));
  }
  return AddParamGroupExports(
      list, what, [&](size_t i, const PyValue&) -> Result<std::vector<std::string>> { return names[i]; }, ck.exports);
}

}  // namespace ckptfs::formats::megatron
