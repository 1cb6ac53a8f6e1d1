#include "ckptfs/formats.h"
#include "formats/dcp/dcp_reader.h"
#include "formats/dcp/torchtitan_hf.h"
#include "formats/deepspeed/ds_reader.h"
#include "formats/megatron/dist_reader.h"
#include "formats/megatron/hf_convention.h"
#include "formats/megatron/legacy_reader.h"
#include "formats/megatron/native_files.h"
#include "formats/megatron/torch_dist_profile.h"
#include "formats/orbax/maxtext_hf.h"
#include "formats/orbax/orbax_reader.h"
#include "formats/safetensors/st_dir_reader.h"
#include "formats/torchsave/meta_hf.h"
#include "formats/torchsave/pt_reader.h"
#include "formats/torchsave/rank_files_reader.h"
#include "formats/torchsave/verl_hf.h"

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
    ck.info.problems.push_back(
        std::to_string(n) + " tensor names are not valid UTF-8; shown with each invalid byte as %XX (first: " + first +
        ")");
  }
  return ck;
}

FamilyReader Row(std::string_view name, int priority, std::string_view marks, std::string_view after,
                 bool (*looks)(const std::string&), Result<Checkpoint> (*read)(const std::string&),
                 std::vector<FamilyTraits> yields) {
  FamilyReader r;
  r.name = name;
  r.priority = priority;
  r.marks = marks;
  r.after = after;
  r.looks = looks;
  r.read = read;
  r.yields = std::move(yields);
  return r;
}

// A reader row with the hooks its family gives the views.
FamilyReader WithMegatronHooks(FamilyReader r) {
  r.split_by_name = &formats::megatron::SplitByName;
  r.native_files = &formats::megatron::NativeRankFiles;
  r.native_files_key = "megatron_native";
  r.dcp_profile = &formats::megatron::TorchDistProfile;
  r.hf = &formats::megatron::MegatronHfConvention();
  return r;
}

// A reader row with its family's hf/ convention.
FamilyReader WithHf(FamilyReader r, const hf::HfConvention& c) {
  r.hf = &c;
  return r;
}

// The readers in detection order (FamilyReader::priority, ascending): the
// first whose probe (names only) recognises a directory reads it. Where two
// probes can both match, `after` says why this one comes later; the order is
// checked by tests/unit/conformance/reader_conformance_test.cc.
const std::vector<FamilyReader>& Table() {
  using F = Family;
  using NC = NameConvention;
  // clang-format off
  static const std::vector<FamilyReader> kReaders = {
      WithMegatronHooks(Row("megatron-dist", 10,
       "metadata.json with sharded_backend (Megatron-LM dist_checkpointing), or a NeMo / Megatron-Bridge run "
       "holding one",
       "", &formats::LooksLikeMegatronDist, &formats::ReadMegatronDist,
       // id                    name (checkpoint.json, --family)  title                     names        layers checked
       {{F::kMegatronTorchDist, "megatron-torch_dist",            "Megatron-LM torch_dist", NC::kMegatron, true},
        {F::kMegatronZarr,      "megatron-zarr",                  "Megatron-LM zarr",       NC::kMegatron, true}})),
      WithHf(Row("pytorch-dcp", 20,
       ".metadata / __<rank>.metadata (PyTorch DCP; an incomplete DCP save leaves only .metadata.tmp)",
       "Megatron's torch_dist is a DCP checkpoint with metadata.json beside it",
       &formats::LooksLikeDcp, &formats::ReadDcp,
       {{F::kPytorchDcp, "pytorch-dcp", "PyTorch DCP", NC::kTorch, false}}), formats::TorchtitanHfConvention()),
      Row("deepspeed", 30,
       "latest / mp_rank_XX_model_states.pt (DeepSpeed)",
       "", &formats::LooksLikeDeepSpeed, &formats::ReadDeepSpeed,
       {{F::kDeepSpeed, "deepspeed", "DeepSpeed (ZeRO, pipeline, MoE)", NC::kTorch, false}}),
      WithMegatronHooks(Row("megatron-legacy", 40,
       "latest_checkpointed_iteration.txt / mp_rank_XX/model_optim_rng.pt (Megatron-LM)",
       "", &formats::LooksLikeMegatronLegacy, &formats::ReadMegatronLegacy,
       {{F::kMegatronLegacy, "megatron-legacy", "Megatron-LM legacy torch format", NC::kMegatron, true}})),
      Row("safetensors", 50,
       "*.safetensors",
       "an HF Trainer checkpoint-N/ holds model.safetensors beside its DeepSpeed files",
       &formats::LooksLikeSafetensorsDir, &formats::ReadSafetensorsDir,
       {{F::kSafetensors, "safetensors", "Hugging Face safetensors", NC::kTorch, false}}),
      WithHf(Row("rank-files", 60,
       "per-rank torch.save files (verl model_world_size_W_rank_R.pt, Accelerate pytorch_model_fsdp_0_rank<R>.bin)",
       "a directory of rank files is also a directory of torch.save files",
       &formats::LooksLikeRankFiles, &formats::ReadRankFiles,
       {{F::kVerl,           "verl",            "verl FSDP rank files",       NC::kTorch, false},
        {F::kAccelerateFsdp, "accelerate-fsdp", "Accelerate FSDP rank files", NC::kTorch, false}}),
       formats::VerlHfConvention()),
      WithHf(Row("torch-save", 70,
       "torch.save .pt / .pth / .bin (Meta consolidated.NN.pth included)",
       "", &formats::LooksLikeTorchSaveDir, &formats::ReadTorchSaveDir,
       {{F::kTorchSave,        "torch-save",        "torch.save files",         NC::kTorch, false},
        {F::kMetaConsolidated, "meta-consolidated", "Meta consolidated.NN.pth", NC::kTorch, false}}),
       formats::MetaHfConvention()),
      WithHf(Row("orbax", 80,
       "_CHECKPOINT_METADATA / _METADATA with manifest.ocdbt or array_metadatas/ (orbax-checkpoint: a "
       "CheckpointManager root, a step or an item directory; unfinished *.orbax-checkpoint-tmp saves are never read)",
       "", &formats::LooksLikeOrbax, &formats::ReadOrbax,
       {{F::kOrbax, "orbax", "Orbax (JAX: OCDBT, zarr v2/v3)", NC::kJax, false}}),
       formats::MaxTextHfConvention()),
  };
  // clang-format on
  return kReaders;
}

