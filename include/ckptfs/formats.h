// Formats layer interface: detect a checkpoint directory's family and read its
// metadata into the data model (model.h). Readers touch only metadata: pickle
// headers, ZIP directories, JSON headers; never tensor bytes (except 0-d
// scalars they need for checkpoint.json, e.g. the step).
//
// Errors come in two kinds. A checkpoint-level failure (no or corrupt
// `.metadata`) fails the whole read: "cannot parse <file>: <reason>". A
// failure confined to some tensors (a truncated or missing data file, an item
// past the end of its file, an unknown pickle global inside one item) is
// recorded in that TensorRecord's `error`, so a mount serves everything else.
#ifndef CKPTFS_FORMATS_H_
#define CKPTFS_FORMATS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "ckptfs/topo_plan.h"

namespace ckptfs {

namespace hf {
struct HfConvention;  // ckptfs/hf_names.h
}  // namespace hf

// Directory entries the readers and the fingerprint ignore (ckptfs's own index).
inline constexpr const char* kIndexDirName = ".ckptfs";

// Resource bounds for reading untrusted metadata (command-line options of the
// same names; set once at startup, before any read). A file or item past a
// bound makes what needs it unreadable with a message naming the bound.
struct ReadLimits {
  // A DCP bytes item after zstd decompression (a tensor item is bounded by
  // the bytes its chunk needs, plus 1 MiB of torch.save framing). Default 4 GiB.
  uint64_t max_item_bytes = uint64_t{4} << 30;
  // A DCP .metadata file. Default 1 GiB.
  uint64_t max_metadata_bytes = uint64_t{1} << 30;
};
void SetReadLimits(const ReadLimits& limits);
const ReadLimits& GetReadLimits();

// What a family's native-files hook reads: the index's records (it runs at
// lookup time, from the index alone) and the plan of the new layout.
struct NativeFilesInput {
  const CheckpointInfo& info;
  const std::vector<TensorRecord>& tensors;
  const std::vector<ExportFile>& exports;  // what the reader exported (e.g. a run's args)
  const TopoPlan& plan;
};
// A family's own files at a new layout, laid out like every synthesized
// file (ExportFile: literal bytes and sub-boxes of tensors).
struct NativeFiles {
  std::vector<ExportFile> rank_files;  // one per rank of the plan, listed in layout.json
  std::vector<ExportFile> others;      // e.g. an iteration tracker
};

// A DCP-based checkpoint layout of a family's own (Megatron's torch_dist),
// made by its hook from the index alone, served beside dcp/ by the generic
// views (dcp_view.h lays out its .metadata and data files).
struct DcpProfileTensor {
  uint32_t tensor = 0;  // Checkpoint::tensors index, served at its stored rows
  std::string key;      // the profile's key
  // Non-empty: the tensor is entry `stack_index` of leading axes of
  // `stack_size` entries that key's tensor has (a layer stack; layers and
  // experts); its chunks are its own with those axes (length 1) before them.
  std::vector<int64_t> stack_index;
  std::vector<int64_t> stack_size;
};
struct DcpProfileObject {
  std::string key;    // a bytes entry of the DCP
  std::string bytes;  // its item
};
struct DcpProfile {
  std::string dir;      // under the mount root ("torch_dist")
  std::string dcp_dir;  // the DCP's directory inside `dir` ("iter_0000007")
  std::vector<DcpProfileTensor> tensors;
  std::vector<DcpProfileObject> objects;
  // Other files, paths relative to `dir` (common.pt, metadata.json, a
  // tracker): literal bytes and tensor parts like every synthesized file.
  std::vector<ExportFile> files;
  std::string readme;  // the DCP directory's README.txt, before its key counts
  // Non-empty: the checkpoint cannot be presented in this layout, and why
  // (checkpoint.json "profiles"); nothing else is set.
  std::string absent;
};
struct DcpProfileInput {
  const CheckpointInfo& info;
  const std::vector<TensorRecord>& tensors;
  const std::vector<ExportFile>& exports;
};

// The family table's readers: one row per reader, in priority order, with
// the hooks a family may give the generic views (src/views knows no family:
// what it needs from one comes through these). A reader may yield several
// families (the rank-files reader: verl or Accelerate); a family belongs to
// exactly one reader.
struct FamilyReader {
  std::string_view name;  // for tests and docs: "megatron-dist"
  int priority = 0;       // lower first; unique
  // What the probe looks for, as the "cannot detect" message lists it.
  std::string_view marks;
  // Why this reader comes after an earlier one whose probe can also match
  // the same directory (empty: none can).
  std::string_view after;
  bool (*looks)(const std::string& dir) = nullptr;  // names only, no parsing
  Result<Checkpoint> (*read)(const std::string& dir) = nullptr;
  // The families it yields, each with its traits (family.h).
  std::vector<FamilyTraits> yields;

  // Hooks (null: the family has none).
  // topo/: the TP split of a parameter by its name alone, for tensors whose
  // reader recorded no rule. Tried for every checkpoint, in table order
  // after the generic Llama names: a DCP's names often follow a family's
  // conventions (Megatron's). nullopt: no rule for that name.
  std::optional<TensorSplit> (*split_by_name)(const std::string& fqn) = nullptr;
  // topo/: the family's native files at the plan's degrees (Megatron's
  // model_optim_rng.pt per rank and its tracker), from the index alone.
  // Empty when the index lacks what they need (a run without args).
  Result<NativeFiles> (*native_files)(const NativeFilesInput& in) = nullptr;
  // The layout.json key listing native_files' rank files.
  std::string_view native_files_key;
  // A DCP profile (DcpProfile above), from the index alone: names only, so
  // cheap enough for every mount; its DCP is planned on first use.
  DcpProfile (*dcp_profile)(const DcpProfileInput& in) = nullptr;
  // hf/: the family's source convention (its names, its record of the
  // model, where it keeps config.json); hf/ asks every row's, in table
  // order, so one family's names are recognised in another's checkpoints.
  const hf::HfConvention* hf = nullptr;
};
const std::vector<FamilyReader>& FamilyReaders();
// The reader that yields `f`; nullptr for kUnknown.
const FamilyReader* ReaderFor(Family f);

// Every family of the table, in table order (the readers' priority, then
// each reader's yields).
const std::vector<FamilyTraits>& AllFamilies();
const FamilyTraits& Traits(Family f);   // kUnknown: {"unknown", ...}
std::string_view FamilyName(Family f);  // checkpoint.json "family": "pytorch-dcp"
std::optional<Family> FamilyFromName(std::string_view name);
// "megatron-torch_dist, megatron-zarr, ...": for help texts and errors.
std::string FamilyNameList();

// Detects the family of `dir` and reads it; `forced` (--family) picks that
// family's reader instead of the first that recognises `dir`, and fails if
// its probe does not recognise it or the reader finds another family of its
// own. Files are recorded with their size, mtime and inode as seen at read
// time (the index fingerprint).
Result<Checkpoint> ReadCheckpoint(const std::string& dir, Family forced = Family::kUnknown);
// Whether some family's probe (or `forced`'s) recognises `dir` (names only,
// no parsing): the check made before anything is written into or beside a
// source (an index, its lock). Unsupported, with ReadCheckpoint's "cannot
// detect" message, if not.
Status Recognise(const std::string& dir, Family forced = Family::kUnknown);

}  // namespace ckptfs

#endif  // CKPTFS_FORMATS_H_
