// Meta's convention for hf/ (ckptfs/hf_names.h HfConvention): a Llama
// config.json from the params.json beside Meta's consolidated.NN.pth (and
// anything else under Meta's names: torchtitan's, Mistral's consolidated).
#ifndef CKPTFS_FORMATS_TORCHSAVE_META_HF_H_
#define CKPTFS_FORMATS_TORCHSAVE_META_HF_H_

#include "ckptfs/hf_names.h"

namespace ckptfs::formats {

const hf::HfConvention& MetaHfConvention();

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_META_HF_H_
