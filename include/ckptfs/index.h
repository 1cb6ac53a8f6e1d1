// Index layer: the persistent RocksDB index of a checkpoint's files, tensors
// and fragments.
//
// Design note. The index is built from metadata only (formats layer), once,
// and then opened read-only by every mount, so many nodes can share one index
// on a parallel filesystem. Keys (codec.h):
//   "m:schema"  -> schema version      "m:info" -> CheckpointInfo
//   'f' u32     -> SourceFile          't' u32  -> TensorRecord
//   'g' u32 u32 -> Fragment (tensor id, ordinal): a tensor's fragments are one
//                  prefix scan.
//   'x' u32     -> ExportFile (synthesized files: universal/ archives)
//   'c' u32 u64 -> ChecksumRange (file id, offset): read on demand, never
//                  loaded whole (a DCP checkpoint of 1.5M chunks records 8M)
// A build writes to "<dir>.tmp.<pid>" and renames it into place, so a reader
// never sees a half-written index. Open() refuses an index whose schema
// version differs or whose source fingerprint (path, size, mtime, inode of
// every file, .metadata included) no longer matches: OpenOrBuild() then
// rebuilds.
#ifndef CKPTFS_INDEX_H_
#define CKPTFS_INDEX_H_

#include <sys/stat.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs {

class Index {
 public:
  // The index format's version, which every reader's output is part of: an
  // index of another version is rebuilt. Defined (and bumped) in index.cc,
  // so that a bump recompiles one file.
  static uint32_t SchemaVersion();

  // Writes `ck` atomically as the index at `dir` (replacing a stale one).
  static Status Build(const Checkpoint& ck, const std::string& dir);
  // Opens read-only and verifies schema and fingerprint against `src_dir`.
  static Result<std::unique_ptr<Index>> Open(const std::string& dir, const std::string& src_dir);

  ~Index();
  Index(const Index&) = delete;
  Index& operator=(const Index&) = delete;

  const std::string& dir() const { return dir_; }
  const std::string& src_dir() const { return src_dir_; }
  const CheckpointInfo& info() const { return info_; }
  const std::vector<SourceFile>& files() const { return files_; }
  const std::vector<TensorRecord>& tensors() const { return tensors_; }
  const std::vector<ExportFile>& exports() const { return exports_; }
  // The CRC-32-carrying ranges of the sources (ZIP entries; they never
  // overlap within a file), read from the index when asked.
  // Those of `file` that overlap [lo, hi), by offset.
  Result<std::vector<ChecksumRange>> ChecksumsIn(FileId file, uint64_t lo, uint64_t hi) const;
  // Every one, in (file, offset) order, handed to `fn` in batches of at most
  // `batch` (memory stays bounded whatever their number).
  Status ScanChecksums(size_t batch, const std::function<Status(std::vector<ChecksumRange>&)>& fn) const;
  uint64_t num_fragments() const { return num_fragments_; }
  // All fragments of one tensor, in ordinal order: one prefix scan.
  Result<std::vector<Fragment>> Fragments(TensorId id) const;
  // Every tensor's fragments, by tensor id (those with none skipped), in one
  // scan of the index: for a pass over all tensors, where Fragments per
  // tensor would open an iterator each.
  Status ForEachFragments(const std::function<Status(TensorId, std::vector<Fragment>&)>& fn) const;

 private:
  Index() = default;
  // A tensor's fragment count against its record (both fragment scans).
  Status CheckFragmentCount(TensorId id, size_t n) const;
  struct Db;
  std::unique_ptr<Db> db_;
  std::string dir_, src_dir_;
  CheckpointInfo info_;
  std::vector<SourceFile> files_;
  std::vector<TensorRecord> tensors_;
  std::vector<ExportFile> exports_;
  uint64_t num_fragments_ = 0;
};

// The one staleness rule: compares a file's recorded fingerprint (size,
// mtime, inode; mtime_ns == -1 means "missing when indexed") with what the
// file is now (`now` == nullptr: it does not exist). kStale names the file.
Status CompareFingerprint(const std::string& path, const SourceFile& recorded, const struct stat* now);
// CompareFingerprint for every file, stat'ing each by path under src_dir.
Status CheckFingerprint(const std::string& src_dir, const std::vector<SourceFile>& files);

// Where the index of src_dir lives: <src>/.ckptfs/index when the checkpoint
// directory is writable, else $XDG_CACHE_HOME (or ~/.cache)/ckptfs/<hash>.
std::string DefaultIndexDir(const std::string& src_dir);
// $XDG_CACHE_HOME/ckptfs (else ~/.cache/ckptfs, else /tmp/ckptfs-cache-<uid>/ckptfs).
std::string UserCacheDir();

struct OpenResult {
  std::unique_ptr<Index> index;
  bool built = false;       // true when this call (re)built the index
  std::string why_rebuilt;  // the staleness reason, when there was one
  double build_seconds = 0;
};

// Opens the index of src_dir (at index_dir, or the default location when
// empty), building or rebuilding it when absent or stale. `family` (--family)
// reads src_dir as that family (formats.h ReadCheckpoint); an index that holds
// another family is rebuilt. kUnknown: detect, and use any index that is fresh.
Result<OpenResult> OpenOrBuild(const std::string& src_dir, const std::string& index_dir, bool force_rebuild = false,
                               Family family = Family::kUnknown);

}  // namespace ckptfs

#endif  // CKPTFS_INDEX_H_
