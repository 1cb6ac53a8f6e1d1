#include "formats/deepspeed/ds_reader.h"

#include <re2/re2.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "ckptfs/geometry.h"
#include "formats/byte_reader.h"
#include "formats/pickle.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"
#include "formats/torch_save.h"
#include "formats/torch_save_writer.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats {
namespace {

namespace fs = std::filesystem;

const PickleOptions& DsPickleOptions() {
  static const PickleOptions o = [] {
    PickleOptions p;
    p.extra_modules = {"deepspeed"};
    return p;
  }();
  return o;
}

const RE2& ModelRe() {
  static const RE2 r(R"(mp_rank_(\d+)_model_states\.pt)");
  return r;
}
const RE2& Zero3ModelRe() {
  static const RE2 r(R"((?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return r;
}
// PipelineEngine: one file per layer and TP rank (PipelineModule.ckpt_layer_path).
const RE2& LayerRe() {
  static const RE2 r(R"(layer_(\d+)-model_(\d+)-model_states\.pt$)");
  return r;
}
const RE2& OptimRe() {
  static const RE2 r(R"((bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  return r;
}

// DeepSpeed MoE expert files (engine._save_moe_checkpoint): the experts of
// MoE layer L, one file per global expert E, tensors under global names.
const RE2& ExpertFileRe() {
  static const RE2 r(R"(layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return r;
}

// param_shapes: a list (one per group) of OrderedDict name -> torch.Size.
using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// An expert parameter is `<prefix>deepspeed_experts.<i>.<rest>`
// (deepspeed/moe/experts.py); in param_shapes and the optimizer files i is
// local to the expert-parallel rank, in the expert files it is global.
const RE2& ExpertNameRe() {
  static const RE2 r(R"((.*\.deepspeed_experts\.)(\d+)(\..*))", RE2::Latin1);
  return r;
}
bool Experts(const Shapes& shapes) {
  return !shapes.empty() && std::all_of(shapes.begin(), shapes.end(),
                                        [](const auto& s) { return RE2::FullMatch(s.first, ExpertNameRe()); });
}
// Local experts per MoE layer (per name prefix) in one group.
std::map<std::string, int> LocalExperts(const Shapes& shapes) {
  std::map<std::string, int> n;
  for (const auto& [name, shape] : shapes) {
    std::string prefix;
    int i = 0;
    if (!RE2::FullMatch(name, ExpertNameRe(), &prefix, &i, nullptr)) continue;
    int& c = n[prefix];
    c = std::max(c, i + 1);
  }
  return n;
}
// Local expert i of expert-parallel rank e is global expert e * n + i
// (engine._save_moe_checkpoint's numbering).
std::string GlobalExpertName(const std::string& local, int e, const std::map<std::string, int>& counts) {
  std::string prefix, rest;
  int i = 0;
  if (!RE2::FullMatch(local, ExpertNameRe(), &prefix, &i, &rest)) return local;
  auto it = counts.find(prefix);
  const int64_t n = it == counts.end() ? 0 : it->second;
  return prefix + std::to_string(int64_t{e} * n + i) + rest;
}
Result<std::vector<Shapes>> ParamShapes(const Source& s, const PyValue* v) {
  std::vector<Shapes> out;
  if (v == nullptr || v->kind == PyKind::kNone) return out;
  // Older DeepSpeed wrote one dict for all parameters: a single group.
  std::vector<const PyValue*> groups;
  if (v->kind == PyKind::kDict) {
    groups.push_back(v);
  } else if (v->IsSeq()) {
    groups.assign(v->items.begin(), v->items.end());
  } else {
    return Invalid(s.rel + ": param_shapes is not a list");
  }
  for (const PyValue* g : groups) {
    if (g->kind != PyKind::kDict) return Invalid(s.rel + ": a param_shapes group is not a dict");
    out.emplace_back();
    for (const auto& [k, x] : g->dict) {
      if (!k->IsStr()) return Invalid(s.rel + ": param_shapes has a non-string name");
      ASSIGN_OR_RETURN(auto shape, AsIntVector(x, "param_shapes[" + k->s + "]"));
      out.back().emplace_back(k->s, std::move(shape));
    }
  }
  return out;
}

// Python's re.match: anchored at the start only. The patterns come from the
// checkpoint (untrusted), so they run on RE2 (linear time, bounded memory, no
// backtracking); a pattern RE2 cannot compile (Python-only syntax such as
// backreferences or lookaround) is reported, never silently ignored.
class PatternList {
 public:
  PatternList() = default;
  explicit PatternList(std::vector<std::string> ps) {
    for (auto& p : ps) {
      RE2::Options o;
      o.set_log_errors(false);
      auto re = std::make_shared<RE2>(p, o);
      if (re->ok()) {
        res_.push_back(std::move(re));
      } else {
        bad_.push_back(p);
      }
    }
  }
  bool Match(const std::string& name) const {
    return std::any_of(res_.begin(), res_.end(), [&](const std::shared_ptr<RE2>& r) {
      return r->Match(name, 0, name.size(), RE2::ANCHOR_START, nullptr, 0);
    });
  }
  const std::vector<std::string>& bad() const { return bad_; }

 private:
  std::vector<std::shared_ptr<RE2>> res_;
  std::vector<std::string> bad_;
};

struct ModelStates {
  std::unique_ptr<Source> src;
  std::vector<Shapes> groups;
  std::vector<std::pair<std::string, const PyValue*>> module;  // state_dict entries, in order
  std::map<std::string, const PyValue*> module_by_name;        // the same, by name
  std::set<std::string> buffers;
  const PyValue* uci = nullptr;
  std::string error;
};

struct OptimGroup {
  std::optional<Loc> fp32, exp_avg, exp_avg_sq, step;
  const PyValue* step_value = nullptr;  // a Python number (older torch)
  int64_t recorded_pad = -1;
  int64_t partition_count = -1;
  const PyValue* mapping = nullptr;  // OrderedDict name -> fragment_address
  std::vector<int64_t> align;        // per-parameter alignment gaps (param_alignment_paddings)
};

struct OptimRank {
  std::unique_ptr<Source> src;
  int stage = 0;  // 1, 2, 3
  bool bf16_optimizer = false;
  std::vector<OptimGroup> groups;
  const PyValue* osd = nullptr;  // optimizer_state_dict
  std::string error;
};

// The torch optimizer's per-group state {step, exp_avg, exp_avg_sq} of flat
// group `g` (absent when the group never took a step: no fragments need it).
Status ParseAdamState(const Source& s, const PyValue* state, size_t g, const std::string& what, OptimGroup& og) {
  const PyValue* st = nullptr;
  if (state != nullptr) {
    for (const auto& [k, v] : state->dict) {
      if (k->kind == PyKind::kInt && k->i == static_cast<int64_t>(g)) st = v;
    }
  }
  if (st == nullptr) return Status::Ok();
  if (const PyValue* x = st->Get("exp_avg")) {
    ASSIGN_OR_RETURN(og.exp_avg, Resolve(s, x, what + " exp_avg"));
  }
  if (const PyValue* x = st->Get("exp_avg_sq")) {
    ASSIGN_OR_RETURN(og.exp_avg_sq, Resolve(s, x, what + " exp_avg_sq"));
  }
  if (const PyValue* x = st->Get("step")) {
    if (x->kind == PyKind::kTensor) {
      ASSIGN_OR_RETURN(og.step, Resolve(s, x, what + " step"));
    } else {
      og.step_value = x;  // a Python number (older torch)
    }
  }
  return Status::Ok();
}

Status ParseOptim(OptimRank& o) {
  const Source& s = *o.src;
  const PyValue* root = s.root();
  const PyValue* osd = root ? root->Get("optimizer_state_dict") : nullptr;
  if (osd == nullptr || osd->kind != PyKind::kDict) return Invalid(s.rel + ": no optimizer_state_dict");
  o.osd = osd;
  const PyValue* zs = osd->Get("zero_stage");
  if (zs == nullptr) {
    if (osd->Get("single_partition_of_fp32_groups") == nullptr) {
      return Invalid(s.rel + ": no zero_stage and no single_partition_of_fp32_groups: not a ZeRO optimizer state");
    }
    o.stage = 1;
    o.bf16_optimizer = true;  // BF16_Optimizer writes no zero_stage
  } else {
    ASSIGN_OR_RETURN(int64_t stage, EnumValue(zs, s.rel + ": zero_stage"));  // ZeroStageEnum, either pickle form
    if (stage < 1 || stage > 3) return Unsupported(s.rel + ": unknown ZeRO stage " + std::to_string(stage));
    o.stage = static_cast<int>(stage);
  }
  if (o.stage <= 2) {
    const PyValue* base = osd->Get("base_optimizer_state");
    const PyValue* fp32 = osd->Get("single_partition_of_fp32_groups");
    if (base == nullptr || fp32 == nullptr || !fp32->IsSeq()) {
      return Invalid(s.rel + ": no base_optimizer_state / single_partition_of_fp32_groups");
    }
    const PyValue* state = base->Get("state");
    if (state == nullptr || state->kind != PyKind::kDict) {
      return Unsupported(s.rel + ": base_optimizer_state has no 'state' dict (legacy elastic checkpoint)");
    }
    const PyValue* paddings = osd->Get("group_paddings");
    const PyValue* counts = osd->Get("partition_count");
    const PyValue* maps = osd->Get("param_slice_mappings");
    const PyValue* align = osd->Get("param_alignment_paddings");
    o.groups.resize(fp32->items.size());
    for (size_t g = 0; g < o.groups.size(); ++g) {
      OptimGroup& og = o.groups[g];
      const std::string gs = "group " + std::to_string(g);
      ASSIGN_OR_RETURN(og.fp32,
                       Resolve(s, fp32->items[g], "single_partition_of_fp32_groups[" + std::to_string(g) + "]"));
      RETURN_IF_ERROR(ParseAdamState(s, state, g, gs, og));
      if (paddings && paddings->IsSeq() && g < paddings->items.size()) {
        ASSIGN_OR_RETURN(og.recorded_pad, AsInt(paddings->items[g], s.rel + ": group_paddings"));
      }
      if (counts && counts->IsSeq() && g < counts->items.size()) {
        ASSIGN_OR_RETURN(og.partition_count, AsInt(counts->items[g], s.rel + ": partition_count"));
      } else if (counts && counts->kind == PyKind::kInt) {
        og.partition_count = counts->i;
      }
      if (maps && maps->IsSeq() && g < maps->items.size()) og.mapping = maps->items[g];
      if (align && align->IsSeq() && g < align->items.size()) {
        ASSIGN_OR_RETURN(og.align, AsIntVector(align->items[g], s.rel + ": param_alignment_paddings"));
      }
    }
  } else {
    const PyValue* flat = osd->Get("fp32_flat_groups");
    const PyValue* inner = osd->Get("optimizer_state_dict");
    const PyValue* state = inner ? inner->Get("state") : nullptr;
    if (flat == nullptr || !flat->IsSeq()) return Invalid(s.rel + ": ZeRO-3 state without fp32_flat_groups");
    int64_t count = -1;
    if (const PyValue* c = osd->Get("partition_count")) {
      if (c->kind == PyKind::kInt) count = c->i;
      if (c->IsSeq() && !c->items.empty()) {
        ASSIGN_OR_RETURN(count, AsInt(c->items[0], s.rel + ": partition_count"));
      }
    }
    o.groups.resize(flat->items.size());
    for (size_t g = 0; g < o.groups.size(); ++g) {
      OptimGroup& og = o.groups[g];
      og.partition_count = count;
      ASSIGN_OR_RETURN(og.fp32, Resolve(s, flat->items[g], "fp32_flat_groups[" + std::to_string(g) + "]"));
      RETURN_IF_ERROR(ParseAdamState(s, state, g, "sub-group " + std::to_string(g), og));
    }
  }
  for (const OptimGroup& og : o.groups) {
    for (const auto* l : {&og.fp32, &og.exp_avg, &og.exp_avg_sq}) {
      if (l->has_value() && (!(*l)->Contiguous() || (*l)->shape.size() != 1)) {
        return Unsupported(s.rel + ": a flat partition that is not a contiguous 1-D tensor");
      }
    }
  }
  return Status::Ok();
}

Status ParseModel(ModelStates& m, bool want_module) {
  const Source& s = *m.src;
  const PyValue* root = s.root();
  if (root == nullptr || root->kind != PyKind::kDict) return Invalid(s.rel + ": not a dict");
  ASSIGN_OR_RETURN(m.groups, ParamShapes(s, root->Get("param_shapes")));
  if (want_module) {
    const PyValue* mod = root->Get("module");
    if (mod != nullptr && mod->kind == PyKind::kDict) {
      for (const auto& [k, v] : mod->dict) {
        if (k->IsStr() && v->kind == PyKind::kTensor && m.module_by_name.emplace(k->s, v).second) {
          m.module.emplace_back(k->s, v);
        }
      }
    }
  }
  for (const auto& b : StrList(root->Get("buffer_names"))) m.buffers.insert(b);
  m.uci = root->Get("universal_checkpoint_info");
  if (m.uci != nullptr && m.uci->kind != PyKind::kDict) m.uci = nullptr;
  return Status::Ok();
}

struct Patterns {
  PatternList replicated, average, row, vocab, sub2, sub_params;
  int64_t original_vocab = -1;
  bool present = false;
  double version = 0;  // universal_checkpoint_version
  // parameter_with_sub_params: each entry (a dict of SubparamShape's fields)
  // with its patterns, in order; sub_param_shard_widths (UCP >= 0.4).
  struct SubEntry {
    const PyValue* v = nullptr;
    std::vector<std::pair<std::string, PatternList>> patterns;
    const PyValue* Field(std::string_view k) const { return v->kind == PyKind::kDict ? v->Get(k) : v->Attr(k); }
  };
  std::vector<SubEntry> subs;
  const PyValue* shard_widths = nullptr;

  explicit Patterns(const PyValue* uci) {
    if (uci == nullptr) return;
    present = true;
    replicated = PatternList(StrList(uci->Get("tp_replicated_parameter_patterns")));
    average = PatternList(StrList(uci->Get("parameter_to_average_patterns")));
    row = PatternList(StrList(uci->Get("parameter_with_row_parallelism_patterns")));
    vocab = PatternList(StrList(uci->Get("vocabulary_parameter_patterns")));
    sub2 = PatternList(StrList(uci->Get("parameter_with_2_sub_params_cat_dim_0")));
    std::vector<std::string> sp_list;
    if (const PyValue* sp = uci->Get("parameter_with_sub_params"); sp && sp->IsSeq()) {
      for (PyRef x : sp->items) {
        SubEntry e{x, {}};
        for (const auto& p : StrList(e.Field("patterns"))) {
          sp_list.push_back(p);
          e.patterns.emplace_back(p, PatternList({p}));
        }
        subs.push_back(std::move(e));
      }
    }
    sub_params = PatternList(std::move(sp_list));
    shard_widths = uci->Get("sub_param_shard_widths");
    if (const PyValue* v = uci->Get("original_vocab_size"); v && v->kind == PyKind::kInt) original_vocab = v->i;
    if (const PyValue* v = uci->Get("universal_checkpoint_version")) {
      if (v->kind == PyKind::kFloat) version = v->f;
      if (v->kind == PyKind::kInt) version = static_cast<double>(v->i);
    }
  }
  static bool Any(const PatternList& ps, const std::string& n) { return ps.Match(n); }

  // The first sub-parameter entry and pattern matching `name` (the order
  // ds_to_universal.py's get_matched_sub_params_pattern searches).
  std::pair<const SubEntry*, std::string> SubFor(const std::string& name) const {
    for (const SubEntry& e : subs) {
      for (const auto& [p, list] : e.patterns) {
        if (list.Match(name)) return {&e, p};
      }
    }
    return {nullptr, ""};
  }

  // Fills rule.sub for a kSubParams parameter whose TP ranks hold `local`
  // shapes, as ds_to_universal.py's merge_tp_slices reads the entry: sizes
  // from a tuple at partition_dim (before UCP 0.4 a scalar there is the
  // number of equal sub-parameters), widths from sub_param_shard_widths
  // (UCP >= 0.4) or an even split.
  Status ResolveSub(const std::string& name, const std::vector<std::vector<int64_t>>& local, Rule& rule) const {
    auto [e, pattern] = SubFor(name);
    if (e == nullptr) return Internal("no sub-parameter entry for '" + name + "'");
    const PyValue* shape = e->Field("shape");
    ASSIGN_OR_RETURN(int64_t pd, AsInt(e->Field("partition_dim"), "partition_dim of '" + pattern + "'"));
    if (shape == nullptr || !shape->IsSeq() || pd < 0 || static_cast<size_t>(pd) >= shape->items.size()) {
      return Invalid("the sub-parameter shape of '" + pattern + "' has no partition dim " + std::to_string(pd));
    }
    const size_t tp = local.size(), d = static_cast<size_t>(pd);
    SubParams sp;
    sp.dim = static_cast<int>(pd);
    const PyValue* spec = shape->items[d];
    if (spec->IsSeq()) {
      ASSIGN_OR_RETURN(sp.sizes, AsIntVector(spec, "sub-parameter sizes of '" + pattern + "'"));
    } else if (version < 0.4) {
      ASSIGN_OR_RETURN(int64_t n, AsInt(spec, "sub-parameter count of '" + pattern + "'"));
      int64_t full = 0;
      for (const auto& l : local) {
        if (l.size() <= d) return Invalid("'" + name + "' has fewer dims than its sub-parameter partition dim");
        full += l[d];
      }
      if (n <= 0 || full % n != 0) {
        return Invalid("sub-parameter count " + std::to_string(n) + " of '" + name + "' does not divide " +
                       std::to_string(full));
      }
      sp.sizes.assign(static_cast<size_t>(n), full / n);
    } else {
      return Invalid("the sub-parameter shape of '" + pattern + "' has no sizes tuple at its partition dim");
    }
    if (version >= 0.4) {
      const PyValue* w = nullptr;
      if (shard_widths != nullptr && shard_widths->kind == PyKind::kDict) w = shard_widths->Get(pattern);
      if (w == nullptr || !w->IsSeq()) {
        return Invalid("universal checkpoint version " + std::to_string(version) +
                       " records no sub_param_shard_widths for '" + pattern + "'");
      }
      for (PyRef x : w->items) {
        ASSIGN_OR_RETURN(auto ws, AsIntVector(x, "sub_param_shard_widths of '" + pattern + "'"));
        sp.widths.push_back(std::move(ws));
      }
    } else {
      for (int64_t size : sp.sizes) {
        if (size % static_cast<int64_t>(tp) != 0) {
          return Invalid("sub-parameter size " + std::to_string(size) + " of '" + name + "' is not divisible by TP " +
                         std::to_string(tp));
        }
        sp.widths.emplace_back(tp, size / static_cast<int64_t>(tp));
      }
    }
    if (sp.widths.size() != sp.sizes.size()) {
      return Invalid("'" + name + "' has " + std::to_string(sp.widths.size()) + " shard width entries for " +
                     std::to_string(sp.sizes.size()) + " sub-parameters");
    }
    for (size_t j = 0; j < sp.sizes.size(); ++j) {
      int64_t sum = 0;
      for (int64_t x : sp.widths[j]) sum += x;
      if (sp.widths[j].size() != tp || sum != sp.sizes[j]) {
        return Invalid("shard widths of sub-parameter " + std::to_string(j) + " of '" + name + "' do not add up to " +
                       std::to_string(sp.sizes[j]) + " over " + std::to_string(tp) + " TP ranks");
      }
    }
    // The logical shape: tuples summed, the partition dim the sizes' sum, one -1 inferred.
    int64_t total = 0, known = 1, unknown = -1;
    for (const auto& l : local) total += NumelOf(l);
    for (size_t i = 0; i < shape->items.size(); ++i) {
      int64_t v = 0;
      if (i == d) {
        for (int64_t x : sp.sizes) v += x;
      } else if (shape->items[i]->IsSeq()) {
        ASSIGN_OR_RETURN(auto xs, AsIntVector(shape->items[i], "sub-parameter shape"));
        for (int64_t x : xs) v += x;
      } else {
        ASSIGN_OR_RETURN(v, AsInt(shape->items[i], "sub-parameter shape"));
      }
      if (v == -1 && unknown < 0) {
        unknown = static_cast<int64_t>(i);
      } else if (v <= 0) {
        return Invalid("sub-parameter shape of '" + pattern + "' has a dim of " + std::to_string(v));
      } else {
        known *= v;
      }
      sp.logical.push_back(v);
    }
    if (unknown >= 0) {
      if (total % known != 0) return Invalid("cannot infer the -1 dim of '" + name + "'");
      sp.logical[static_cast<size_t>(unknown)] = total / known;
    }
    rule.sub = std::move(sp);
    return Status::Ok();
  }

  // ds_to_universal.py's sub_param_shape value: SubparamShape(patterns,
  // shape, partition_dim) as the entry gives it, with a legacy scalar count
  // replaced by the tuple of sizes.
  Status WriteSubparamShape(PickleWriter& w, const std::string& name, const Rule& rule) const {
    auto [e, pattern] = SubFor(name);
    if (e == nullptr) return Internal("no sub-parameter entry for '" + name + "'");
    auto no_tensor = [](PickleWriter&, const PyValue&) { return Unsupported("a tensor in a sub-parameter shape"); };
    w.Global("deepspeed.checkpoint.universal_checkpoint", "SubparamShape");
    w.BeginTuple();
    w.EndTuple();
    w.NewObj();
    w.BeginDict();
    w.Str("patterns");
    RETURN_IF_ERROR(w.Value(*e->Field("patterns"), no_tensor));
    w.Str("shape");
    const PyValue* shape = e->Field("shape");
    const size_t d = static_cast<size_t>(rule.sub.dim);
    if (shape->items[d]->IsSeq()) {
      RETURN_IF_ERROR(w.Value(*shape, no_tensor));
    } else {
      w.BeginTuple();
      for (size_t i = 0; i < shape->items.size(); ++i) {
        if (i != d) {
          RETURN_IF_ERROR(w.Value(*shape->items[i], no_tensor));
          continue;
        }
        w.BeginTuple();
        for (int64_t x : rule.sub.sizes) w.Int(x);
        w.EndTuple();
      }
      w.EndTuple();
    }
    w.Str("partition_dim");
    RETURN_IF_ERROR(w.Value(*e->Field("partition_dim"), no_tensor));
    w.EndDict();
    w.Build();
    return Status::Ok();
  }
  // Patterns RE2 cannot compile (Python-only syntax): reported, never silently ignored.
  std::vector<std::string> Unusable() const {
    std::vector<std::string> out;
    for (const PatternList* l : {&replicated, &average, &row, &vocab, &sub2, &sub_params}) {
      out.insert(out.end(), l->bad().begin(), l->bad().end());
    }
    return out;
  }
  Rule For(const std::string& name) const {
    Rule r;
    if (Any(replicated, name)) {
      r.kind = Merge::kReplicated;
    } else if (Any(average, name)) {
      r.kind = Merge::kAverage;
    } else if (Any(sub2, name)) {
      r.kind = Merge::kSub2;
    } else if (Any(sub_params, name)) {
      r.kind = Merge::kSubParams;
    } else {
      r.cat_dim = Any(row, name) ? 1 : 0;
    }
    r.vocab = Any(vocab, name);
    return r;
  }
};

// One piece of a TP-local parameter held by one DP rank: the flat range
// [start, start+numel) of the TP-local tensor, at element `at` of the rank's
// flat partition of group `group`.
struct Piece {
  int dp = 0;
  int64_t start = 0, numel = 0, at = 0;
};

struct LocalParam {
  bool present = false;
  int mp = -1;  // the model-parallel file (pp * TP + tp) whose flat groups hold it
  int group = -1;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

struct Param {
  std::string name;
  std::vector<LocalParam> tp;  // per TP rank
  std::string error;           // geometry contradiction
};

// One tensor of the model's own (low-precision) copy.
struct ModuleEntry {
  const Source* src = nullptr;
  const PyValue* v = nullptr;
  std::string error;  // no source holds it (a missing or unreadable layer file)
};
// The model's copy as TP rank t holds it: mp_rank_XX's `module`, or with
// PipelineEngine the layer files of every stage (global names).
struct ModuleCopy {
  std::vector<std::pair<std::string, ModuleEntry>> entries;  // in file order
  std::map<std::string, ModuleEntry> by_name;
  std::string error;  // a source that could not be read
  void Add(const std::string& name, ModuleEntry e) {
    if (by_name.emplace(name, e).second) entries.emplace_back(name, e);
  }
};

struct Reader {
  std::string dir, prefix;
  Checkpoint ck;
  Files files;
  // Model-parallel files, indexed mp = pp * tp + t (PipelineEngine's
  // ds_model_rank; without a pipeline, mp = t).
  std::vector<ModelStates> models;
  std::vector<std::unique_ptr<Source>> z3_copies;     // ZeRO-3 model states of DP ranks > 0 (copied, not parsed)
  std::vector<std::unique_ptr<Source>> layer_files;   // PipelineEngine layer_XX-model_TT files
  std::vector<ModuleCopy> module;                     // per TP rank
  std::vector<std::unique_ptr<Source>> expert_files;  // MoE layer_L_expert_E_mp_rank_MM files
  std::set<std::string> experts;                      // MoE expert parameters (global names)
  std::vector<std::vector<OptimRank>> optim;          // [dp][mp]
  int mp = 0, tp = 0, pp = 1, dp = 0, stage = 0;
  int root = 0;  // the first readable model-states file
  bool data_before_ep = false;
  int optim_on_disk = 0;  // optimizer state files found (readable or not)  // ds_config
                          // use_data_before_expert_parallelism (another MoE rank layout)
  bool pipeline = false;
  const struct Patterns* patterns = nullptr;  // universal_checkpoint_info, during Emit
  bool bf16_optimizer = false;
  std::vector<Param> params;  // flat-group order of TP rank 0
  std::map<std::string, size_t> param_index;
  std::vector<std::string> problems;

  Status Run();
  Status Discover();
  void Geometry();
  Status Topology(const std::map<std::pair<int, int>, std::string>& layers);
  void ReadModule(const std::map<std::pair<int, int>, std::string>& layers);
  void Geometry12(int m);
  void CheckSliceMappings(const OptimRank& o, size_t g, std::map<std::string, std::pair<int64_t, int64_t>> placed,
                          const std::function<std::string(const std::string&)>& global);
  void Break(const std::string& name, const std::string& why);  // first reason wins
  void Geometry3(int m);
  Status Emit();
  Status ExportState(const std::string& name, const std::string& state, uint32_t tensor, const Rule& rule, bool dict);
  void AddArchive(const std::string& path, const std::string& stem, const std::string& pickle,
                  const std::vector<ArchiveStorage>& storages);
  Status EmitStep(const Param& p, bool ucp);
  void EmitParam(Param& p, const Patterns& pats, bool ucp, std::set<std::string>& have_fp32);
  std::map<std::string, uint32_t> EmitModule(const Patterns& pats);
  Status ExportOptimizerState();
  void EmitLostStages();
  void ExportCopies();
};

Status Reader::Discover() {
  std::error_code ec;
  std::string latest = dir + "/latest";
  if (fs::is_regular_file(latest, ec)) {
    ASSIGN_OR_RETURN(std::string tag, ReadWholeFile(latest, 4096));
    while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
    if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
        !fs::is_directory(dir + "/" + tag, ec)) {
      return Invalid("cannot parse " + latest + ": names '" + tag + "', which is not a directory here");
    }
    prefix = tag + "/";
  }
  std::map<int, std::string> model_files;
  std::map<std::pair<int, int>, std::string> z3_models, optim_files, layers;  // layers: (layer, tp)
  std::map<std::tuple<int, int, int>, std::string> expert_names;              // (mp, layer, expert)
  std::string opt_prefix;
  for (const auto& e : fs::directory_iterator(dir + "/" + prefix, ec)) {
    std::string n = e.path().filename().string();
    // Ranks that do not fit an int do not match (RE2 checks the conversion).
    int a = 0, b = 0, c = 0;
    std::string dtype_prefix;
    if (RE2::FullMatch(n, ModelRe(), &a)) {
      model_files[a] = n;
    } else if (RE2::FullMatch(n, Zero3ModelRe(), &a, &b)) {
      z3_models[{a, b}] = n;
    } else if (RE2::FullMatch(n, OptimRe(), &dtype_prefix, &a, &b)) {
      optim_files[{a, b}] = n;
      opt_prefix = dtype_prefix;
    } else if (RE2::FullMatch(n, LayerRe(), &a, &b)) {
      layers[{a, b}] = n;
    } else if (RE2::FullMatch(n, ExpertFileRe(), &a, &b, &c)) {
      expert_names[{c, a, b}] = n;
    } else if (n.starts_with("expp_rank_")) {
      problems.push_back("MoE expert optimizer file " + prefix + n + " is not read (MoE is not supported yet)");
    }
  }
  if (ec) return ErrnoStatus("list", dir + "/" + prefix, ec.value());
  pipeline = !layers.empty();
  if (model_files.empty() && z3_models.empty()) {
    if (!optim_files.empty()) {
      return Invalid("cannot read " + dir + "/" + prefix + "mp_rank_00_model_states.pt: missing (" +
                     std::to_string(optim_files.size()) +
                     " optimizer state files are present, but the parameter "
                     "shapes live in the model states)");
    }
    return Invalid("cannot parse " + dir + "/" + prefix +
                   ": no mp_rank_XX_model_states.pt (not a DeepSpeed checkpoint tag directory)");
  }
  files.dir = dir;
  files.ck = &ck;
  files.pickle = DsPickleOptions();
  // TP ranks: the model-states files (stage 3: those of DP rank 0).
  std::set<int> mps;
  for (const auto& [mp, n] : model_files) mps.insert(mp);
  for (const auto& [k, n] : z3_models) mps.insert(k.second);
  mp = mps.empty() ? 0 : *mps.rbegin() + 1;
  std::set<int> dps;
  for (const auto& [k, n] : optim_files) dps.insert(k.first);
  for (const auto& [k, n] : z3_models) dps.insert(k.first);
  dp = dps.empty() ? 0 : *dps.rbegin() + 1;
  models.resize(mp);
  for (int t = 0; t < mp; ++t) {
    std::string n;
    if (auto it = model_files.find(t); it != model_files.end()) {
      n = it->second;
    } else if (auto it3 = z3_models.find({0, t}); it3 != z3_models.end()) {
      n = it3->second;
    } else {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "mp_rank_%02d_model_states.pt", t);
      n = buf;
    }
    models[t].src = files.Open(prefix + n);
    if (models[t].src->error.empty()) {
      Status st = ParseModel(models[t], model_files.count(t) > 0);
      if (!st.ok()) models[t].error = st.message();
    } else {
      models[t].error = models[t].src->error;
    }
  }
  // The first readable model-states file stands for the checkpoint's common
  // state (DeepSpeed writes it into every one); an unreadable file loses only
  // its own stage's parameter shapes.
  while (root < mp && !models[root].error.empty()) ++root;
  if (root == mp) return Invalid(models[0].error);
  RETURN_IF_ERROR(Topology(layers));
  if (const PyValue* c = models[root].src->root()->Get("ds_config"); c && c->kind == PyKind::kDict) {
    const PyValue* v = c->Get("use_data_before_expert_parallelism");
    data_before_ep = v != nullptr && v->kind == PyKind::kBool && v->b;
  }
  // The DP degree is what the writer recorded, not what happens to be on disk:
  // a missing last rank must show up as missing.
  if (const PyValue* v = models[root].src->root()->Get("dp_world_size"); v && v->kind == PyKind::kInt && v->i > dp) {
    if (v->i > 1 << 20) return Invalid(models[root].src->rel + ": implausible dp_world_size " + std::to_string(v->i));
    dp = static_cast<int>(v->i);
  }
  if (dp == 0 && !optim_files.empty()) dp = 1;
  optim_on_disk = static_cast<int>(optim_files.size());
  // Stage-3 model files of other DP ranks are part of the checkpoint too.
  for (const auto& [k, n] : z3_models) {
    if (k.first != 0) z3_copies.push_back(files.Open(prefix + n, /*parse=*/false));
  }
  optim.resize(dp);
  for (int d = 0; d < dp; ++d) {
    optim[d].resize(mp);
    for (int t = 0; t < mp; ++t) {
      OptimRank& o = optim[d][t];
      std::string n;
      if (auto it = optim_files.find({d, t}); it != optim_files.end()) {
        n = it->second;
      } else {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt", opt_prefix.c_str(), d, t);
        n = buf;
      }
      o.src = files.Open(prefix + n);
      if (!o.src->error.empty()) {
        o.error = o.src->error;
      } else {
        Status st = ParseOptim(o);
        if (!st.ok()) o.error = st.message();
      }
      if (!o.error.empty()) {
        const bool missing = ck.files[o.src->file.v].mtime_ns == -1;
        ck.info.Flag(missing ? Check::kCoverage : Check::kUnreadable, Severity::kError, "", o.src->rel,
                     missing ? o.src->rel + " is missing (DP=" + std::to_string(dp) +
                                   "): the optimizer partitions "
                                   "it holds are holes in every parameter of its rank"
                             : o.error);
        continue;
      }
      if (stage == 0) {
        stage = o.stage;
        bf16_optimizer = o.bf16_optimizer;
      } else if (o.stage != stage) {
        o.error = o.src->rel + ": ZeRO stage " + std::to_string(o.stage) + " differs from the other ranks' " +
                  std::to_string(stage);
        problems.push_back(o.error);
      }
    }
  }
  ReadModule(layers);
  // MoE experts: the model copy of each global expert (module holds none).
  for (const auto& [key, n] : expert_names) {
    const int m = std::get<0>(key);
    if (m >= mp) continue;
    expert_files.push_back(files.Open(prefix + n));
    const Source& src = *expert_files.back();
    const PyValue* sd = src.root();
    if (!src.error.empty() || sd == nullptr || sd->kind != PyKind::kDict) {
      problems.push_back((src.error.empty() ? src.rel + " is not a state dict" : src.error) +
                         ": the model copy of its experts has no param view");
      continue;
    }
    for (const auto& [k, v] : sd->dict) {
      if (k->IsStr() && v->kind == PyKind::kTensor) module[m % tp].Add(k->s, ModuleEntry{&src, v, ""});
    }
  }
  return Status::Ok();
}

// The TP and PP degrees behind the mp index: checkpoint_parallel_dimensions
// when the writer recorded it (DeepSpeed >= 0.16), else, for PipelineEngine,
// the TP ranks of the layer files (DeepSpeedCheckpoint's rule); without a
// pipeline every mp file is a TP rank.
Status Reader::Topology(const std::map<std::pair<int, int>, std::string>& layers) {
  const Source& s0 = *models[root].src;
  tp = mp;
  pp = 1;
  if (const PyValue* d = s0.root()->Get("checkpoint_parallel_dimensions"); d && d->kind == PyKind::kDict) {
    const PyValue* t = d->Get("tp_degree");
    const PyValue* p = d->Get("pp_degree");
    if (t && p && t->kind == PyKind::kInt && p->kind == PyKind::kInt && t->i > 0 && p->i > 0) {
      if (t->i * p->i != mp) {
        return Invalid("cannot parse " + s0.rel + ": checkpoint_parallel_dimensions says TP=" + std::to_string(t->i) +
                       " PP=" + std::to_string(p->i) + ", but there are " + std::to_string(mp) + " mp_rank files");
      }
      tp = static_cast<int>(t->i);
      pp = static_cast<int>(p->i);
      return Status::Ok();
    }
  }
  if (!layers.empty()) {
    std::set<int> tps;
    for (const auto& [k, n] : layers) tps.insert(k.second);
    const int t = *tps.rbegin() + 1;
    if (mp % t != 0) {
      return Invalid("cannot parse " + dir + "/" + prefix + ": layer files name " + std::to_string(t) +
                     " TP ranks, which do not divide the " + std::to_string(mp) + " mp_rank files");
    }
    tp = t;
    pp = mp / t;
  }
  return Status::Ok();
}

// The model's own copy per TP rank. PipelineEngine keeps it in layer files
// with layer-local names: layer L's `k` is `L.k` when a stage's param_shapes
// (or buffer_names) has that name, else the one tied module parameter
// `tied_modules.<key>.k` the stages have, else `L.k` (a buffer or frozen
// tensor without optimizer state). The first layer file naming a tied module
// wins (the others hold the same tensor).
void Reader::ReadModule(const std::map<std::pair<int, int>, std::string>& layers) {
  module.resize(tp);
  if (!pipeline) {
    for (int t = 0; t < tp; ++t) {
      if (!models[t].error.empty()) {
        module[t].error = models[t].error;
        continue;
      }
      for (const auto& [name, v] : models[t].module) module[t].Add(name, ModuleEntry{models[t].src.get(), v, ""});
    }
    return;
  }
  std::vector<std::set<std::string>> known(tp);  // trainable and buffer names per TP rank, all stages
  std::vector<std::vector<std::string>> trainable(tp);
  for (int m = 0; m < mp; ++m) {
    for (const Shapes& g : models[m].groups) {
      for (const auto& [n, shape] : g) {
        if (known[m % tp].insert(n).second) trainable[m % tp].push_back(n);
      }
    }
    for (const auto& b : models[m].buffers) known[m % tp].insert(b);
  }
  // Every layer a stage's parameters name must have its file: one the
  // directory lacks is registered as missing (and its weights are EIO).
  std::map<std::pair<int, int>, std::string> want = layers;
  std::map<std::pair<int, int>, std::string> failed;  // (layer, tp) -> why
  static const RE2 kLayerName(R"(^(\d+)\.)", RE2::Latin1);
  for (int t = 0; t < tp; ++t) {
    for (const auto& n : trainable[t]) {
      int layer = 0;
      if (!RE2::PartialMatch(n, kLayerName, &layer)) continue;
      char buf[64];
      std::snprintf(buf, sizeof(buf), "layer_%02d-model_%02d-model_states.pt", layer, t);
      want.emplace(std::make_pair(layer, t), buf);
    }
  }
  for (const auto& [key, n] : want) {
    const auto [layer, t] = key;
    if (t >= tp) continue;
    layer_files.push_back(files.Open(prefix + n));
    const Source& src = *layer_files.back();
    if (!src.error.empty()) {
      failed[key] = src.error;
      problems.push_back(src.error + ": the weights of layer " + std::to_string(layer) + " (TP rank " +
                         std::to_string(t) + ") have no param view");
      continue;
    }
    const PyValue* sd = src.root();
    if (sd == nullptr || sd->kind != PyKind::kDict) {
      problems.push_back(src.rel + " is not a state dict: the weights of layer " + std::to_string(layer) +
                         " have no param view");
      continue;
    }
    for (const auto& [k, v] : sd->dict) {
      if (!k->IsStr() || v->kind != PyKind::kTensor) continue;
      std::string name = std::to_string(layer) + "." + k->s;
      if (!known[t].count(name)) {
        std::string tied;
        int found = 0;
        for (const auto& cand : known[t]) {
          if (cand.starts_with("tied_modules.") && cand.size() > k->s.size() + 1 && cand.ends_with("." + k->s)) {
            tied = cand;
            ++found;
          }
        }
        if (found == 1) name = tied;
      }
      module[t].Add(name, ModuleEntry{&src, v, ""});
    }
  }
  for (int t = 0; t < tp; ++t) {
    for (const auto& n : trainable[t]) {
      if (module[t].by_name.count(n)) continue;
      std::string why = "no layer file of TP rank " + std::to_string(t) + " holds '" + n + "'";
      if (int layer = 0; RE2::PartialMatch(n, kLayerName, &layer)) {
        if (auto it = failed.find({layer, t}); it != failed.end()) why = it->second;
      }
      module[t].Add(n, ModuleEntry{nullptr, nullptr, why});
    }
  }
}

// ZeRO-1/2 and BF16_Optimizer: groups flattened in param_shapes order (with
// optional per-parameter alignment gaps), padded to a multiple of 2*D at the
// end only, split into D partitions of S elements.
void Reader::Geometry12(int mi) {
  const ModelStates& m = models[mi];
  const int t = mi % tp;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    const Shapes& shapes = m.groups[g];
    const OptimRank* any = nullptr;
    for (int d = 0; d < dp && any == nullptr; ++d) {
      if (optim[d][mi].error.empty() && g < optim[d][mi].groups.size()) any = &optim[d][mi];
    }
    std::vector<int64_t> align = any ? any->groups[g].align : std::vector<int64_t>{};
    if (!align.empty() && align.size() != shapes.size()) align.clear();
    std::vector<int64_t> off(shapes.size());
    int64_t n_total = 0;
    for (size_t k = 0; k < shapes.size(); ++k) {
      off[k] = n_total;
      n_total += NumelOf(shapes[k].second) + (align.empty() ? 0 : align[k]);
    }
    // An MoE expert group is partitioned over its expert-data-parallel group
    // (partition_count = DP / EP); each of the EP expert-parallel ranks holds
    // its own experts under the same local names.
    int64_t D = dp;
    int E = 1;
    const int64_t recorded = any ? any->groups[g].partition_count : -1;
    if (recorded > 0 && recorded != D) {
      if (dp % recorded == 0 && Experts(shapes)) {
        D = recorded;
        E = static_cast<int>(dp / recorded);
      } else {
        problems.push_back(any->src->rel + ": group " + std::to_string(g) + " has partition_count " +
                           std::to_string(recorded) + " but " + std::to_string(D) +
                           " DP ranks were found, and it is not an MoE expert group");
      }
    }
    const int64_t A = 2 * D;
    const int64_t P = (n_total + A - 1) / A * A;
    const int64_t S = P / D;
    for (int e = 0; e < E; ++e) {
      // The k-th member of expert-parallel rank e's expert-data-parallel group
      // (DeepSpeed's default layout: EP groups are consecutive ranks).
      auto rank_of = [&](int64_t k) { return static_cast<int>(k * E + e); };
      // What the geometry puts on each rank (local names): (numel, start) per
      // parameter, and how long the rank's saved partitions must be.
      std::vector<std::map<std::string, std::pair<int64_t, int64_t>>> placed(D);
      std::vector<int64_t> need(D, 0);
      const std::map<std::string, int> local_experts = E > 1 ? LocalExperts(shapes) : std::map<std::string, int>{};
      for (size_t k = 0; k < shapes.size(); ++k) {
        const auto& [local_name, shape] = shapes[k];
        const std::string name = E > 1 ? GlobalExpertName(local_name, e, local_experts) : local_name;
        LocalParam lp;
        lp.present = true;
        lp.mp = mi;
        lp.group = static_cast<int>(g);
        lp.shape = shape;
        const int64_t n = NumelOf(shape);
        for (int64_t r = 0; r < D; ++r) {
          int64_t lo = std::max(off[k], r * S), hi = std::min(off[k] + n, (r + 1) * S);
          if (lo < hi) lp.pieces.push_back(Piece{rank_of(r), lo - off[k], hi - lo, lo - r * S});
        }
        for (const Piece& pc : lp.pieces) {
          const int64_t r = pc.dp / E;
          placed[r][local_name] = {pc.numel, pc.at};
          need[r] = std::max(need[r], pc.at + pc.numel);
        }
        auto [it, inserted] = param_index.emplace(name, params.size());
        if (inserted) params.push_back(Param{name, std::vector<LocalParam>(tp), ""});
        if (E > 1) experts.insert(name);
        // A parameter several pipeline stages hold (a tied embedding) is read
        // from the first stage, as ds_to_universal.py does for
        // pipeline_replicated_parameter_patterns.
        LocalParam& slot = params[it->second].tp[t];
        if (!slot.present) slot = std::move(lp);
        if (E > 1 && data_before_ep) {
          Break(name, "'" + name +
                          "' is an MoE expert of a run with use_data_before_expert_parallelism, whose "
                          "expert-parallel rank layout ckptfs does not map yet");
        }
      }
      for (int64_t k = 0; k < D; ++k) {
        const int r = rank_of(k);
        OptimRank& o = optim[r][mi];
        if (!o.error.empty()) continue;
        if (g >= o.groups.size()) {
          o.error = o.src->rel + ": has " + std::to_string(o.groups.size()) + " param groups, param_shapes of " +
                    m.src->rel + " has " + std::to_string(m.groups.size());
          problems.push_back(o.error);
          continue;
        }
        const OptimGroup& og = o.groups[g];
        const int64_t pad = S - std::clamp<int64_t>(n_total - k * S, 0, S);
        if (og.recorded_pad >= 0 && og.recorded_pad != pad) {
          const bool spans = P - n_total > S;  // padding reaches below the last rank
          ck.info.Flag(Check::kGeometry, Severity::kWarning, "", o.src->rel,
                       o.src->rel + ": group_paddings[" + std::to_string(g) + "] records " +
                           std::to_string(og.recorded_pad) + ", the geometry (N=" + std::to_string(n_total) +
                           ", D=" + std::to_string(D) + ", S=" + std::to_string(S) + ") gives " + std::to_string(pad) +
                           (spans ? " (padding spans several ranks: the DP=768 case)" : "") +
                           "; a recorded-padding defect: ckptfs uses the recomputed value",
                       nlohmann::json({{"group", g},
                                       {"dp_rank", r},
                                       {"recorded_padding", og.recorded_pad},
                                       {"recomputed_padding", pad},
                                       {"numel", n_total},
                                       {"dp", D},
                                       {"partition_size", S},
                                       {"padding_spans_ranks", spans}})
                           .dump());
        }
        CheckSliceMappings(o, g, std::move(placed[k]), [&](const std::string& local) {
          return E > 1 ? GlobalExpertName(local, e, local_experts) : local;
        });
        for (const auto& [loc, what] : {std::pair{&og.fp32, "fp32 partition"}, std::pair{&og.exp_avg, "exp_avg"},
                                        std::pair{&og.exp_avg_sq, "exp_avg_sq"}}) {
          if (!loc->has_value() || (*loc)->Numel() >= need[k]) continue;
          const std::string why = o.src->rel + ": group " + std::to_string(g) + " " + what + " holds " +
                                  std::to_string((*loc)->Numel()) + " elements; param_shapes need " +
                                  std::to_string(need[k]) + " on this rank (N=" + std::to_string(n_total) +
                                  ", D=" + std::to_string(D) + ")";
          ck.info.Flag(Check::kGeometry, Severity::kError, "", o.src->rel, why + ": its parameters are unreadable",
                       nlohmann::json({{"group", g},
                                       {"dp_rank", r},
                                       {"state", what},
                                       {"recorded_numel", (*loc)->Numel()},
                                       {"recomputed_numel", need[k]},
                                       {"numel", n_total},
                                       {"dp", D},
                                       {"partition_size", S}})
                           .dump());
          for (const auto& [local, shape] : shapes)
            Break(E > 1 ? GlobalExpertName(local, e, local_experts) : local, why);
        }
      }
    }  // expert-parallel ranks
  }
}

void Reader::Break(const std::string& name, const std::string& why) {
  auto it = param_index.find(name);
  if (it != param_index.end() && params[it->second].error.empty()) params[it->second].error = why;
}

// param_slice_mappings[g] of rank `o` (name -> fragment_address(numel, start))
// must say exactly what the geometry placed there; a parameter it contradicts
// is broken (which side is wrong cannot be told).
void Reader::CheckSliceMappings(const OptimRank& o, size_t g, std::map<std::string, std::pair<int64_t, int64_t>> placed,
                                const std::function<std::string(const std::string&)>& global) {
  const OptimGroup& og = o.groups[g];
  if (og.mapping == nullptr || og.mapping->kind != PyKind::kDict) return;
  const std::string where = o.src->rel + ": param_slice_mappings[" + std::to_string(g) + "] ";
  for (const auto& [key, addr] : og.mapping->dict) {
    if (!key->IsStr()) continue;
    const PyValue* numel = addr->Attr("numel");
    const PyValue* start = addr->Attr("start");
    if ((numel == nullptr || start == nullptr) && addr->kind == PyKind::kObject && addr->args().size() == 2) {
      numel = addr->args()[0];
      start = addr->args()[1];
    }
    auto it = placed.find(key->s);
    if (numel == nullptr || start == nullptr || numel->kind != PyKind::kInt || start->kind != PyKind::kInt) {
      Break(global(key->s), where + "has an unreadable fragment_address for '" + key->s + "'");
    } else if (it == placed.end()) {
      Break(global(key->s), where + "gives '" + key->s + "' a fragment (numel=" + std::to_string(numel->i) +
                                ", start=" + std::to_string(start->i) + ") where param_shapes put none");
    } else if (it->second != std::make_pair(numel->i, start->i)) {
      Break(global(key->s), where + "gives '" + key->s + "' (numel=" + std::to_string(numel->i) +
                                ", start=" + std::to_string(start->i) +
                                ") where param_shapes give (numel=" + std::to_string(it->second.first) +
                                ", start=" + std::to_string(it->second.second) + ")");
    }
    if (it != placed.end()) placed.erase(it);
  }
  for (const auto& [name, v] : placed) {
    Break(global(name), where + "has no '" + name + "', which param_shapes place on this rank");
  }
}

// ZeRO-3: every parameter is split on its own: ceil(n/D) elements per rank,
// concatenated per sub-group in param_shapes order.
void Reader::Geometry3(int mi) {
  const ModelStates& m = models[mi];
  const int t = mi % tp;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    int64_t off = 0;
    for (const auto& [name, shape] : m.groups[g]) {
      auto [it, inserted] = param_index.emplace(name, params.size());
      if (inserted) params.push_back(Param{name, std::vector<LocalParam>(tp), ""});
      LocalParam& lp = params[it->second].tp[t];
      lp.present = true;
      lp.mp = mi;
      lp.group = static_cast<int>(g);
      lp.shape = shape;
      const int64_t n = NumelOf(shape), part = (n + dp - 1) / std::max(dp, 1);
      for (int r = 0; r < dp; ++r) {
        int64_t real = std::clamp<int64_t>(n - r * part, 0, part);
        if (real > 0) lp.pieces.push_back(Piece{r, r * part, real, off});
      }
      off += part;
    }
    for (int r = 0; r < dp; ++r) {
      OptimRank& o = optim[r][mi];
      if (!o.error.empty() || g >= o.groups.size()) continue;
      for (const auto* l : {&o.groups[g].fp32, &o.groups[g].exp_avg, &o.groups[g].exp_avg_sq}) {
        if (!l->has_value() || (*l)->Numel() >= off) continue;
        const std::string why = o.src->rel + ": sub-group " + std::to_string(g) + " holds " +
                                std::to_string((*l)->Numel()) + " elements; param_shapes need " + std::to_string(off);
        for (const auto& [name, shape] : m.groups[g]) Break(name, why);
      }
    }
  }
}

void Reader::Geometry() {
  for (int t = 0; t < mp; ++t) {
    if (!models[t].error.empty()) continue;
    if (stage == 3) {
      Geometry3(t);
    } else {
      Geometry12(t);
    }
  }
}

std::string DictKey(const std::string& name, const std::string& state) { return name + "/" + state; }

// One torch.save archive `zero/<name>/<state>.pt` with a dict (or, for
// ZeRO-3, a bare flat tensor), the way ds_to_universal.py saves it. The
// dict's extra keys follow the merge rule; a replicated rule adds none, which
// is also the form of the fp32.pt written from module entries.
Status Reader::ExportState(const std::string& name, const std::string& state, uint32_t tensor, const Rule& rule,
                           bool dict) {
  const TensorRecord& t = ck.tensors[tensor];
  PickleWriter w;
  std::vector<int64_t> shape = t.shape;
  if (!dict) shape = {static_cast<int64_t>(t.Numel())};
  if (dict) {
    w.BeginDict();
    if (rule.kind == Merge::kCat || rule.kind == Merge::kSub2) {
      w.Str("cat_dim");
      w.Int(rule.kind == Merge::kSub2 ? 0 : rule.cat_dim);
    }
    if (rule.kind == Merge::kSub2) {
      w.Str("param_n_sub_params");
      w.Int(2);
    }
    if (rule.kind == Merge::kSubParams) {
      w.Str("sub_param_shape");
      RETURN_IF_ERROR(patterns->WriteSubparamShape(w, name, rule));
    }
    if (rule.vocab) {
      w.Str("vocab_tensor");
      w.Bool(true);
    }
    w.Str("param");
  }
  RETURN_IF_ERROR(w.Tensor("0", DType::kF32, t.Numel(), 0, shape, ContiguousStrides(shape)));
  if (dict) w.EndDict();
  AddArchive("universal/zero/" + name + "/" + state + ".pt", state, w.Finish(),
             {ArchiveStorage{tensor, DType::kF32, t.Numel() * 4, {}}});
  return Status::Ok();
}

void Reader::AddArchive(const std::string& path, const std::string& stem, const std::string& pickle,
                        const std::vector<ArchiveStorage>& storages) {
  ExportFile x;
  x.path = path;
  x.parts = TorchSaveParts(stem, pickle, storages);
  ck.exports.push_back(std::move(x));
}

// params/<p>/step and universal/zero/<p>/step.pt: the group's step on (dp 0,
// tp 0) of the parameter's stage; that the ranks agree is for `ckptfs verify`
// to check.
Status Reader::EmitStep(const Param& p, bool ucp) {
  const OptimRank& o = optim[0][p.tp[0].mp];
  if (!o.error.empty() || static_cast<size_t>(p.tp[0].group) >= o.groups.size()) return Status::Ok();
  const OptimGroup& og = o.groups[static_cast<size_t>(p.tp[0].group)];
  PickleWriter w;
  std::vector<ArchiveStorage> storages;
  if (og.step.has_value() && og.step->Numel() == 1) {
    const Loc& l = *og.step;
    TensorRecord rec;
    rec.key = DictKey(p.name, "step");
    rec.role = Role::kOptimState;
    rec.fqn = p.name;
    rec.state = "step";
    rec.dtype = l.dtype;
    rec.shape = l.shape;
    Fragment f;
    f.file = o.src->file;
    f.dtype = l.dtype;
    f.offsets.assign(l.shape.size(), 0);
    f.lengths = l.shape;
    f.strides = l.strides;
    f.data_offset = l.data_offset;
    f.data_length = DTypeSize(l.dtype);
    uint32_t id = ck.AddTensor(std::move(rec), {std::move(f)});
    RETURN_IF_ERROR(w.Tensor("0", l.dtype, 1, 0, l.shape, ContiguousStrides(l.shape)));
    storages.push_back(ArchiveStorage{id, l.dtype, DTypeSize(l.dtype), {}});
  } else if (og.step_value != nullptr) {
    RETURN_IF_ERROR(w.Value(*og.step_value, [](PickleWriter&, const PyValue&) { return Unsupported("a tensor"); }));
  } else {
    return Status::Ok();
  }
  if (ucp) AddArchive("universal/zero/" + p.name + "/step.pt", "step", w.Finish(), storages);
  return Status::Ok();
}

Status Reader::Emit() {
  ck.info.family = Family::kDeepSpeed;
  const PyValue* root0 = models[root].src->root();
  std::string version;
  if (const PyValue* v = root0->Get("ds_version"); v && v->IsStr()) version = v->s;
  if (const PyValue* v = root0->Get("global_steps"); v && v->kind == PyKind::kInt) ck.info.step = v->i;
  if (const PyValue* v = root0->Get("iteration"); ck.info.step < 0 && v && v->kind == PyKind::kInt) ck.info.step = v->i;
  ck.info.world_size = static_cast<uint32_t>(std::max(tp, 1) * pp * std::max(dp, 1));
  // stage 0: no optimizer file could be read; say whether there were any.
  std::string stage_name = stage != 0          ? "ZeRO-" + std::to_string(stage)
                           : optim_on_disk > 0 ? std::to_string(optim_on_disk) + " ZeRO optimizer files, none readable"
                                               : "no ZeRO optimizer files";
  if (bf16_optimizer) stage_name = "BF16_Optimizer (ZeRO-1 geometry)";
  ck.info.format_note = std::string(pipeline ? "PipelineEngine, " : "") + stage_name + ", TP=" + std::to_string(tp) +
                        " PP=" + std::to_string(pp) + " DP=" + std::to_string(dp) +
                        (version.empty() ? "" : ", ds_version " + version);
  Patterns pats(models[root].uci);
  patterns = &pats;
  if (!pats.present && stage != 0 && stage != 3) {
    problems.push_back(models[root].src->rel +
                       " has no universal_checkpoint_info: every parameter is concatenated on "
                       "dim 0 across TP ranks (as ds_to_universal.py --inject_missing_state does)");
  }
  for (const auto& bad : pats.Unusable()) {
    problems.push_back(models[root].src->rel + ": universal_checkpoint_info pattern '" + bad +
                       "' is not a regular expression ckptfs can compile; parameters it would match are merged as "
                       "if it were absent");
  }
  const bool ucp = stage == 1 || stage == 2 || stage == 3;

  // Optimizer-backed parameters, then the module copy and universal/.
  std::set<std::string> have_fp32;
  for (Param& p : params) EmitParam(p, pats, ucp, have_fp32);
  EmitLostStages();
  std::map<std::string, uint32_t> module_record = EmitModule(pats);
  // An expert whose expert file is missing or unreadable: its model copy is
  // an unreadable record (EIO), never absent.
  for (const std::string& name : experts) {
    bool held = false;
    for (const ModuleCopy& c : module) held = held || c.by_name.count(name) > 0;
    if (held) continue;
    std::string id = "?";
    int i = 0;
    if (RE2::FullMatch(name, ExpertNameRe(), nullptr, &i, nullptr)) id = std::to_string(i);
    TensorRecord rec;
    rec.key = name;
    rec.role = Role::kParam;
    rec.fqn = name;
    rec.state = "param";
    rec.dtype = DType::kF32;
    rec.error = "no expert file holds '" + name + "' (" + prefix + "layer_*_expert_" + id +
                "_mp_rank_*_model_states.pt is missing or unreadable)";
    ck.AddTensor(std::move(rec), {});
  }
  // (Under PipelineEngine the mp_rank files hold no module: the script has
  // nothing to fall back to.)
  if ((stage == 1 || stage == 2) && !pipeline) {
    for (const auto& [name, e] : module[0].entries) {
      if (have_fp32.count(name) || !module_record.count(name) || experts.count(name)) continue;
      const uint32_t id = module_record[name];
      const TensorRecord& t = ck.tensors[id];
      if (!t.error.empty()) continue;
      if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
        problems.push_back("universal/zero/" + name + "/fp32.pt is not generated: '" + name + "' is " +
                           std::string(DTypeName(t.dtype)) + ", and ckptfs widens only floating types to float32");
        continue;
      }
      Status st = ExportState(name, "fp32", id, Rule{Merge::kReplicated, 0, false, {}}, /*dict=*/true);
      if (!st.ok()) problems.push_back("universal/zero/" + name + "/fp32.pt: " + st.message());
    }
  }
  if (ucp && !experts.empty()) {
    problems.push_back("universal/ leaves out the " + std::to_string(experts.size()) +
                       " MoE expert parameters: "
                       "ds_to_universal.py merges DeepSpeed MoE experts by their expert-parallel-local names, which at "
                       "EP > 1 concatenates different experts (it fails), and DeepSpeed's universal loader looks "
                       "them up by local name; params/ serves every expert under its global name "
                       "(deepspeed_experts.<E>, as the expert files name it)");
  }
  if (ucp) {
    Status st = ExportOptimizerState();
    if (!st.ok()) problems.push_back("universal/zero/optimizer_state.pt is not available: " + st.message());
    ExportCopies();
    ExportFile latest;
    latest.path = "latest_universal";
    latest.parts.push_back(ExportPart{PartKind::kLiteral, "universal", 0, DType::kInvalid, 9, {}});
    ck.exports.push_back(std::move(latest));
  }
  for (TensorRecord& t : ck.tensors) {
    if (t.role != Role::kParam && t.role != Role::kOptimState) continue;
    t.split =
        pats.present ? SplitOf(pats.For(t.fqn)) : TensorSplit{tp > 1 ? SplitKind::kDim : SplitKind::kUnknown, 0, 0};
  }
  ck.info.topology =
      "tp" + std::to_string(std::max(tp, 1)) + "-pp" + std::to_string(pp) + "-dp" + std::to_string(std::max(dp, 1));
  if (std::string note = files.PlaceholderNote(); !note.empty()) problems.push_back(std::move(note));
  ck.info.problems = std::move(problems);
  return Status::Ok();
}

