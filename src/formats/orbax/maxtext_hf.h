// MaxText's convention for hf/ (ckptfs/hf_names.h HfConvention): its Llama,
// Mistral and Gemma 2 decoders (token_embedder, decoder.layers..., Flax
// kernels [in..., out...], scanned layers stacked on axis 1) mapped as
// MaxText's own to_huggingface maps them.
#ifndef CKPTFS_FORMATS_ORBAX_MAXTEXT_HF_H_
#define CKPTFS_FORMATS_ORBAX_MAXTEXT_HF_H_

#include "ckptfs/hf_names.h"

namespace ckptfs::formats {

const hf::HfConvention& MaxTextHfConvention();

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ORBAX_MAXTEXT_HF_H_
