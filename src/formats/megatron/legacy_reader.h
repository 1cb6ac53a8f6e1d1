// Megatron-LM's legacy `torch` checkpoint format, read from metadata only:
// <save>/latest_checkpointed_iteration.txt and
// iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt (+ distrib_optim.pt).
//
// params/ shows the global model. TP ranks are merged by each parameter's
// split rule (megatron_common.h), pipeline stages and virtual-pipeline chunks
// are renumbered to global layer indices from args. Replicated tensors (norms,
// row-parallel biases) are compared across TP ranks at index time and
// non-layer names held by several stages across PP ranks; a difference is
// reported in checkpoint.json (with the max abs difference) and rank 0 / the
// first stage is served.
//
// Optimizer states: the non-distributed optimizer's torch state dict is
// matched to parameters by replaying Megatron's param groups (weight decay on
// matrices, none on biases and 1-D tensors, named_parameters order) and
// checked shape by shape; the distributed optimizer's distrib_optim.pt by
// replaying the DDP buffer layout (parameters in reverse order, each start
// aligned to 64 elements, one bucket) and checking the total against
// numel_unpadded. Where that does not hold, checkpoint.json says which states
// are unavailable and why; nothing is guessed.
#ifndef CKPTFS_FORMATS_MEGATRON_LEGACY_READER_H_
#define CKPTFS_FORMATS_MEGATRON_LEGACY_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeMegatronLegacy(const std::string& dir);
Result<Checkpoint> ReadMegatronLegacy(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_MEGATRON_LEGACY_READER_H_
