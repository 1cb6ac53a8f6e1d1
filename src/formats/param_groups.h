// An optimizer's param groups as dcp/ offers them: what torch's get_state_dict
// names optim.param_groups.<i>.<hyperparameter>, each value a torch.save
// archive (as torch's DCP writer stores a non-tensor entry), ".params" the
// FQNs of group i instead of the optimizer's own ids. Made as internal
// exports "@dcp/<key>" (literal bytes; nothing is read at index time), which
// the dcp/ view serves as bytes entries where the checkpoint has no entry of
// that key itself. Shared by the readers whose sources save groups with
// integer ids (DeepSpeed, verl), names (FSDP rank files) or none (Megatron).
#ifndef CKPTFS_FORMATS_PARAM_GROUPS_H_
#define CKPTFS_FORMATS_PARAM_GROUPS_H_

#include <functional>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"

namespace ckptfs::formats {

// `groups`: the param_groups list of `what` (a file, for errors);
// `params_of(i, value)`: group i's FQNs, from the group's own "params" value
// (the group itself where it has none: Megatron's distributed optimizer
// deletes them, and group i gets a ".params" all the same).
// A tensor-valued hyperparameter, a group that is not a dict or an id with no
// FQN is an error, and nothing is added.
using GroupParamsFn = std::function<Result<std::vector<std::string>>(size_t, const PyValue&)>;
Status AddParamGroupExports(const PyValue& groups, const std::string& what, const GroupParamsFn& params_of,
                            std::vector<ExportFile>& exports);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_PARAM_GROUPS_H_
