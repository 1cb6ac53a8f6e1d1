// torch.save archive reader ("new zipfile serialization", torch >= 1.6):
// a ZIP of <prefix>/data.pkl (protocol-2 pickle), <prefix>/data/<key> (one
// record per storage, 64-byte aligned from the archive start) and a version
// record. Tensors are resolved to byte ranges of their storage record so that
// later reads go straight to the file; nothing here reads tensor bytes.
#ifndef CKPTFS_FORMATS_TORCH_SAVE_H_
#define CKPTFS_FORMATS_TORCH_SAVE_H_

#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "formats/byte_reader.h"
#include "formats/pickle.h"
#include "formats/zip.h"

namespace ckptfs::formats {

struct TorchSaveArchive {
  std::string prefix;  // "archive" in DCP items, the file stem otherwise
  ZipDirectory zip;
  PyHandle root;
  std::vector<std::string> placeholders;  // unknown globals data.pkl kept inert (pickle.h)
};

// Parses the directory and data.pkl (bounded to 256 MiB).
Result<TorchSaveArchive> ReadTorchSave(const ByteReader& r, const PickleOptions& opts = {});

// Where a tensor's elements lie in the archive.
struct ResolvedTensor {
  uint64_t data_offset = 0;  // offset of element storage_offset, relative to the reader
  uint64_t data_length = 0;  // bytes from data_offset to the record end
};

// The CRC-32 of every stored entry of `a`, as ranges of the file `file`
// (`base`: where the reader's byte 0 lies in that file).
void AppendZipChecksums(const ByteReader& r, const TorchSaveArchive& a, FileId file, uint64_t base,
                        std::vector<ChecksumRange>* out);

// Checks that every element the view can reach lies inside the storage record.
Result<ResolvedTensor> ResolveTensor(const ByteReader& r, const TorchSaveArchive& a, const TensorRef& t);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCH_SAVE_H_