// The fp32 master and Adam states of one optimizer-backed parameter: params/
// records (TP-merged, DP fragments joined) and their universal/ archives.
void Reader::EmitParam(Param& p, const Patterns& pats, bool ucp, std::set<std::string>& have_fp32) {
  // Plain ZeRO-3 merges over DP only and saves bare flat tensors; with TP it
  // takes the stage-1/2 TP merge (ds_to_universal.py does the same).
  const bool as_dict = stage != 3 || tp > 1;
  Rule rule = as_dict ? pats.For(p.name) : Rule{};
  std::vector<std::vector<int64_t>> local;
  std::string err = p.error;
  for (int t = 0; t < tp && err.empty(); ++t) {
    if (!p.tp[t].present) {
      if (rule.kind == Merge::kReplicated && t > 0) {
        local.push_back(p.tp[0].shape);
        continue;
      }
      std::string why;
      for (int m = t; m < mp; m += tp) {
        if (!models[m].error.empty()) why = " (" + models[m].error + ")";
      }
      err = "parameter '" + p.name + "' is missing from TP rank " + std::to_string(t) + "'s param_shapes" + why;
    } else {
      local.push_back(p.tp[t].shape);
    }
  }
  if (err.empty() && rule.kind == Merge::kSubParams) {
    Status st = pats.ResolveSub(p.name, local, rule);
    if (!st.ok()) err = "parameter '" + p.name + "': " + st.message();
  }
  Merger merger(rule, local, pats.original_vocab);
  std::vector<int64_t> gshape;
  if (err.empty()) {
    auto gs = merger.GlobalShape();
    if (!gs.ok()) {
      err = "parameter '" + p.name + "': " + gs.status().message();
    } else {
      gshape = *gs;
    }
  }
  for (const char* state : {"fp32", "exp_avg", "exp_avg_sq"}) {
    TensorRecord rec;
    rec.key = DictKey(p.name, state);
    rec.role = Role::kOptimState;
    rec.fqn = p.name;
    rec.state = state;
    rec.dtype = DType::kF32;
    rec.shape = gshape;
    rec.error = err;
    rec.replicas = err.empty() ? merger.Copies() : 1;
    std::vector<Fragment> frags;
    for (int t = 0; t < tp && rec.error.empty(); ++t) {
      if (!merger.UsesRank(t)) continue;
      const LocalParam& lp = p.tp[t];
      for (const Piece& pc : lp.pieces) {
        const OptimRank& o = optim[pc.dp][lp.mp];
        if (!o.error.empty()) {
          rec.error = "parameter '" + p.name + "' needs " + o.src->rel + ": " + o.error;
          break;
        }
        const OptimGroup& og = o.groups[static_cast<size_t>(lp.group)];
        const std::optional<Loc>& l = std::string(state) == "fp32"      ? og.fp32
                                      : std::string(state) == "exp_avg" ? og.exp_avg
                                                                        : og.exp_avg_sq;
        if (!l.has_value()) {
          rec.error = o.src->rel + ": group " + std::to_string(lp.group) + " has no " + state;
          break;
        }
        if (l->dtype != DType::kF32) {
          rec.dtype = l->dtype;
        }
        if (pc.at + pc.numel > l->Numel()) {
          rec.error = o.src->rel + ": group " + std::to_string(lp.group) + " " + state + " has " +
                      std::to_string(l->Numel()) + " elements, '" + p.name + "' needs [" + std::to_string(pc.at) +
                      ", " + std::to_string(pc.at + pc.numel) + ")";
          break;
        }
        AddRangeFragments(merger, t, merger.LocalShape(t), pc.start, pc.numel, o.src->file, l->dtype,
                          l->data_offset + static_cast<uint64_t>(pc.at) * DTypeSize(l->dtype), frags);
      }
    }
    if (!rec.error.empty()) frags.clear();
    const bool bad = !rec.error.empty();
    uint32_t id = ck.AddTensor(std::move(rec), std::move(frags));
    if (!bad && ucp && ck.tensors[id].dtype == DType::kF32 && !experts.count(p.name)) {
      Status st = ExportState(p.name, state, id, rule, as_dict);
      if (!st.ok()) problems.push_back("universal/zero/" + p.name + "/" + state + ".pt: " + st.message());
      if (std::string(state) == "fp32") have_fp32.insert(p.name);
    } else if (bad && ucp && std::string(state) == "fp32") {
      have_fp32.insert(p.name);  // ds_to_universal would fail here too: no silent substitute
    }
  }
  if (stage != 3 && err.empty() && p.tp[0].present && p.tp[0].group >= 0) {
    Status st = EmitStep(p, ucp && !experts.count(p.name));
    if (!st.ok()) problems.push_back("no step for '" + p.name + "': " + st.message());
  }
}

