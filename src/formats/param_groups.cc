#include "formats/param_groups.h"

#include "formats/pickle_writer.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::formats {

Status AddParamGroupExports(const PyValue& groups, const std::string& what, const GroupParamsFn& params_of,
                            std::vector<ExportFile>& exports) {
  if (!groups.IsSeq()) return Invalid(what + ": param_groups is not a list");
  auto no_tensors = [](PickleWriter&, const PyValue&) -> Status {
    return Unsupported("a tensor-valued hyperparameter (torch.save of it needs a storage ckptfs does not make)");
  };
  std::vector<ExportFile> out;
  for (size_t i = 0; i < groups.items.size(); ++i) {
    const PyValue& g = *groups.items[i];
    if (g.kind != PyKind::kDict) return Invalid(what + ": param group " + std::to_string(i) + " is not a dict");
    for (const auto& [k, v] : g.dict) {
      if (!k->IsStr()) continue;
      PickleWriter w;
      if (k->s == "params") {
        ASSIGN_OR_RETURN(std::vector<std::string> fqns, params_of(i, *v));
        w.BeginList();
        for (const std::string& n : fqns) w.Str(n);
        w.EndList();
      } else if (Status st = w.Value(*v, no_tensors); !st.ok()) {
        return st.Annotate(what + ": param group " + std::to_string(i) + " '" + k->s + "'");
      }
      ExportFile x;
      x.path = "@dcp/optim.param_groups." + std::to_string(i) + "." + k->s;
      x.parts = TorchSaveParts("archive", w.Finish(), {});
      out.push_back(std::move(x));
    }
  }
  for (ExportFile& x : out) exports.push_back(std::move(x));
  return Status::Ok();
}

}  // namespace ckptfs::formats
