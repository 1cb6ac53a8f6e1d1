// Which tensors of a state dict are parameters and which are optimizer
// states of which parameter, from each tensor's path in the nested dict
// (DCP's planner_data; a torch.save file's dict keys): the rules of docs/tree.md
// "How keys map to params/", shared by every reader of state dicts.
#ifndef CKPTFS_FORMATS_STATE_DICT_ROLES_H_
#define CKPTFS_FORMATS_STATE_DICT_ROLES_H_

#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/model.h"

namespace ckptfs::formats {

// Sets role / fqn / state of every tensor-encoded record; `paths[i]` is
// tensors[i]'s path (dict keys; list indices as decimal strings).
//  - ("model"|"state_dict", <fqn parts>...) -> parameter <fqn> ("state_dict":
//    Lightning's Trainer);
//  - a bare top-level key (no model root, not a known non-model root such
//    as optimizer / lr_scheduler / train_state) -> parameter <key>;
//  - ("optimizer"|"optim"|"optimizer_<k>", "state", <fqn>, <state>...) and the
//    flattened "optimizer.state.<fqn>.<state>" (also optim., optimizer_<k>.:
//    Lightning's Trainer names its k-th optimizer so) -> optimizer state
//    <state> of <fqn>;
//  - anything else -> other/.
// Whether `s` is the top-level key of an optimizer's state dict: "optimizer"
// (torch's get_state_dict, Fabric, Accelerate), "optim" (torchtitan),
// "optimizers", "optimizer_<k>" (Lightning's Trainer: its k-th optimizer).
bool IsOptimizerRoot(std::string_view s);

void ClassifyStateDict(std::vector<TensorRecord>& tensors, const std::vector<std::vector<std::string>>& paths);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_STATE_DICT_ROLES_H_