// An unreadable model-states file hides its stage's param_shapes: under
// PipelineEngine the layer files still name that stage's parameters, whose
// optimizer states are then unreadable records naming the file (EIO, never
// absent); it is listed in any case.
void Reader::EmitLostStages() {
  std::set<std::string> lost;
  for (int m = 0; m < mp; ++m) {
    if (models[m].error.empty()) continue;
    problems.push_back(models[m].error + ": the optimizer states of pipeline stage " + std::to_string(m / tp) +
                       ", TP rank " + std::to_string(m % tp) + " have no view");
    if (!pipeline) continue;
    for (const auto& [name, e] : module[m % tp].entries) {
      if (param_index.count(name) || !e.error.empty() || !lost.insert(name).second) continue;
      for (const char* state : {"fp32", "exp_avg", "exp_avg_sq"}) {
        TensorRecord rec;
        rec.key = DictKey(name, state);
        rec.role = Role::kOptimState;
        rec.fqn = name;
        rec.state = state;
        rec.dtype = DType::kF32;
        rec.error = "'" + name + "' needs the param_shapes of " + models[m].error;
        ck.AddTensor(std::move(rec), {});
      }
    }
  }
}

// The model's own copy (module): param per parameter, TP-merged like the
// optimizer states; buffers under other/. ZeRO-3 saves no module. Returns, per
// name, the record holding mp_rank_00's tensor (ds_to_universal.py's fp32.pt
// fallback for names without optimizer state).
std::map<std::string, uint32_t> Reader::EmitModule(const Patterns& pats) {
  std::map<std::string, uint32_t> module_record;
  std::set<std::string> buffers;
  for (const ModelStates& m : models) buffers.insert(m.buffers.begin(), m.buffers.end());
  // TP rank 0's names (a later rank's when rank 0's model states are unreadable).
  size_t lead = 0;
  while (lead + 1 < module.size() && module[lead].entries.empty()) ++lead;
  for (const auto& [name, e0] : module[lead].entries) {
    const bool buffer = buffers.count(name) > 0;
    Rule rule = buffer ? Rule{Merge::kReplicated, 0, false, {}} : pats.For(name);
    std::vector<std::vector<int64_t>> local;
    std::vector<std::optional<Loc>> locs(tp);
    std::vector<ModuleEntry> entries(tp);
    std::string err;
    for (int t = 0; t < tp; ++t) {
      if (t > 0 && rule.kind == Merge::kReplicated) {
        local.push_back(local[0]);
        continue;
      }
      auto found = module[t].by_name.find(name);
      if (found == module[t].by_name.end()) {
        err = "'" + name + "' is missing from TP rank " + std::to_string(t) + "'s model states" +
              (module[t].error.empty() ? std::string() : " (" + module[t].error + ")");
        break;
      }
      entries[t] = found->second;
      if (!found->second.error.empty()) {
        err = "'" + name + "' needs " + found->second.error;
        break;
      }
      auto l = Resolve(*found->second.src, found->second.v, "module['" + name + "']");
      if (!l.ok()) {
        err = l.status().message();
        break;
      }
      locs[t] = *l;
      local.push_back(l->shape);
    }
    if (err.empty() && rule.kind == Merge::kSubParams) {
      Status st = pats.ResolveSub(name, local, rule);
      if (!st.ok()) err = "'" + name + "': " + st.message();
      for (int t = 0; t < tp && err.empty(); ++t) {
        if (!locs[t]->Contiguous())
          err = "'" + name + "' on TP rank " + std::to_string(t) +
                " is not contiguous: its sub-parameter view cannot be taken";
      }
    }
    Merger merger(rule, local, pats.original_vocab);
    TensorRecord rec;
    rec.key = name;
    rec.role = buffer ? Role::kOther : Role::kParam;
    rec.fqn = name;
    rec.state = buffer ? "" : "param";
    rec.dtype = locs[0].has_value() ? locs[0]->dtype : DType::kF32;
    std::vector<Fragment> frags;
    if (err.empty()) {
      auto gs = merger.GlobalShape();
      if (!gs.ok()) {
        err = "'" + name + "': " + gs.status().message();
      } else {
        rec.shape = *gs;
      }
    }
    for (int t = 0; t < tp && err.empty(); ++t) {
      if (!merger.UsesRank(t)) continue;
      AddWholeFragments(merger, t, *locs[t], entries[t].src->file, frags);
    }
    rec.error = err;
    rec.replicas = err.empty() ? merger.Copies() : 1;
    if (!err.empty()) frags.clear();
    uint32_t id = ck.AddTensor(std::move(rec), std::move(frags));
    // ds_to_universal's fallback for names without optimizer state: mp_rank_00's
    // (TP-local) tensor as fp32.
    if (tp == 1 || rule.kind == Merge::kReplicated) {
      module_record[name] = id;
    } else if (locs[0].has_value()) {
      TensorRecord hidden;
      hidden.key = name + " (mp_rank_00)";
      hidden.role = Role::kHidden;
      hidden.dtype = locs[0]->dtype;
      hidden.shape = locs[0]->shape;
      module_record[name] = ck.AddTensor(std::move(hidden), {WholeFragment(*locs[0], entries[0].src->file)});
    }
  }
  return module_record;
}

