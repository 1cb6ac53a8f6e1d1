// Megatron-LM's hooks for the generic views (formats.h FamilyReader): its
// split rules by parameter name, and its legacy per-rank archives
// (iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt + the iteration tracker)
// laid out at a topo/ plan's degrees from the index alone.
#ifndef CKPTFS_FORMATS_MEGATRON_NATIVE_FILES_H_
#define CKPTFS_FORMATS_MEGATRON_NATIVE_FILES_H_

#include <optional>
#include <string>

#include "ckptfs/formats.h"

namespace ckptfs::formats::megatron {

// Megatron's split of a parameter named `fqn` (mcore or legacy names), for
// checkpoints whose reader records none; SwiGLU's two-part rule is left to
// the readers, which know whether the run used it.
std::optional<TensorSplit> SplitByName(const std::string& fqn);

// The archives and the tracker; empty when the index holds no run args
// (kArgsPickle).
Result<NativeFiles> NativeRankFiles(const NativeFilesInput& in);

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_NATIVE_FILES_H_
