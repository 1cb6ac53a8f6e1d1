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
    auto add = [&](const std::string& key, std::string pickle) {
      ExportFile x;
      x.path = "@dcp/optim.param_groups." + std::to_string(i) + "." + key;
      x.parts = TorchSaveParts("archive", std::move(pickle), {});
      out.push_back(std::move(x));
    };
    auto names = [&](const PyValue& v) -> Result<std::string> {
      ASSIGN_OR_RETURN(std::vector<std::string> fqns, params_of(i, v));
      PickleWriter w;
      w.BeginList();
      for (const std::string& n : fqns) w.Str(n);
      w.EndList();
      return w.Finish();
    };
    for (const auto& [k, v] : g.dict) {
      if (!k->IsStr()) continue;
      if (k->s == "params") {
        ASSIGN_OR_RETURN(std::string p, names(*v));
        add(k->s, std::move(p));
        continue;
      }
      PickleWriter w;
      if (Status st = w.Value(*v, no_tensors); !st.ok()) {
        return st.Annotate(what + ": param group " + std::to_string(i) + " '" + k->s + "'");
      }
      add(k->s, w.Finish());
    }
    if (g.Get("params") == nullptr) {  // deleted before saving (Megatron's distributed optimizer)
      ASSIGN_OR_RETURN(std::string p, names(g));
      add("params", std::move(p));
    }
  }
  for (ExportFile& x : out) exports.push_back(std::move(x));
  return Status::Ok();
}

}  // namespace ckptfs::formats
