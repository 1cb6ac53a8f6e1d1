#include "ckptfs/topo.h"

#include <re2/re2.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckptfs/formats.h"
#include "formats/tp_merge.h"

namespace ckptfs {
namespace {

bool ParseInt(std::string_view s, int* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && *out > 0;
}

// Name conventions for checkpoints whose reader records no rule (DCP):
// torchtitan Llama and Hugging Face Llama names, then Megatron's.
std::optional<TensorSplit> ConventionSplit(const std::string& fqn) {
  TensorSplit s;
  s.kind = SplitKind::kDim;
  if (auto dim = formats::LlamaLinearSplitDim(fqn)) {
    if (*dim < 0)
      s.kind = SplitKind::kReplicate;
    else
      s.dim = *dim;
    return s;
  }
  for (const char* vocab : {"tok_embeddings.weight", "embed_tokens.weight", "lm_head.weight"}) {
    if (EndsWith(fqn, vocab)) return s;
  }
  if (fqn == "output.weight") return s;
  for (const FamilyReader& reader : FamilyReaders()) {  // the families' own names (Megatron's)
    if (reader.split_by_name == nullptr) continue;
    if (auto s = reader.split_by_name(fqn)) return s;
  }
  return std::nullopt;
}

std::string RuleText(const TensorSplit& s, const char* source) {
  switch (s.kind) {
    case SplitKind::kReplicate:
      return std::string("replicated (") + source + ")";
    case SplitKind::kDim:
      return "dim " + std::to_string(s.dim) + (s.groups ? " in " + std::to_string(s.groups) + " groups" : "") +
             (s.pad_rows ? ", vocabulary padded with zero rows" : "") + " (" + source + ")";
    case SplitKind::kSub2:
      return std::string("two sub-parameters on dim 0 (") + source + ")";
    default:
      return std::string("replicated (") + source + ")";
  }
}

bool IsEmbedding(const std::string& fqn) {
  for (const char* e : {"embed", "wte.", "wpe.", "word_embeddings", "position_embeddings"}) {
    if (Contains(fqn, e)) return true;
  }
  return false;
}

std::string TensorName(const TensorRecord& t) {
  return t.role == Role::kParam && t.state == "param" ? t.fqn : "optimizer.state." + t.fqn + "." + t.state;
}

}  // namespace

std::optional<Topology> Topology::Parse(std::string_view name) {
  Topology t;
  bool have_tp = false, have_pp = false;
  size_t pos = 0;
  int part = 0;
  while (pos <= name.size()) {
    size_t dash = name.find('-', pos);
    std::string_view tok = name.substr(pos, dash == std::string_view::npos ? std::string_view::npos : dash - pos);
    pos = dash == std::string_view::npos ? name.size() + 1 : dash + 1;
    if (tok.size() < 3) return std::nullopt;
    std::string_view k = tok.substr(0, 2);
    int v = 0;
    if (!ParseInt(tok.substr(2), &v) || v > 1 << 20) return std::nullopt;
    // Order is fixed: tp, pp, dp, ep.
    if (k == "tp" && part == 0) {
      t.tp = v;
      have_tp = true;
      part = 1;
    } else if (k == "pp" && part == 1) {
      t.pp = v;
      have_pp = true;
      part = 2;
    } else if (k == "dp" && part == 2) {
      t.dp = v;
      part = 3;
    } else if (k == "ep" && part >= 2 && part <= 3) {
      t.ep = v;
      part = 4;
    } else
      return std::nullopt;
  }
  if (!have_tp || !have_pp) return std::nullopt;
  return t;
}

std::string Topology::Name() const {
  std::string s = "tp" + std::to_string(tp) + "-pp" + std::to_string(pp);
  if (dp > 0) s += "-dp" + std::to_string(dp);
  if (ep > 0) s += "-ep" + std::to_string(ep);
  return s;
}

Result<std::vector<int64_t>> ParsePpLayers(std::string_view text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t c = text.find(',', pos);
    std::string_view tok = text.substr(pos, c == std::string_view::npos ? std::string_view::npos : c - pos);
    int v = 0;
    if (tok == "0")
      v = 0;
    else if (!ParseInt(tok, &v))
      return Invalid("--pp-layers '" + std::string(text) + "': expected layer counts like 3,5");
    out.push_back(v);
    if (c == std::string_view::npos) break;
    pos = c + 1;
  }
  return out;
}

