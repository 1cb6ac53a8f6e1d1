#include "ckptfs/formats.h"
#include "formats/dcp/dcp_reader.h"
#include "formats/deepspeed/ds_reader.h"
#include "formats/megatron/dist_reader.h"
#include "formats/megatron/legacy_reader.h"
#include "formats/safetensors/st_dir_reader.h"
#include "formats/torchsave/pt_reader.h"
#include "formats/torchsave/rank_files_reader.h"

namespace ckptfs {

namespace {
ReadLimits g_limits;
}  // namespace

void SetReadLimits(const ReadLimits& limits) { g_limits = limits; }
const ReadLimits& GetReadLimits() { return g_limits; }

namespace {

// Checks every reader's output once: shapes and boxes (CheckTensorGeometry),
// and names: every name a view shows is valid UTF-8 (see EscapeNonUtf8): the pickle VM
// escapes what it reads; this covers names from file and directory names
// (zarr arrays) and says so once in checkpoint.json.
Checkpoint Sanitized(Checkpoint ck) {
  size_t n = 0;
  std::string first;
  // Geometry: the one place every reader's shapes and boxes are checked.
  for (size_t i = 0; i < ck.tensors.size(); ++i) {
    TensorRecord& t = ck.tensors[i];
    if (t.encoding != Encoding::kTensor) continue;
    if (std::string why; t.error.empty() && !(why = CheckTensorGeometry(t, ck.fragments.Get(i))).empty()) {
      t.error = "cannot index '" + t.key + "': " + why;
      ck.info.problems.push_back(t.error);
      ck.fragments.Clear(i);
      t.num_fragments = 0;
    }
    if (DTypeSize(t.dtype) != 0 && !CheckTensorGeometry(t, {}).empty()) {
      t.shape.assign(1, 0);  // no size can be served; the error says what it was, open() is EIO
      t.byte_size = 0;
    }
  }
  for (TensorRecord& t : ck.tensors) {
    for (std::string* s : {&t.key, &t.fqn, &t.state}) {
      if (IsUtf8(*s)) continue;
      *s = EscapeNonUtf8(*s);
      if (n++ == 0) first = *s;
    }
  }
  if (n > 0) {
    ck.info.problems.push_back(std::to_string(n) + " tensor names are not valid UTF-8; shown with each invalid byte as %XX (first: " +
                               first + ")");
  }
  return ck;
}

Status CannotDetect(const std::string& dir) {
  return Unsupported("cannot detect a checkpoint in " + dir +
                     ": no .metadata / __<rank>.metadata (PyTorch DCP; an incomplete DCP save leaves only .metadata.tmp), no "
                     "latest / mp_rank_XX_model_states.pt (DeepSpeed), no "
                     "latest_checkpointed_iteration.txt / mp_rank_XX/model_optim_rng.pt (Megatron-LM), no *.safetensors, no torch.save .pt / .pth / .bin");
}

// The families in detection order: the first whose probe (names only)
// recognises a directory reads it.
struct FamilyProbe {
  bool (*looks)(const std::string&);
  Result<Checkpoint> (*read)(const std::string&);
};
constexpr FamilyProbe kFamilies[] = {
    // Megatron's torch_dist is a DCP checkpoint with metadata.json beside it: first.
    {&formats::LooksLikeMegatronDist, &formats::ReadMegatronDist},
    {&formats::LooksLikeDcp, &formats::ReadDcp},
    {&formats::LooksLikeDeepSpeed, &formats::ReadDeepSpeed},
    {&formats::LooksLikeMegatronLegacy, &formats::ReadMegatronLegacy},
    // After those: a Trainer checkpoint-N/ holds model.safetensors beside its DeepSpeed files.
    {&formats::LooksLikeSafetensorsDir, &formats::ReadSafetensorsDir},
    {&formats::LooksLikeRankFiles, &formats::ReadRankFiles},  // per-rank torch.save files (verl, Accelerate)
    {&formats::LooksLikeTorchSaveDir, &formats::ReadTorchSaveDir},
};

Result<Checkpoint> Detect(const std::string& dir) {
  for (const FamilyProbe& f : kFamilies) {
    if (f.looks(dir)) return f.read(dir);
  }
  return CannotDetect(dir);
}

}  // namespace

Status Recognise(const std::string& dir) {
  for (const FamilyProbe& f : kFamilies) {
    if (f.looks(dir)) return Status::Ok();
  }
  return CannotDetect(dir);
}

Result<Checkpoint> ReadCheckpoint(const std::string& dir) {
  ASSIGN_OR_RETURN(Checkpoint ck, Detect(dir));
  return Sanitized(std::move(ck));
}

}  // namespace ckptfs
