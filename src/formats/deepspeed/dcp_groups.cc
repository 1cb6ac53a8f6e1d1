// DeepSpeed's param groups for dcp/ (formats/param_groups.h): the base
// optimizer's hyperparameters (ZeRO-1/2, BF16_Optimizer: base_optimizer_state;
// ZeRO-3: optimizer_state_dict) as DP rank 0 of the first stage saved them
// (every rank steps with the same ones), ".params" the FQNs of
// param_shapes[i] in the order the flat group holds them (stages after one
// another under PipelineEngine) instead of the optimizer's integer ids. A MoE
// expert group, which each expert-parallel rank saves with its own experts
// under local numbers, lists every rank's experts under their global names
// (the zero geometry's): the group a non-EP loader steps them all in.
#include <string>
#include <vector>

#include "formats/deepspeed/ds_internal.h"
#include "formats/param_groups.h"

namespace ckptfs::formats::deepspeed {

Status Reader::ExportParamGroups() {
  if (optim.empty() || optim[0].empty()) return Invalid("no optimizer state files");
  const OptimRank& o = optim[0][0];
  if (!o.error.empty()) return Invalid(o.error);
  const PyValue* holder = o.osd->Get(stage == 3 ? "optimizer_state_dict" : "base_optimizer_state");
  const PyValue* groups = holder != nullptr ? holder->Get("param_groups") : nullptr;
  if (groups == nullptr || !groups->IsSeq()) return Invalid(o.src->rel + ": no param_groups list");
  std::vector<std::vector<std::string>> names(groups->items.size());
  for (const Param& p : params) {
    if (p.tp.empty() || !p.tp[0].present || p.tp[0].group < 0) continue;
    const auto g = static_cast<size_t>(p.tp[0].group);
    if (g >= names.size()) {
      return Invalid(o.src->rel + " has " + std::to_string(names.size()) + " param groups, but '" + p.name +
                     "' is in group " + std::to_string(g));
    }
    names[g].push_back(p.name);
  }
  return AddParamGroupExports(
      *groups, o.src->rel, [&](size_t i, const PyValue&) -> Result<std::vector<std::string>> { return names[i]; },
      ck.exports);
}

}  // namespace ckptfs::formats::deepspeed
