// ZeRO geometry: recomputes where every fragment of every parameter lies in
// the ranks' flat partitions (ZeroStage12Geometry: groups flattened, padded to
// 2*D, split in D; ZeroStage3Geometry: each parameter split on its own; MoE
// expert groups over their expert-data-parallel ranks). Contract: recorded
// paddings, partition lengths and param_slice_mappings are checked against the
// result, never trusted; a contradiction breaks only the parameters it touches.
#include <re2/re2.h>

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/geometry.h"
#include "formats/deepspeed/ds_internal.h"

namespace ckptfs::formats::deepspeed {

const RE2& ExpertNameRe() {
  static const RE2 r(R"((.*\.deepspeed_experts\.)(\d+)(\..*))", RE2::Latin1);
  return r;
}

namespace {

// Whether every parameter of a group is an MoE expert.
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

}  // namespace

// ZeRO-1/2 and BF16_Optimizer: groups flattened in param_shapes order (with
// optional per-parameter alignment gaps), padded to a multiple of 2*D at the
// end only, split into D partitions of S elements.
void Reader::ZeroStage12Geometry(int mi) {
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
          MarkParamBroken(name, "'" + name +
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
            MarkParamBroken(E > 1 ? GlobalExpertName(local, e, local_experts) : local, why);
        }
      }
    }  // expert-parallel ranks
  }
}

// Parameter `name` becomes unreadable for `why`; an earlier reason stays.
void Reader::MarkParamBroken(const std::string& name, const std::string& why) {
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
      MarkParamBroken(global(key->s), where + "has an unreadable fragment_address for '" + key->s + "'");
    } else if (it == placed.end()) {
      MarkParamBroken(global(key->s), where + "gives '" + key->s + "' a fragment (numel=" + std::to_string(numel->i) +
                                          ", start=" + std::to_string(start->i) + ") where param_shapes put none");
    } else if (it->second != std::make_pair(numel->i, start->i)) {
      MarkParamBroken(global(key->s), where + "gives '" + key->s + "' (numel=" + std::to_string(numel->i) +
                                          ", start=" + std::to_string(start->i) +
                                          ") where param_shapes give (numel=" + std::to_string(it->second.first) +
                                          ", start=" + std::to_string(it->second.second) + ")");
    }
    if (it != placed.end()) placed.erase(it);
  }
  for (const auto& [name, v] : placed) {
    MarkParamBroken(global(name), where + "has no '" + name + "', which param_shapes place on this rank");
  }
}

// ZeRO-3: every parameter is split on its own: ceil(n/D) elements per rank,
// concatenated per sub-group in param_shapes order.
void Reader::ZeroStage3Geometry(int mi) {
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
        for (const auto& [name, shape] : m.groups[g]) MarkParamBroken(name, why);
      }
    }
  }
}

// The fragments of every parameter of every readable model-states file, by
// the checkpoint's ZeRO stage.
void Reader::ComputeGeometry() {
  for (int t = 0; t < mp; ++t) {
    if (!models[t].error.empty()) continue;
    if (stage == 3) {
      ZeroStage3Geometry(t);
    } else {
      ZeroStage12Geometry(t);
    }
  }
}

}  // namespace ckptfs::formats::deepspeed
