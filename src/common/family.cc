#include "ckptfs/family.h"

#include <string>

namespace ckptfs {

namespace {

using NC = NameConvention;

// One row per family. Adding a family: a row here, an id above, a reader row
// in src/formats/detect.cc, its folder (docs/architecture.md).
const std::vector<FamilyTraits>& Table() {
  // clang-format off
  static const std::vector<FamilyTraits> kTable = {
    // id, name (checkpoint.json, --family), title, names, layers_checked_by_reader
    {Family::kPytorchDcp,        "pytorch-dcp",         "PyTorch DCP",                     NC::kTorch,    false},
    {Family::kMegatronTorchDist, "megatron-torch_dist", "Megatron-LM torch_dist",          NC::kMegatron, true},
    {Family::kMegatronZarr,      "megatron-zarr",       "Megatron-LM zarr",                NC::kMegatron, true},
    {Family::kMegatronLegacy,    "megatron-legacy",     "Megatron-LM legacy torch format", NC::kMegatron, true},
    {Family::kDeepSpeed,         "deepspeed",           "DeepSpeed (ZeRO, pipeline, MoE)", NC::kTorch,    false},
    {Family::kSafetensors,       "safetensors",         "Hugging Face safetensors",        NC::kTorch,    false},
    {Family::kAccelerateFsdp,    "accelerate-fsdp",     "Accelerate FSDP rank files",      NC::kTorch,    false},
    {Family::kVerl,              "verl",                "verl FSDP rank files",            NC::kTorch,    false},
    {Family::kMetaConsolidated,  "meta-consolidated",   "Meta consolidated.NN.pth",        NC::kTorch,    false},
    {Family::kTorchSave,         "torch-save",          "torch.save files",                NC::kTorch,    false},
  };
  // clang-format on
  return kTable;
}

const FamilyTraits kUnknownTraits{Family::kUnknown, "unknown", "unknown", NC::kTorch, false};

}  // namespace

const std::vector<FamilyTraits>& AllFamilies() { return Table(); }

const FamilyTraits& Traits(Family f) {
  for (const FamilyTraits& t : Table()) {
    if (t.id == f) return t;
  }
  return kUnknownTraits;
}

std::string_view FamilyName(Family f) { return Traits(f).name; }

std::optional<Family> FamilyFromName(std::string_view name) {
  for (const FamilyTraits& t : Table()) {
    if (t.name == name) return t.id;
  }
  return std::nullopt;
}

std::string FamilyNameList() {
  std::string s;
  for (const FamilyTraits& t : Table()) {
    if (!s.empty()) s += ", ";
    s += t.name;
  }
  return s;
}

}  // namespace ckptfs