Status ParseRulesFile(const std::string& path, TopoOptions& opts) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot read the rules file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  auto bad = [&](const std::string& why) { return Invalid("rules file " + path + ": " + why); };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (j.contains("pp_layers")) {
    if (!j["pp_layers"].is_array()) return bad("pp_layers must be a list of layer counts");
    opts.pp_layers.clear();
    for (const auto& v : j["pp_layers"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) return bad("pp_layers must be a list of layer counts");
      opts.pp_layers.push_back(v.get<int64_t>());
    }
  }
  if (!j.contains("rules")) return Status::Ok();
  if (!j["rules"].is_array()) return bad("rules must be a list");
  for (size_t i = 0; i < j["rules"].size(); ++i) {
    const auto& r = j["rules"][i];
    const std::string where = "rules[" + std::to_string(i) + "]";
    if (!r.is_object() || !r.contains("match") || !r["match"].is_string())
      return bad(where + " needs a \"match\" regex");
    RuleEntry e;
    e.pattern = r["match"].get<std::string>();
    RE2::Options re_opts;
    re_opts.set_log_errors(false);
    auto re = std::make_shared<const RE2>(e.pattern, re_opts);
    if (!re->ok()) return bad(where + ": '" + e.pattern + "' is not a regular expression (" + re->error() + ")");
    e.re = std::move(re);
    if (r.contains("split")) {
      if (!r["split"].is_string()) return bad(where + ": split must be replicate, dim or sub2");
      const std::string k = r["split"].get<std::string>();
      TensorSplit s;
      if (k == "replicate") {
        s.kind = SplitKind::kReplicate;
      } else if (k == "dim") {
        s.kind = SplitKind::kDim;
        if (!r.contains("dim") || !r["dim"].is_number_integer() || r["dim"].get<int64_t>() < 0) {
          return bad(where + ": split \"dim\" needs \"dim\": <non-negative int>");
        }
        s.dim = static_cast<int32_t>(r["dim"].get<int64_t>());
      } else if (k == "sub2") {
        s.kind = SplitKind::kSub2;
      } else {
        return bad(where + ": split must be replicate, dim or sub2, not '" + k + "'");
      }
      if (r.contains("groups")) {
        if (!r["groups"].is_number_integer() || r["groups"].get<int64_t>() < 1)
          return bad(where + ": groups must be >= 1");
        s.groups = r["groups"].get<int64_t>();
      }
      e.split = s;
    }
    if (r.contains("stage")) {
      if (!r["stage"].is_string() || (r["stage"] != "first" && r["stage"] != "last")) {
        return bad(where + ": stage must be \"first\" or \"last\"");
      }
      e.stage = r["stage"].get<std::string>();
    }
    if (!e.split && !e.stage) return bad(where + " sets neither split nor stage");
    opts.rules.push_back(std::move(e));
  }
  return Status::Ok();
}

// The layer a parameter belongs to: `layers.<i>` (and the other names HF and
// Megatron use), or a leading `<i>.`: DeepSpeed PipelineModule's layer spec
// index (BLOOM / Megatron-DeepSpeed `GPTModelPipe`, an nn.Sequential).
// Names are untrusted: RE2 (linear time, no recursion); an index that does
// not fit int64 is no layer.
int64_t LayerOf(const std::string& fqn) {
  static const RE2 kLayer(R"((?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$))", RE2::Latin1);
  static const RE2 kSpec(R"(^(\d+)\.)", RE2::Latin1);
  int64_t i = -1;
  if (RE2::PartialMatch(fqn, kLayer, &i) || RE2::PartialMatch(fqn, kSpec, &i)) return i;
  return -1;
}

int64_t ExpertOf(const std::string& fqn) {
  static const RE2 kExpert(R"((?:^|\.)local_experts\.(\d{1,9})\.)", RE2::Latin1);
  int64_t i = -1;
  if (RE2::PartialMatch(fqn, kExpert, &i)) return i;
  return -1;
}

