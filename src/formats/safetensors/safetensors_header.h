// The safetensors container (huggingface/safetensors, "format" in its README):
// an 8-byte little-endian header length N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}, then the data; offsets are relative to the byte after the
// header (huggingface/safetensors README; DCP use: docs/formats/notes/
// torch-dcp-safetensors.md 2.3 and 2.6).
//
// The blob may sit anywhere in a file (DCP's SAFETENSORS serialization writes
// one after a rank file's bytes items), so it is read from `base` and must end
// by `limit`. Everything in the header is untrusted: sizes, offsets and shapes
// are checked against each other and against the bytes that exist.
#ifndef CKPTFS_FORMATS_SAFETENSORS_SAFETENSORS_HEADER_H_
#define CKPTFS_FORMATS_SAFETENSORS_SAFETENSORS_HEADER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

// The safetensors library refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // absolute file offsets of the tensor's bytes
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                      // absolute offset of the data section
  std::vector<SafetensorsEntry> entries;        // in header order
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// `name` names the file in every error ("cannot parse <name>: ...").
Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t base, uint64_t limit, const std::string& name);

// DCP's safetensors writers (FileSystemWriter SAFETENSORS, HuggingFace-
// StorageWriter with save_distributed) record where each tensor sits in the
// global one: __metadata__["DCP_SHARDING_INFO"] = JSON {fqn: {"saved_offsets":
// [...]}}. Empty when the header has none.
Result<std::map<std::string, std::vector<int64_t>>> DcpShardingInfo(const SafetensorsHeader& h,
                                                                    const std::string& name);

// True when the bytes at `base` could start a safetensors blob (not a ZIP
// local header, and a header length that fits before `limit`): the blob is
// then parsed, and damage inside it reported as safetensors damage.
bool LooksLikeSafetensorsAt(int fd, uint64_t base, uint64_t limit);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_SAFETENSORS_SAFETENSORS_HEADER_H_
