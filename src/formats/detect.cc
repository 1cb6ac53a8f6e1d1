#include "ckptfs/formats.h"
#include "formats/dcp/dcp_reader.h"
#include "formats/deepspeed/ds_reader.h"
#include "formats/megatron/dist_reader.h"
#include "formats/megatron/legacy_reader.h"

namespace ckptfs {

Result<Checkpoint> ReadCheckpoint(const std::string& dir) {
  // Megatron's torch_dist is a DCP checkpoint with metadata.json beside it: first.
  if (formats::LooksLikeMegatronDist(dir)) return formats::ReadMegatronDist(dir);
  if (formats::LooksLikeDcp(dir)) return formats::ReadDcp(dir);
  if (formats::LooksLikeDeepSpeed(dir)) return formats::ReadDeepSpeed(dir);
  if (formats::LooksLikeMegatronLegacy(dir)) return formats::ReadMegatronLegacy(dir);
  return Unsupported("cannot detect a checkpoint in " + dir +
                     ": no .metadata (PyTorch DCP; an incomplete DCP save leaves only .metadata.tmp) and no "
                     "latest / mp_rank_XX_model_states.pt (DeepSpeed), no "
                     "latest_checkpointed_iteration.txt / mp_rank_XX/model_optim_rng.pt (Megatron-LM)");
}

}  // namespace ckptfs
