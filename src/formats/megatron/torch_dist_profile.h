// Megatron-LM's torch_dist layout as a DCP profile (formats.h DcpProfile):
// torch_dist/latest_checkpointed_iteration.txt and torch_dist/iter_N/ with
// metadata.json, common.pt and a DCP whose keys are megatron-core's sharded
// keys, the distributed optimizer's state in its fully_reshardable layout,
// so that megatron-core's dist_checkpointing.load (Megatron-LM's
// load_checkpoint) reshards it to any TP / PP / DP.
//
// Keys, as mcore 0.16's GPTModel.sharded_state_dict and
// DistributedOptimizer.sharded_state_dict (fully_reshardable) name them:
//   - decoder.layers.<module>.<param>: the layers stacked on a leading axis
//     of num_layers (global layer numbers, so any PP / VP split reads it);
//     the local spec's layer norms under their fused names
//     (input_layernorm. -> self_attention.linear_qkv.layer_norm_,
//     pre_mlp_layernorm. -> mlp.linear_fc1.layer_norm_, the spec's
//     sharded_state_dict_keys_map, and Transformer Engine's own names);
//   - embedding.*, decoder.final_layernorm.*, output_layer.*: as named;
//   - decoder.layers.mlp.experts.experts.*: SequentialMLP's experts, stacked
//     on layer and expert axes ([L, E, ...]);
//   - optimizer.state.{param,exp_avg,exp_avg_sq}.<key>: the fp32 master
//     (or, without one, the weight) and Adam's moments, same boxes; with
//     experts, chained_0.optimizer.* (dense) and chained_1.optimizer.*
//     (experts), megatron-core's ChainedOptimizer prefixes;
//   - decoder.layers.<linear>._extra_state/shard_<l>_<L> (experts':
//     shard_<l>.<e>_<L>.<E>): the linear layers' extra state (None: the
//     local spec's), one per layer.
// Tensors at their stored rows (a padded vocabulary keeps its padding: mcore
// loads embeddings with allow_shape_mismatch at the new padding). common.pt
// is the reader's kCommonPickle (megatron_common.h). SwiGLU's linear_fc1 is
// already [gate; up] in params/, which is mcore's global layout.
//
// Absent (with the reason) for a run whose common state cannot be made, for
// grouped-GEMM experts, and for names without an mcore sharded key (legacy
// GPTModel module names).
#ifndef CKPTFS_FORMATS_MEGATRON_TORCH_DIST_PROFILE_H_
#define CKPTFS_FORMATS_MEGATRON_TORCH_DIST_PROFILE_H_

#include "ckptfs/formats.h"

namespace ckptfs::formats::megatron {

DcpProfile TorchDistProfile(const DcpProfileInput& in);

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_TORCH_DIST_PROFILE_H_
