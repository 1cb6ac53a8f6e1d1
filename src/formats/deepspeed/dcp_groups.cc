// The optimizer's param groups for dcp/: what torch's get_state_dict names
// optim.param_groups.<i>.<hyperparameter>, each a torch.save archive of the
// value (as torch's DCP writer stores a non-tensor entry), with ".params" the
// FQNs of group i (DeepSpeed's param_shapes[i], the order the flat group holds
// them) instead of the optimizer's own integer ids. The hyperparameters are
// the base optimizer's (ZeRO-1/2, BF16_Optimizer: base_optimizer_state;
// ZeRO-3: optimizer_state_dict), as DP rank 0 of the first stage saved them:
// every rank steps with the same ones. Internal exports "@dcp/<key>", which
// the dcp/ view turns into bytes entries; nothing is read at index time.
#include <map>
#include <string>
#include <vector>

#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::formats::deepspeed {

Status Reader::ExportParamGroups() {
  if (optim.empty() || optim[0].empty()) return Invalid("no optimizer state files");
  if (!experts.empty()) {
    return Unsupported(
        "MoE expert groups hold each expert-parallel rank's local experts, which have no single global list");
  }
  const OptimRank& o = optim[0][0];
  if (!o.error.empty()) return Invalid(o.error);
  const PyValue* holder = o.osd->Get(stage == 3 ? "optimizer_state_dict" : "base_optimizer_state");
  const PyValue* groups = holder != nullptr ? holder->Get("param_groups") : nullptr;
  if (groups == nullptr || (!groups->IsSeq())) {
    return Invalid(o.src->rel + ": no param_groups list");
  }
  // Group i's FQNs: every parameter whose flat group is i, in that order
  // (stages after one another under PipelineEngine).
  std::vector<std::vector<std::string>> names(groups->items.size());
  for (const Param& p : params) {
    const LocalParam& lp = p.tp.empty() ? LocalParam{} : p.tp[0];
    if (!lp.present || lp.group < 0) continue;
    if (static_cast<size_t>(lp.group) >= names.size()) {
      return Invalid(o.src->rel + " has " + std::to_string(names.size()) + " param groups, but '" + p.name +
                     "' is in group " + std::to_string(lp.group));
    }
    names[static_cast<size_t>(lp.group)].push_back(p.name);
  }
  auto no_tensors = [&](PickleWriter&, const PyValue&) -> Status {
    return Unsupported("a tensor-valued hyperparameter (torch.save of it needs a storage ckptfs does not make)");
  };
  std::vector<ExportFile> out;
  for (size_t i = 0; i < groups->items.size(); ++i) {
    const PyValue& g = *groups->items[i];
    if (g.kind != PyKind::kDict) return Invalid(o.src->rel + ": param group " + std::to_string(i) + " is not a dict");
    for (const auto& [k, v] : g.dict) {
      if (!k->IsStr()) continue;
      PickleWriter w;
      if (k->s == "params") {
        w.BeginList();
        for (const std::string& n : names[i]) w.Str(n);
        w.EndList();
      } else if (Status st = w.Value(*v, no_tensors); !st.ok()) {
        return Status(st.code(), "param group " + std::to_string(i) + " '" + k->s + "': " + st.message());
      }
      ExportFile x;
      x.path = "@dcp/optim.param_groups." + std::to_string(i) + "." + k->s;
      x.parts = TorchSaveParts("archive", w.Finish(), {});
      out.push_back(std::move(x));
    }
  }
  for (ExportFile& x : out) ck.exports.push_back(std::move(x));
  return Status::Ok();
}

}  // namespace ckptfs::formats::deepspeed
