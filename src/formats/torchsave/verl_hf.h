// verl's convention for hf/ (ckptfs/hf_names.h HfConvention): where its
// checkpoints keep the model's config.json and tokenizer (huggingface/).
#ifndef CKPTFS_FORMATS_TORCHSAVE_VERL_HF_H_
#define CKPTFS_FORMATS_TORCHSAVE_VERL_HF_H_

#include "ckptfs/hf_names.h"

namespace ckptfs::formats {

const hf::HfConvention& VerlHfConvention();

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_VERL_HF_H_