// universal/zero/optimizer_state.pt: rank (dp 0, tp 0)'s optimizer_state_dict
// without the sharded entries, plus param_groups (ZeRO-3: all of it).
Status Reader::ExportOptimizerState() {
  if (optim.empty() || optim[0].empty()) return Invalid("no optimizer state files");
  const OptimRank& o = optim[0][0];
  if (!o.error.empty()) return Invalid(o.error);
  const PyValue* osd = o.osd;
  PickleWriter w;
  std::vector<ArchiveStorage> storages;
  std::map<std::string, size_t> storage_slot;
  Status tensor_status;
  auto tensor_fn = [&](PickleWriter& pw, const PyValue& v) -> Status {
    // The whole source storage becomes one record of the new archive.
    const TensorRef& ref = v.tensor();
    auto [it, inserted] = storage_slot.emplace(ref.storage_key, storages.size());
    const ZipEntry* e = o.src->archive.zip.Find(o.src->archive.prefix + "/data/" + ref.storage_key);
    if (e == nullptr) return Invalid(o.src->rel + ": no record for storage " + ref.storage_key);
    const uint64_t storage_numel = e->size / DTypeSize(ref.dtype);
    if (inserted) {
      TensorRef whole = ref;
      whole.storage_offset = 0;
      whole.shape = {static_cast<int64_t>(storage_numel)};
      whole.strides = {1};
      ASSIGN_OR_RETURN(ResolvedTensor rt, ResolveTensor(*o.src->reader, o.src->archive, whole));
      TensorRecord rec;
      rec.key = o.src->rel + " storage " + ref.storage_key;
      rec.role = Role::kHidden;
      rec.encoding = Encoding::kBytes;
      rec.dtype = DType::kU8;
      rec.byte_size = storage_numel * DTypeSize(ref.dtype);
      Fragment f;
      f.file = o.src->file;
      f.dtype = DType::kU8;
      f.data_offset = rt.data_offset;
      f.data_length = rec.byte_size;
      storages.push_back(ArchiveStorage{
          ck.AddTensor(std::move(rec), {std::move(f)}), DType::kU8, storage_numel * DTypeSize(ref.dtype), {}});
    }
    return pw.Tensor(std::to_string(it->second), ref.dtype, storage_numel, ref.storage_offset, ref.shape, ref.strides);
  };
  w.BeginDict();
  static const std::set<std::string> kSharded = {"base_optimizer_state", "param_slice_mappings",
                                                 "single_partition_of_fp32_groups"};
  for (const auto& [k, v] : osd->dict) {
    if (stage != 3 && k->IsStr() && kSharded.count(k->s)) continue;
    if (k->IsStr() && k->s == "param_groups") continue;
    RETURN_IF_ERROR(w.Value(*k, tensor_fn));
    RETURN_IF_ERROR(w.Value(*v, tensor_fn));
  }
  const PyValue* groups =
      stage == 3 ? (osd->Get("optimizer_state_dict") ? osd->Get("optimizer_state_dict")->Get("param_groups") : nullptr)
                 : (osd->Get("base_optimizer_state") ? osd->Get("base_optimizer_state")->Get("param_groups") : nullptr);
  if (groups == nullptr) return Invalid(o.src->rel + ": no param_groups");
  w.Str("param_groups");
  RETURN_IF_ERROR(w.Value(*groups, tensor_fn));
  w.EndDict();
  AddArchive("universal/zero/optimizer_state.pt", "optimizer_state", w.Finish(), storages);
  return Status::Ok();
}

