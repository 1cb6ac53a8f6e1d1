// A directory of safetensors files as a checkpoint:
// - a Hugging Face model (save_pretrained, or DCP's HuggingFaceStorageWriter
//   consolidated output): model-0000k-of-0000n.safetensors (or
//   model.safetensors) with model.safetensors.index.json {"weight_map":
//   {name: file}}; every tensor whole in one file;
// - DCP's HuggingFaceStorageWriter(save_distributed=True) shards:
//   shard-0000r-model-0000k-of-0000n.safetensors per rank, each tensor a chunk
//   placed by __metadata__["DCP_SHARDING_INFO"] (saved_offsets); the global
//   shape is the chunks' extent, as torch's HuggingFaceStorageReader computes
//   it. With enable_consolidation the shards sit in sharded/ beside the
//   consolidated files; mounting the directory reads the consolidated ones,
//   mounting sharded/ (or a directory holding only shards) reads the shards.
// Tensors are parameters named as stored. See docs/formats/notes/
// torch-dcp-safetensors.md 2.6.
#ifndef CKPTFS_FORMATS_SAFETENSORS_ST_DIR_READER_H_
#define CKPTFS_FORMATS_SAFETENSORS_ST_DIR_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeSafetensorsDir(const std::string& dir);
Result<Checkpoint> ReadSafetensorsDir(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_SAFETENSORS_ST_DIR_READER_H_
