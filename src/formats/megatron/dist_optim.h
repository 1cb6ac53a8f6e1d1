// Megatron's distributed-optimizer states in torch_dist checkpoints, mapped to
// params/<fqn>/{fp32,exp_avg,exp_avg_sq} (see dist_reader.h for the rest).
//
// dp_reshardable (the mcore >= 0.15 default): for each model-parallel rank
// M (= tp + TP * pp), DDP buffer g (one per model chunk) and bucket b, three
// flat fp32 tensors
//   optimizer.distributed.dp_group_idx_M.gbuf_idx_g.dtype_(P, G).bucket_idx_b.{param,exp_avg,exp_avg_sq}
// of the bucket's unpadded size, and the ShardedObjects
// per_bucket_numel[_unpadded] (distrib_optimizer.py
// sharded_param_state_dp_reshardable). Nothing names the parameters inside a
// bucket: Megatron itself replays its DDP buffer layout on load
// (param_and_grad_buffer.py). ckptfs replays the same: the parameters of
// model chunk (pp, vp) (layer numbering from args) in reverse
// named_parameters() order (mcore's module registration order for the local
// and the Transformer Engine layer specs), at their TP-local sizes (the split
// rules), each start 64-aligned, a bucket closed when it is full.
//
// A replay is accepted only when it consumes every bucket exactly, agrees
// with per_bucket_numel_unpadded, and every parameter boundary is a chunk
// boundary the writer recorded (each parameter's range in a DP shard is its
// own ShardedTensor); with args.data_parallel_size, every chunk boundary must
// also be a parameter, padding or DP-shard boundary. Otherwise the states of
// that buffer are unreadable with the reason (EIO) and a geometry finding is
// recorded; the weights are unaffected.
#ifndef CKPTFS_FORMATS_MEGATRON_DIST_OPTIM_H_
#define CKPTFS_FORMATS_MEGATRON_DIST_OPTIM_H_

#include <string>

#include "ckptfs/model.h"
#include "formats/megatron/megatron_common.h"

namespace ckptfs::formats::megatron {

// Adds the optimizer-state records of the dp_reshardable buckets in `ck` (a
// torch_dist checkpoint after the layer stacks are split). `dir` is the mount
// source; file rel_paths are relative to it. Notes go to ck.info.problems.
void MapBucketStates(const std::string& dir, const ModelFacts& facts, Checkpoint& ck);

// The distributed optimizer's param groups where its layout keeps them in
// per-DP-rank objects (dp_reshardable, dp_zero_gather_scatter:
// [chained_<i>.]optimizer.distributed.dp_group_idx_M.optimizer/shard_*, each
// [{param_groups: [...]}]): the groups of every model-parallel rank, one per
// identity (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), first
// seen first; a chained optimizer's per member. Empty when there are none,
// one cannot be read, or the members are not numbered 0, 1, ...
PerDpRankGroups DistOptimizerParamGroups(const std::string& dir, const Checkpoint& ck);

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_DIST_OPTIM_H_
