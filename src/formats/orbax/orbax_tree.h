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

// topo/'s split of each array of the item whose `_sharding` is at `path`, by
// param name: the dimension sharded over a tensor-parallel mesh axis (by
// name: model, tensor, tensor_transpose, tensor_sequence, tp, mp), or
// replicated when none is. Empty when the file is absent or unreadable.
std::map<std::string, TensorSplit> SplitsOf(const std::string& path);

// "data=2 x model=4" from the first NamedSharding of `_sharding` at `path`,
// and its device count; empty when there is none.
std::string MeshOf(const std::string& path, uint32_t* devices);

}  // namespace ckptfs::formats::orbax

#endif  // CKPTFS_FORMATS_ORBAX_ORBAX_TREE_H_
