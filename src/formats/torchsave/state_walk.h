// Walking a torch.save state dict (shared by the torch.save readers): every
// tensor leaf with its path of dict keys / list indices.
#ifndef CKPTFS_FORMATS_TORCHSAVE_STATE_WALK_H_
#define CKPTFS_FORMATS_TORCHSAVE_STATE_WALK_H_

#include <string>
#include <vector>

#include "formats/pickle.h"

namespace ckptfs::formats {

struct Leaf {
  std::vector<std::string> path;
  const PyValue* v;  // a tensor, or a DTensor / ShardedTensor object
};

// A DTensor / ShardedTensor as the pickle VM keeps it (a
// _rebuild_wrapper_subclass object: one rank's piece of a tensor).
bool IsDTensor(const PyValue* v);
bool IsShardedTensor(const PyValue* v);

// Appends every tensor / DTensor / ShardedTensor under `v` to `out`; other leaves are counted
// in `skipped`; nesting deeper than 32 sets `too_deep`.
void WalkStateDict(const PyValue* v, std::vector<std::string>& path, std::vector<Leaf>& out, size_t* skipped,
                   bool* too_deep);

std::string JoinPath(const std::vector<std::string>& p);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_STATE_WALK_H_
