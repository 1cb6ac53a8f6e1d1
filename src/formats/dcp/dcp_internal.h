// Internals of the DCP reader (dcp_reader.h has the design note), shared by
// its files. One read is one DcpReader: dcp_metadata.cc finds the saves and
// decodes their metadata files into tensor records, chunk work items and
// storage items; dcp_items.cc locates each chunk's item, opens the data files
// and resolves every item to a fragment; dcp_reader.cc runs the steps in
// order. Not a public interface.
#ifndef CKPTFS_FORMATS_DCP_DCP_INTERNAL_H_
#define CKPTFS_FORMATS_DCP_DCP_INTERNAL_H_

#include <unistd.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"

namespace ckptfs::formats::dcp {

// Where a storage item lies: its data file, byte range and whether it is a
// zstd stream (transform_descriptors "stream.zstd/1").
struct ItemLoc {
  uint32_t file = 0;
  bool zstd = false;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A chunk's storage key: the tensor's interned id and its offsets, as
// varints (zigzag): self-delimiting, and short enough for the string's inline
// buffer in the common case (millions of chunks, one key each).
std::string ChunkKey(uint32_t fqn_id, const int64_t* offsets, size_t n);

// One tensor chunk or bytes item to resolve against its data file.
struct Work {  // one per chunk: kept small (a checkpoint may have millions)
  uint32_t tensor = 0;
  uint32_t ndim = 0;
  bool bytes = false;
  // The chunk's offsets then sizes: `ndim` each, from here in the box pool.
  uint64_t box = 0;
  ItemLoc loc;
};

// The checkpoint's source files, opened (closed on destruction).
struct OpenFiles {
  std::vector<int> fds;  // -1: could not open (errors[i] says why)
  std::vector<std::string> errors;
  ~OpenFiles() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
};

// One DCP save inside the mounted directory: its folder ("" or "<sub>/")
// and metadata files: {".metadata"} for a global save, else the rank-local
// `__<rank>.metadata` files (dcp.save(use_collectives=False)) in rank order.
struct DcpSave {
  std::string prefix;
  std::vector<std::pair<uint32_t, std::string>> meta;  // (rank, file name)
  std::set<uint32_t> data_ranks;                       // ranks of its __<rank>_<n>.distcp files
  // A folder of Lightning checkpoints (a Trainer's checkpoints/): the other
  // checkpoint directories there, which this mount does not read.
  std::vector<std::string> others;
  bool rank_local() const { return !meta.empty() && meta[0].second != ".metadata"; }
};

// The DCP saves that make up the checkpoint at `dir`: the directory itself,
// or Accelerate's FSDP layout (what HF Trainer's checkpoint-N/ holds with
// SHARDED_STATE_DICT): the model in pytorch_model_fsdp_0/ and its optimizer
// in optimizer_0/, two DCP saves read as one checkpoint; or a folder of
// Lightning checkpoints (a Trainer's checkpoints/ of `<name>.ckpt/`
// directories, each a DCP save with meta.pt): the latest by the step in its
// name (Lightning's `step=<N>`), else by its .metadata's mtime. Names only.
// Empty when none.
std::vector<DcpSave> FindSaves(const std::string& dir);

// Streaming: the dicts whose entries the pickle VM handed over (they must be
// Metadata.state_dict_metadata and storage_data once the tree is built).
struct StreamedDicts {
  const PyValue* sdm = nullptr;
  const PyValue* storage = nullptr;
};

// The state of one ReadDcp, filled step by step (see dcp_reader.cc).
struct DcpReader {
  DcpReader(std::string dir, std::vector<DcpSave> saves);

  std::string dir;
  std::vector<DcpSave> saves;
  size_t n_meta = 0;       // metadata files over all saves
  bool merge = false;      // several metadata files: their entries are merged by key
  std::string meta_path;   // the metadata file being parsed, for errors
  std::string cur_prefix;  // the folder of the save being parsed

