// Megatron-LM's convention for hf/ (ckptfs/hf_names.h HfConvention): its
// mcore names (legacy GPTModel names rewritten first) mapped onto each
// target architecture, and the target recognised and its config.json
// synthesized from the run's args (the args.json the readers export).
#ifndef CKPTFS_FORMATS_MEGATRON_HF_CONVENTION_H_
#define CKPTFS_FORMATS_MEGATRON_HF_CONVENTION_H_

#include "ckptfs/hf_names.h"

namespace ckptfs::formats::megatron {

const hf::HfConvention& MegatronHfConvention();

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_HF_CONVENTION_H_
