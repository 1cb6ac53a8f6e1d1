// Lays out a torch.save archive whose tensor bytes are not in memory: the
// result is a list of ExportParts (model.h) — literal ZIP headers and pickle,
// tensor regions rendered at read time, and CRC-32 fields computed at read
// time. The layout is deterministic and every part's size is known, so the
// file's size is exact before any byte is read.
//
// ZIP details. Entries are STORED; each record's data starts 64-byte aligned
// (padding in an extra field, as torch.save does). Tensor records set flag
// bit 3: their CRC is 0 in the local header and given in a data descriptor
// after the data and in the central directory, so the first bytes of a file
// never wait for a checksum over the whole tensor. ZIP64 structures are used
// exactly when a size or offset needs them.
#ifndef CKPTFS_FORMATS_TORCH_SAVE_WRITER_H_
#define CKPTFS_FORMATS_TORCH_SAVE_WRITER_H_

#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

struct ArchiveStorage {
  uint32_t tensor = 0;  // Checkpoint::tensors index whose rendering is the record data/<i>
  DType out_dtype = DType::kInvalid;
  uint64_t nbytes = 0;
  // The record is these sub-boxes' renderings concatenated (none: the whole
  // tensor): a resharded slice, e.g. SwiGLU's [W_r; V_r].
  std::vector<Box> boxes;
};

// `pickle` is data.pkl; storage i becomes record "<name>/data/<i>" (the pickle
// must use storage keys "0", "1", ...).
std::vector<ExportPart> TorchSaveParts(const std::string& archive_name, const std::string& pickle,
                                       const std::vector<ArchiveStorage>& storages);

// The bytes of a torch.save archive that holds no tensor (every part is
// literal): `pickle` as its data.pkl.
std::string TorchSaveBytes(const std::string& archive_name, const std::string& pickle);

// Total size of a part list.
uint64_t PartsSize(const std::vector<ExportPart>& parts);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCH_SAVE_WRITER_H_
