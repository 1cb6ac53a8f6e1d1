// param_shapes where the model-states file has none: DeepSpeed <= 0.15 wrote
// MoE checkpoints (engine._save_moe_checkpoint) without param_shapes,
// buffer_names or ds_version, so nothing says how the ZeRO-1/2 flat groups
// are laid out. Every optimizer file still records param_slice_mappings
// (name -> fragment_address(numel, start) within its partition), and the
// module copy (mp_rank_XX's module and the layer_L_expert_E files) gives
// each parameter's shape: the groups are rebuilt from those, in flat order,
// and ZeroStage12Geometry then checks them like recorded ones.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle.h"

namespace ckptfs::formats::deepspeed {
namespace {

// (numel, start) of a fragment_address (a namedtuple or its reconstruction).
bool FragmentAddress(const PyValue* addr, int64_t* numel, int64_t* start) {
  const PyValue* n = addr->Attr("numel");
  const PyValue* s = addr->Attr("start");
  if ((n == nullptr || s == nullptr) && addr->kind == PyKind::kObject && addr->args().size() == 2) {
    n = addr->args()[0];
    s = addr->args()[1];
  }
  if (n == nullptr || s == nullptr || n->kind != PyKind::kInt || s->kind != PyKind::kInt) return false;
  *numel = n->i;
  *start = s->i;
  return true;
}

}  // namespace

// Rebuilds models[mi].groups from the optimizer files of model-parallel rank
// mi; an error says what is missing or does not add up (the caller reports
// it, and the parameters then have no optimizer state).
Status Reader::SynthesizeParamShapes(int mi) {
  const OptimRank* first = dp > 0 ? &optim[0][mi] : nullptr;
  if (first == nullptr || !first->error.empty()) return Invalid("the first DP rank's optimizer file is unreadable");
  const ModuleCopy& mod = module[mi % tp];
  std::vector<Shapes> groups(first->groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    // An expert group is partitioned over an expert-data-parallel group of
    // D = partition_count ranks: ranks k * E (k < D) hold expert-parallel
    // rank 0's experts, whose local names are also their global names.
    const int64_t recorded = first->groups[g].partition_count;
    const int64_t D = recorded > 0 ? recorded : dp;
    if (D <= 0 || dp % D != 0) {
      return Invalid("group " + std::to_string(g) + " has partition_count " + std::to_string(recorded) + " for DP " +
                     std::to_string(dp));
    }
    const int64_t E = dp / D;
    std::map<std::string, std::pair<int64_t, int64_t>> at;  // name -> (first flat offset, elements seen)
    for (int64_t k = 0; k < D; ++k) {
      const OptimRank& o = optim[static_cast<size_t>(k * E)][mi];
      if (!o.error.empty()) return Invalid(o.src->rel + " is unreadable");
      if (g >= o.groups.size() || o.groups[g].mapping == nullptr || o.groups[g].mapping->kind != PyKind::kDict ||
          !o.groups[g].fp32.has_value()) {
        return Invalid(o.src->rel + ": group " + std::to_string(g) + " has no param_slice_mappings");
      }
      const int64_t S = first->groups[g].fp32->Numel();
      for (const auto& [key, addr] : o.groups[g].mapping->dict) {
        int64_t numel = 0, start = 0;
        if (!key->IsStr() || !FragmentAddress(addr, &numel, &start) || numel < 0 || start < 0) {
          return Invalid(o.src->rel + ": param_slice_mappings[" + std::to_string(g) + "] has an unreadable entry");
        }
        if (start > S || numel > S - start) {  // also keeps the sums below from overflowing
          return Invalid(o.src->rel + ": param_slice_mappings[" + std::to_string(g) + "] puts '" + key->s +
                         "' outside the rank's " + std::to_string(S) + "-element partition");
        }
        auto [it, fresh] = at.emplace(key->s, std::make_pair(k * S + start, numel));
        if (!fresh) {
          it->second.first = std::min(it->second.first, k * S + start);
          it->second.second += numel;
        }
      }
    }
    std::vector<std::pair<int64_t, std::string>> order;
    for (const auto& [name, v] : at) order.emplace_back(v.first, name);
    std::sort(order.begin(), order.end());
    int64_t next = 0;
    for (const auto& [offset, name] : order) {
      auto m = mod.by_name.find(name);
      if (m == mod.by_name.end() || m->second.v == nullptr || m->second.v->kind != PyKind::kTensor) {
        return Invalid("'" + name + "' of group " + std::to_string(g) + " has no shape in the module copy");
      }
      ASSIGN_OR_RETURN(Loc loc, Resolve(*m->second.src, m->second.v, name));
      if (offset != next || at[name].second != loc.Numel()) {
        return Invalid("the slices of '" + name + "' in group " + std::to_string(g) + " are not " +
                       std::to_string(loc.Numel()) + " elements at flat offset " + std::to_string(next));
      }
      next += loc.Numel();
      groups[g].emplace_back(name, loc.shape);
    }
  }
  models[mi].groups = std::move(groups);
  return Status::Ok();
}

}  // namespace ckptfs::formats::deepspeed