Result<TopoPlan> PlanTopology(const Index& index, const Topology& topo, const TopoOptions& opts) {
  TopoPlan plan;
  plan.topo = topo;
  const std::string view = "topo/" + topo.Name();
  const auto& tensors = index.tensors();
  // Which records take part, and the global layer count.
  std::vector<uint32_t> ids;
  std::map<std::string, std::vector<int64_t>> param_shape;
  int64_t max_layer = -1;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    if ((t.role != Role::kParam && t.role != Role::kOptimState) || t.encoding != Encoding::kTensor) continue;
    if (!t.error.empty()) {
      return Invalid(view + ": '" + t.key + "' is unreadable (" + t.error + "), so no rank can hold it");
    }
    ids.push_back(i);
    if (t.state == "param") param_shape[t.fqn] = t.shape;
    max_layer = std::max(max_layer, LayerOf(t.fqn));
    plan.num_experts = std::max(plan.num_experts, ExpertOf(t.fqn) + 1);
  }
  if (ids.empty()) return Invalid(view + ": the checkpoint has no parameters to reshard");
  plan.num_layers = max_layer + 1;
  const int EP = std::max(topo.ep, 1);
  if (EP > 1 && plan.num_experts == 0) {
    return Invalid(view + ": the checkpoint has no MoE experts (local_experts.<i>) to place on expert-parallel ranks");
  }
  if (plan.num_experts % EP != 0) {
    return Invalid(view + ": " + std::to_string(plan.num_experts) +
                   " experts per layer do not divide by EP=" + std::to_string(EP));
  }
  const int64_t local_experts = plan.num_experts / EP;
  if (EP > 1 && topo.dp > 0) {
    return Unsupported(view + ": DeepSpeed-style -dp partitions are not laid out for expert-parallel views");
  }

  // Pipeline stages.
  const int64_t L = plan.num_layers;
  if (!opts.pp_layers.empty()) {
    if (static_cast<int>(opts.pp_layers.size()) != topo.pp) {
      return Invalid(view + ": --pp-layers gives " + std::to_string(opts.pp_layers.size()) +
                     " stages, the view has PP=" + std::to_string(topo.pp));
    }
    int64_t sum = 0;
    for (int64_t n : opts.pp_layers) sum += n;
    if (sum != L) {
      return Invalid(view + ": --pp-layers assigns " + std::to_string(sum) + " layers; the checkpoint has " +
                     std::to_string(L));
    }
    int64_t at = 0;
    for (int64_t n : opts.pp_layers) {
      plan.stage_layers.emplace_back(at, at + n);
      at += n;
    }
  } else {
    if (topo.pp > 1 && L % topo.pp != 0) {
      return Invalid(view + ": " + std::to_string(L) + " layers do not divide evenly into PP=" +
                     std::to_string(topo.pp) + " stages (give --pp-layers, e.g. in a --rules file)");
    }
    const int64_t per = topo.pp > 0 ? L / topo.pp : 0;
    for (int p = 0; p < topo.pp; ++p) plan.stage_layers.emplace_back(p * per, (p + 1) * per);
  }
  if (topo.pp > 1 && L == 0)
    return Invalid(view + ": no layers.<i> (or pipeline <i>.) parameters, so there is nothing to split into stages");

  // A lookup names the degrees: bound what it can make the daemon hold.
  constexpr uint64_t kMaxRanks = 1 << 16, kMaxSlices = 1 << 23;
  const uint64_t ranks = static_cast<uint64_t>(topo.tp) * static_cast<uint64_t>(topo.pp) * static_cast<uint64_t>(EP);
  if (ranks > kMaxRanks) {
    return Invalid(view + ": " + std::to_string(ranks) + " model-parallel ranks (more than " +
                   std::to_string(kMaxRanks) + ")");
  }
  uint64_t slices = 0;
  plan.ranks.resize(ranks);
  for (int p = 0; p < topo.pp; ++p) {
    for (int e = 0; e < EP; ++e) {
      for (int t = 0; t < topo.tp; ++t) {
        RankPlan& r = plan.ranks[(static_cast<size_t>(p) * EP + e) * topo.tp + t];
        r.tp = t;
        r.pp = p;
        r.ep = e;
      }
    }
  }
  const int T = topo.tp;
  for (uint32_t i : ids) {
    const TensorRecord& rec = tensors[i];
    // Split rule.
    std::optional<TensorSplit> split;
    const char* source = "no rule";
    std::optional<std::string> stage_override;
    for (const RuleEntry& e : opts.rules) {
      if (!RE2::PartialMatch(rec.fqn, *e.re)) continue;
      if (e.split && !split) {
        split = e.split;
        source = "rules file";
      }
      if (e.stage && !stage_override) stage_override = e.stage;
    }
    if (!split && rec.split.kind != SplitKind::kUnknown) {
      split = rec.split;
      source = "checkpoint family";
    }
    if (!split) {
      split = ConventionSplit(rec.fqn);
      if (split) source = "name convention";
    }
    TensorSplit s = split.value_or(TensorSplit{SplitKind::kReplicate, 0, 0});
    // A state of another shape than its parameter (a scalar step) is replicated.
    auto ps = param_shape.find(rec.fqn);
    const bool same_shape = ps == param_shape.end() || ps->second == rec.shape;
    const std::vector<int64_t> shape = PlacedShape(rec);
    if (!same_shape || (s.kind == SplitKind::kDim && static_cast<size_t>(s.dim) >= shape.size()) ||
        (s.kind == SplitKind::kSub2 && shape.empty())) {
      s = TensorSplit{SplitKind::kReplicate, 0, 0};
      source = same_shape ? "too few dims" : "shape differs from the parameter";
    }
    const std::string rule = RuleText(s, source);
    if (T > 1 && s.kind == SplitKind::kDim) {
      const int64_t n = shape[s.dim];
      if (n % T != 0 && !(s.pad_rows && s.dim == 0)) {
        return Invalid(view + ": '" + rec.key + "' has " + std::to_string(n) + " along dim " + std::to_string(s.dim) +
                       ", which does not divide by TP=" + std::to_string(T) + " (rule: " + rule + ")");
      }
      if (s.groups > 0 && s.groups % T != 0) {
        return Invalid(view + ": '" + rec.key + "' holds " + std::to_string(s.groups) +
                       " attention query groups along dim " + std::to_string(s.dim) + ", which TP=" +
                       std::to_string(T) + " cannot split without cutting a group (rule: " + rule + ")");
      }
    }
    if (T > 1 && s.kind == SplitKind::kSub2 && shape[0] % (2 * T) != 0) {
      return Invalid(view + ": '" + rec.key + "' has two sub-parameters of " + std::to_string(shape[0]) +
                     "/2 rows, which do not divide by TP=" + std::to_string(T) + " (rule: " + rule + ")");
    }
    // Stage.
    int stage;
    const int64_t layer = LayerOf(rec.fqn);
    if (layer >= 0) {
      stage = 0;
      for (int p = 0; p < topo.pp; ++p) {
        if (layer >= plan.stage_layers[p].first && layer < plan.stage_layers[p].second) stage = p;
      }
    } else if (stage_override) {
      stage = *stage_override == "first" ? 0 : topo.pp - 1;
    } else {
      stage = IsEmbedding(rec.fqn) ? 0 : topo.pp - 1;
    }
    const int64_t expert = ExpertOf(rec.fqn);
    const int e_first = expert >= 0 ? static_cast<int>(expert / local_experts) : 0;
    const int e_end = expert >= 0 ? e_first + 1 : EP;
    for (int t = 0; t < T; ++t) {
      RankTensor rt;
      rt.id = TensorId{i};
      rt.name = TensorName(rec);
      rt.rule = rule;
      rt.shape = shape;
      Box whole{std::vector<int64_t>(shape.size(), 0), shape};
      if (s.kind == SplitKind::kDim && T > 1) {
        // Padded vocabulary: ceil(rows / T) rows per rank, zero rows at the end.
        const int64_t rows = shape[s.dim], n = (rows + T - 1) / T;
        const int64_t lo = std::min(rows, t * n), hi = std::min(rows, (t + 1) * n);
        whole.offsets[s.dim] = lo;
        whole.lengths[s.dim] = hi - lo;
        rt.shape[s.dim] = n;
        if (hi > lo) rt.pieces.push_back(whole);
        rt.zero_tail = static_cast<uint64_t>((n - (hi - lo)) * (NumelOf(shape) / std::max<int64_t>(rows, 1)));
      } else if (s.kind == SplitKind::kSub2 && T > 1) {
        const int64_t half = shape[0] / 2, n = half / T;
        for (int64_t base : {int64_t{0}, half}) {
          Box b = whole;
          b.offsets[0] = base + t * n;
          b.lengths[0] = n;
          rt.pieces.push_back(b);
        }
        rt.shape[0] = 2 * n;
      } else {
        rt.pieces.push_back(whole);
      }
      for (int e = e_first; e < e_end; ++e) {  // an expert: its EP rank; the rest: every EP rank
        if (++slices > kMaxSlices) {
          return Invalid(view + ": the plan would hold more than " + std::to_string(kMaxSlices) + " tensor slices");
        }
        plan.ranks[(static_cast<size_t>(stage) * EP + e) * T + t].tensors.push_back(rt);
      }
    }
  }
  return plan;
}

}  // namespace ckptfs
