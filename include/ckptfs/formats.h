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

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs {

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

// Detects the family of `dir` and reads it. Files are recorded with their
// size, mtime and inode as seen at read time (the index fingerprint).
Result<Checkpoint> ReadCheckpoint(const std::string& dir);
// Whether some family's probe recognises `dir` (names only, no parsing): the
// check made before anything is written into or beside a source (an index,
// its lock). Unsupported, with ReadCheckpoint's "cannot detect" message, if not.
Status Recognise(const std::string& dir);

}  // namespace ckptfs

#endif  // CKPTFS_FORMATS_H_
