// Checkpoints where every rank torch.saves its own shard of the state dict:
//
// - verl's FSDP checkpoints (verl/utils/checkpoint/fsdp_checkpoint_manager.py):
//   model_world_size_<W>_rank_<R>.pt / optim_world_size_<W>_rank_<R>.pt
//   (+ extra_state_… with the lr scheduler and RNG, fsdp_config.json,
//   huggingface/ with the config and tokenizer).
// - Accelerate / HF Trainer FSDP without DCP (accelerate.utils.save_fsdp_model /
//   save_fsdp_optimizer with use_dcp=False, or LOCAL_STATE_DICT):
//   pytorch_model_fsdp[_<N>]_rank<R>.bin / optimizer[_<N>]_rank<R>.bin.
//
// A value is the rank's piece of a tensor:
// - a DTensor (FSDP2): its local shard, placements and global shape. On a 1-D
//   mesh, Shard(d): the ranks' shards in rank order along d; Replicate: the
//   lowest rank's copy. On an N-D mesh (HSDP's ("ddp", "fsdp")): each piece is
//   placed by the rank's mesh coordinate (DeviceMesh._coordinate_on_dim) the
//   way torch computes it, its local shape checked, replicas read once.
//   A DTensor whose DeviceMesh names another rank than its file is refused.
// - a ShardedTensor (FSDP1 SHARDED_STATE_DICT, and LOCAL_STATE_DICT's flat
//   parameter): its local shards with their offsets and the global size.
// - a plain tensor (optimizer steps, buffers): replicated, the lowest rank's copy.
// The pieces of a tensor must tile it exactly (formats/tiling). verl's integer
// optimizer ids are mapped to parameter names by position, checked against the
// shapes; FSDP optimizer state dicts are keyed by name already.
// Refused per tensor with the reason: _StridedShard (FSDP + TP) and Partial
// placements. Replicas are not compared with each other.
#ifndef CKPTFS_FORMATS_TORCHSAVE_RANK_FILES_READER_H_
#define CKPTFS_FORMATS_TORCHSAVE_RANK_FILES_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeRankFiles(const std::string& dir);
Result<Checkpoint> ReadRankFiles(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_RANK_FILES_READER_H_
