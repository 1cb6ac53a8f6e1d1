// Megatron-LM dist_checkpointing directories (iter_XXXXXXX/ with metadata.json):
// the torch_dist backend (a PyTorch DCP checkpoint whose keys are
// ShardedTensor keys, read by the DCP reader) and the zarr backend (one zarr v2
// array per key, zarr_reader), plus common.pt. What Megatron adds on top:
//  * `optimizer.state.<state>.<model key>` (fully_reshardable, and the zarr-era
//    model-shaped DistOpt states) become params/<model key>/<state>
//    (param / fp32_param -> fp32).
//  * Homogeneous layer stacks `...layers.<param>` with a leading layer axis are
//    shown per layer as params/...layers.<i>.<param> (fragments sliced, no
//    copy) and whole under other/.
//  * dp_reshardable per-bucket states (`optimizer.distributed.*`) are mapped
//    to params/<fqn>/<state> by replaying the DDP buffers (dist_optim.h); the
//    bucket tensors and ShardedObjects also stay under other/. common.pt is
//    served verbatim as other/common.pt and gives the step and args.json.
// N-D flattened optimizer states (fully_sharded_model_space, the mcore
// 0.8-0.14 default: flattened_range ShardedTensors) are recognised by their
// shape against the parameter's and read back at the parameter's shape.
#ifndef CKPTFS_FORMATS_MEGATRON_DIST_READER_H_
#define CKPTFS_FORMATS_MEGATRON_DIST_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeMegatronDist(const std::string& dir);
Result<Checkpoint> ReadMegatronDist(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_MEGATRON_DIST_READER_H_