// Verbatim copies of the mp_rank_* model-states files (ds_to_universal copies
// them; DeepSpeed's universal loader reads client state from them).
void Reader::ExportCopies() {
  std::vector<const Source*> sources;
  for (const ModelStates& m : models) sources.push_back(m.src.get());
  for (const auto& z : z3_copies) sources.push_back(z.get());
  for (const Source* sp : sources) {
    const Source& s = *sp;
    if (!s.error.empty()) continue;
    const std::string base = s.rel.substr(s.rel.rfind('/') + 1);
    TensorRecord rec;
    rec.key = s.rel;
    rec.role = Role::kHidden;
    const uint64_t size = ck.files[s.file.v].size;
    uint32_t id = ck.AddFileBytes(s.file, std::move(rec));
    ExportFile x;
    x.path = "universal/" + base;
    x.parts.push_back(ExportPart{PartKind::kTensor, "", id, DType::kU8, size, {}});
    ck.exports.push_back(std::move(x));
  }
}

Status Reader::Run() {
  RETURN_IF_ERROR(Discover());
  Geometry();
  return Emit();
}

}  // namespace

bool LooksLikeDeepSpeed(const std::string& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir + "/latest", ec)) return true;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (RE2::FullMatch(n, ModelRe()) || RE2::FullMatch(n, Zero3ModelRe())) return true;
  }
  return false;
}

Result<Checkpoint> ReadDeepSpeed(const std::string& dir) {
  Reader r;
  r.dir = dir;
  RETURN_IF_ERROR(r.Run());
  return std::move(r.ck);
}

}  // namespace ckptfs::formats
