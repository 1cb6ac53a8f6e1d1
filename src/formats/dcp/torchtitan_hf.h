// torchtitan's convention for hf/ (ckptfs/hf_names.h HfConvention): its
// Llama 3 / Qwen3 / Qwen3-MoE names (Meta's reference names, which its DCP
// checkpoints keep) mapped as its own state-dict adapters' to_hf map them.
#ifndef CKPTFS_FORMATS_DCP_TORCHTITAN_HF_H_
#define CKPTFS_FORMATS_DCP_TORCHTITAN_HF_H_

#include "ckptfs/hf_names.h"

namespace ckptfs::formats {

const hf::HfConvention& TorchtitanHfConvention();

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_DCP_TORCHTITAN_HF_H_