Status CannotDetect(const std::string& dir) {
  std::string marks;
  for (const FamilyReader& r : Table()) marks += std::string(marks.empty() ? "" : ", ") + "no " + std::string(r.marks);
  return Unsupported("cannot detect a checkpoint in " + dir + ": " + marks);
}

// The reader --family names, or why none does.
Result<const FamilyReader*> Forced(Family forced) {
  const FamilyReader* r = ReaderFor(forced);
  if (r == nullptr) {
    return Invalid("--family '" + std::string(FamilyName(forced)) + "': expected one of " + FamilyNameList());
  }
  return r;
}

// The reader that reads `dir`: the forced family's if its probe recognises
// it (forcing never skips the probe: nothing is written into a directory no
// probe recognises), else the first in priority order.
Result<const FamilyReader*> Pick(const std::string& dir, Family forced) {
  if (forced != Family::kUnknown) {
    ASSIGN_OR_RETURN(const FamilyReader* r, Forced(forced));
    if (!r->looks(dir)) {
      return Unsupported("--family " + std::string(FamilyName(forced)) + ": " + dir + " has no " +
                         std::string(r->marks));
    }
    return r;
  }
  for (const FamilyReader& r : Table()) {
    if (r.looks(dir)) return &r;
  }
  return CannotDetect(dir);
}

}  // namespace

const std::vector<FamilyReader>& FamilyReaders() { return Table(); }

const FamilyReader* ReaderFor(Family f) {
  for (const FamilyReader& r : Table()) {
    for (const FamilyTraits& y : r.yields) {
      if (y.id == f) return &r;
    }
  }
  return nullptr;
}

const std::vector<FamilyTraits>& AllFamilies() {
  static const std::vector<FamilyTraits> all = [] {
    std::vector<FamilyTraits> v;
    for (const FamilyReader& r : Table()) v.insert(v.end(), r.yields.begin(), r.yields.end());
    return v;
  }();
  return all;
}

const FamilyTraits& Traits(Family f) {
  static const FamilyTraits unknown{Family::kUnknown, "unknown", "unknown", NameConvention::kTorch, false};
  for (const FamilyTraits& t : AllFamilies()) {
    if (t.id == f) return t;
  }
  return unknown;
}

std::string_view FamilyName(Family f) { return Traits(f).name; }

std::optional<Family> FamilyFromName(std::string_view name) {
  for (const FamilyTraits& t : AllFamilies()) {
    if (t.name == name) return t.id;
  }
  return std::nullopt;
}

std::string FamilyNameList() {
  std::string s;
  for (const FamilyTraits& t : AllFamilies()) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

Status Recognise(const std::string& dir, Family forced) { return Pick(dir, forced).status(); }

Result<Checkpoint> ReadCheckpoint(const std::string& dir, Family forced) {
  ASSIGN_OR_RETURN(const FamilyReader* reader, Pick(dir, forced));
  ASSIGN_OR_RETURN(Checkpoint ck, reader->read(dir));
  if (forced != Family::kUnknown && ck.info.family != forced) {
    return Unsupported("--family " + std::string(FamilyName(forced)) + ": " + dir + " reads as " +
                       std::string(FamilyName(ck.info.family)));
  }
  return Sanitized(std::move(ck));
}

}  // namespace ckptfs