  Checkpoint ck;
  // Source files: the metadata files first, then every data file in
  // storage_data order.
  std::map<std::string, uint32_t> file_ids;
  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(file, offset, length).
  std::unordered_map<std::string, ItemLoc> items;
  std::unordered_map<std::string, uint32_t> fqn_ids;  // tensor name -> id in the keys
  // state_dict_metadata: a tensor (its chunks become work items, located in
  // storage_data once both are read) or a bytes entry.
  std::vector<Work> work;
  std::vector<int64_t> boxes;  // Work::box
  // Rank-local saves: the same key appears in several ranks' metadata (each
  // with that rank's chunks, replicated ones in every rank); merged here.
  std::unordered_map<std::string, uint32_t> tensor_ids;
  std::unordered_set<std::string> seen_chunks;
  std::vector<std::vector<std::string>> paths;  // each tensor's state-dict path
  OpenFiles files;                              // the source files, once opened

  // ---- dcp_metadata.cc ----
  // Reads every metadata file of every save; the tensors, their work items
  // (in tensor order) and the storage items; an error fails the read.
  Status ReadMetadata();
  // Rank-local saves: the format note, and a coverage error per missing rank.
  void NoteRankLocalSaves();
  // `s` annotated with "cannot parse <meta_path>".
  Status CannotParse(const Status& s) const;
  // The id of source file `rel`, registered on first sight.
  uint32_t AddFile(const std::string& rel);
  // The interned id of tensor name `fqn` in chunk keys.
  uint32_t FqnId(const std::string& fqn);
  // One storage_data entry: MetadataIndex `k` -> _StorageInfo `v`.
  Status AddStorage(const PyValue& k, const PyValue& v);
  // One state_dict_metadata entry: key `k` -> Tensor/BytesStorageMetadata `md`.
  Status AddTensorMetadata(const PyValue& k, const PyValue& md);
  // Refuses `earlier`, which a later rank's metadata gives as `t` (first reason wins).
  Status Disagree(TensorRecord& earlier, const TensorRecord& t);
  // Reads one metadata file (`name` in folder `prefix`) through the pickle VM.
  Status ReadMetadataFile(const std::string& prefix, const std::string& name);
  // The VM's consume hook: takes a storage_data or state_dict_metadata entry
  // as it is set into `dict` (true), or leaves it in the tree (false).
  Result<bool> TakeStreamedEntry(StreamedDicts& seen, const PyValue& dict, const PyValue& k, const PyValue& v);
  // Checks the unpickled Metadata `root`, adds the entries the VM left in it,
  // and records the format note and each new tensor's state-dict path.
  Status TakeMetadataRoot(const PyValue& root, const StreamedDicts& seen);

  // Set once every chunk is resolved (Resolve has run). With one metadata
  // file that also pickles every rank's SavePlan (all_local_plans, after
  // state_dict_metadata and storage_data: megatron-core), ReadMetadataFile
  // runs Resolve on a thread of its own while the VM reads those plans.
  bool resolved = false;

  // ---- dcp_items.cc ----
  // Locates, opens, resolves and checks every chunk: the five steps below, in order.
  void Resolve();
  // ".metadata", or "the metadata files" when there are several.
  std::string MetaDesc() const;
  // Finds each chunk's storage item; a chunk without one fails its tensor.
  void LocateChunks();
  // Stats and opens every source file; a missing one is a per-tensor error.
  void OpenDataFiles();
  // One coverage finding per missing data file, listing the holes it leaves.
  void FlagMissingFiles();
  // Resolves every chunk to its fragment (in parallel, in batches).
  void ResolveChunks();
  // Checks that each tensor's fragments tile it; clears a failed tensor's fragments.
  void CheckTilings();
};

}  // namespace ckptfs::formats::dcp

#endif  // CKPTFS_FORMATS_DCP_DCP_INTERNAL_H_
