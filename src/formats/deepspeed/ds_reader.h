// DeepSpeed checkpoints (ZeRO-1/2, BF16_Optimizer, ZeRO-3), read from
// metadata only: the torch.save pickles of `mp_rank_XX_model_states.pt` and
// `[bf16_|fp16_]zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt`.
//
// Geometry is recomputed, never trusted: for each flat param group the
// parameters' sizes (param_shapes, in flat order, plus per-parameter
// alignment gaps when recorded), alignment 2*D, padded size P, partition
// S = P/D, per-rank real/padding lengths. Every fragment of every parameter
// follows from that; param_slice_mappings and partition lengths are checked
// against it (a contradiction breaks the affected parameters), and a recorded
// group_paddings that disagrees (BF16_Optimizer's last-rank rule, the DP=768
// case) is reported in checkpoint.json and ignored.
//
// TP ranks are merged by universal_checkpoint_info's patterns exactly as
// ds_to_universal.py merges them (replicated, cat dim 0/1, two sub-params on
// dim 0, vocabulary padding stripped); the results are both params/<name>/
// tensors and the archives of universal/ (ExportFile), which are laid out
// in universal_export.cc with the torch.save writer (ds_internal.h maps the
// reader's steps to its files).
#ifndef CKPTFS_FORMATS_DEEPSPEED_DS_READER_H_
#define CKPTFS_FORMATS_DEEPSPEED_DS_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"

namespace ckptfs::formats {

bool LooksLikeDeepSpeed(const std::string& dir);
Result<Checkpoint> ReadDeepSpeed(const std::string& dir);
// How DeepSpeed's pickles are read: its modules allowed, its enums known
// (ZeroStageEnum, pickled by name or by value).
const PickleOptions& DeepSpeedPickleOptions();

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_DEEPSPEED_DS_READER_H_
