// PyTorch Distributed Checkpoint reader (torch.distributed.checkpoint):
// `.metadata` (a pickled Metadata: state_dict_metadata, planner_data,
// storage_data; torch 1.13 `_shard.checkpoint` and torch 2.x) plus the data
// files it names (`__<rank>_<n>.distcp`, or `__<rank>_<n>` per item in 1.13).
// Also read as DCP: rank-local saves (`__<rank>.metadata` per rank, no global
// file: merged by key), and Accelerate's FSDP layout (`pytorch_model_fsdp_0/`
// + `optimizer_0/`, two saves read as one checkpoint).
// Every storage item is a complete torch.save archive, optionally wrapped in a
// zstd stream (transform_descriptors "stream.zstd/1"), or, with the
// SAFETENSORS serialization, a tensor of the rank file's safetensors block.
// For each tensor chunk the reader opens the item's ZIP directory and data.pkl
// (or the block's header) and records the absolute byte offset of the chunk's
// first element, so reads go straight to it. See
// docs/formats/notes/torch-dcp-safetensors.md section 2.
#ifndef CKPTFS_FORMATS_DCP_DCP_READER_H_
#define CKPTFS_FORMATS_DCP_DCP_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeDcp(const std::string& dir);
Result<Checkpoint> ReadDcp(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_DCP_DCP_READER_H_
