// Plain torch.save checkpoints: a directory whose state lives in one or more
// torch.save archives rather than a sharded format:
// - one nested state dict (`torch.save({"model": ..., "optimizer": ...})`,
//   torch's own dcp_to_torch_save output, a bare `model.pt` / `consolidated.00.pth`
//   / `pytorch_model.bin` of parameter names);
// - Accelerate / HF Trainer FSDP FULL_STATE_DICT: pytorch_model_fsdp.bin (the
//   model) beside optimizer.bin ({"state": {fqn: ...}, "param_groups"});
// - HF `pytorch_model-0000k-of-0000n.bin` shards (each tensor whole in one).
// Tensors map to params/ by their dict paths (state_dict_roles.h), optimizer
// files as if under an "optimizer" key. Trainer bookkeeping (rng_state*,
// training_args.bin, scheduler.pt, scaler.pt, random_states*) is not read.
// Meta's model-parallel consolidated.0X.pth (several) go to meta_consolidated.h.
#ifndef CKPTFS_FORMATS_TORCHSAVE_PT_READER_H_
#define CKPTFS_FORMATS_TORCHSAVE_PT_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeTorchSaveDir(const std::string& dir);
Result<Checkpoint> ReadTorchSaveDir(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_PT_READER_H_
