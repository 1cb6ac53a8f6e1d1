// verl's FSDP checkpoints (verl/utils/checkpoint/fsdp_checkpoint_manager.py):
// every rank torch.saves its own model.state_dict() and optimizer.state_dict()
// as model_world_size_<W>_rank_<R>.pt / optim_world_size_<W>_rank_<R>.pt
// (+ extra_state_… with the lr scheduler and RNG, fsdp_config.json,
// huggingface/ with the config and tokenizer). Under FSDP2 each value is a
// DTensor: the rank's local shard, its placements and the global shape. The
// reader places each rank's shard (Shard(d): the ranks' shards in rank order
// along d; Replicate: rank 0's copy) and maps the optimizer's integer ids to
// parameter names by position, checked against the shapes.
// Handled: 1-D meshes (verl's "fsdp" mesh). 2-D meshes (HSDP, FSDP + TP),
// _StridedShard and Partial placements, and FSDP1 ShardedTensor files are
// refused per tensor with the reason.
#ifndef CKPTFS_FORMATS_TORCHSAVE_VERL_READER_H_
#define CKPTFS_FORMATS_TORCHSAVE_VERL_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeVerl(const std::string& dir);
Result<Checkpoint> ReadVerl(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_VERL_READER_H_
