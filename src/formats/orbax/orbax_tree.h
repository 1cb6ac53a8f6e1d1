// What the Orbax family makes of a pytree and its shardings: the project's
// tree for orbax's param paths, topo/ split rules from the PartitionSpecs in
// `_sharding`, and the mesh for checkpoint.json.
#ifndef CKPTFS_FORMATS_ORBAX_ORBAX_TREE_H_
#define CKPTFS_FORMATS_ORBAX_ORBAX_TREE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ckptfs/model.h"

namespace ckptfs::formats::orbax {

// The project's tree for an orbax pytree path (the keys of one leaf):
// params.<path> -> parameter <path> ("params.params.<path>", flax's variables,
// when every parameter has it); opt_state.<...>.mu|nu|trace.<path> -> optimizer
// state exp_avg | exp_avg_sq | momentum_buffer of <path>; anything else
// other/. Sets role, fqn and state of each record.
void ClassifyPytree(std::vector<TensorRecord>& tensors, const std::vector<std::vector<std::string>>& paths);

// An item's `_sharding` (at `path`): topo/'s split of each array by param
// name, from its PartitionSpec (the dimension sharded over a tensor-parallel
// mesh axis, by name: model, tensor, tensor_transpose, tensor_sequence, tp,
// mp; else replicated), and the mesh ("data=2 x model=4") with its device
// count. Empty when the file is absent or unreadable.
struct Sharding {
  std::map<std::string, TensorSplit> splits;
  std::string mesh;
  uint32_t devices = 0;
};
Sharding ReadSharding(const std::string& path);

}  // namespace ckptfs::formats::orbax

#endif  // CKPTFS_FORMATS_ORBAX_ORBAX_TREE_H_
