#include "ckptfs/formats.h"
#include "formats/dcp/dcp_reader.h"

namespace ckptfs {

Result<Checkpoint> ReadCheckpoint(const std::string& dir) {
  if (formats::LooksLikeDcp(dir)) return formats::ReadDcp(dir);
  return Unsupported("cannot detect a checkpoint in " + dir +
                     ": no .metadata (PyTorch DCP) found; an incomplete DCP save leaves only .metadata.tmp");
}

}  // namespace ckptfs
