// The checkpoint families ckptfs reads, as a typed id each. The family table
// (formats.h FamilyReaders, rows in src/formats/detect.cc) gives each id its
// traits, its reader and its hooks; everything that names or lists families
// takes them from there: checkpoint.json's "family", the index, `--family`,
// the CLI help, the Python package and the conformance suite.
//
// A family's *traits* are what generic code (views, verify) may ask about a
// checkpoint without knowing its family: they say what the family's reader
// already did or what its names follow. Detection (which reader recognises a
// directory, in which priority) and the hooks a family gives the views (its
// split rules by name, its native files at a new layout) are the formats
// layer's table (formats.h FamilyReaders); a family id belongs to exactly one
// reader.
#ifndef CKPTFS_FAMILY_H_
#define CKPTFS_FAMILY_H_

#include <cstdint>
#include <string_view>

namespace ckptfs {

enum class Family : uint8_t {
  kUnknown = 0,  // synthetic checkpoints (tests); named "unknown"
  kPytorchDcp,
  kMegatronTorchDist,
  kMegatronZarr,
  kMegatronLegacy,
  kDeepSpeed,
  kSafetensors,
  kAccelerateFsdp,
  kVerl,
  kMetaConsolidated,
  kTorchSave,
  kOrbax,
};

// The parameter-naming convention a family's names follow; hf/ picks its
// name tables by it.
enum class NameConvention : uint8_t {
  kTorch,     // module paths as the model defines them (HF, torchtitan, Meta: hf/ tells them apart by name)
  kMegatron,  // Megatron-LM / megatron-core (mcore and legacy language_model names)
  kJax,       // JAX pytree paths joined with '.' (orbax's param names; Flax module names)
};

struct FamilyTraits {
  Family id = Family::kUnknown;
  std::string_view name;   // checkpoint.json "family", `--family`: "pytorch-dcp"
  std::string_view title;  // for people: "PyTorch DCP"
  NameConvention names = NameConvention::kTorch;
  // The reader checked the layer stacks against the run's recorded
  // configuration (num_layers, PP): verify's name-based gap heuristic is
  // skipped, it would only repeat (or contradict) a better check.
  bool layers_checked_by_reader = false;
};

}  // namespace ckptfs

#endif  // CKPTFS_FAMILY_H_
