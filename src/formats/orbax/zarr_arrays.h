// The zarr arrays orbax writes through tensorstore (docs/formats/orbax.md):
// zarr v2 (`.zarray`, zstd or no compressor) and zarr v3 (`zarr.json`:
// `bytes` + optional `zstd`, or `sharding_indexed` around them, its index of
// (offset, nbytes) u64le pairs at the end or start, CRC-32C'd), C order,
// little-endian, tensorstore's dtype names (bfloat16, float8_*). Metadata and
// chunk keys only: where a chunk's bytes lie is the caller's (an OCDBT value
// or a file).
#ifndef CKPTFS_FORMATS_ORBAX_ZARR_ARRAYS_H_
#define CKPTFS_FORMATS_ORBAX_ZARR_ARRAYS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats::orbax {

struct ZarrArray {
  int zarr_format = 2;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::vector<int64_t> chunks;  // the stored chunk (v3 sharded: the shard)
  bool zstd = false;            // chunk payloads (v3 sharded: inner chunks) are zstd frames
  // v3 sharding_indexed: the inner chunk shape (chunks / inner = inner grid
  // per shard), where the index lies and whether it ends with a CRC-32C.
  bool sharded = false;
  std::vector<int64_t> inner;
  bool index_at_end = true;
  bool index_crc = false;
  // Chunk keys: the separator and, for v3's default encoding, the "c" prefix.
  std::string separator = ".";
  bool v3_default_keys = false;
  std::string fill_value;  // as written (JSON), for messages

  // Elements of a stored (outer) chunk's grid position -> its key.
  std::string ChunkKey(const std::vector<int64_t>& idx) const;
  // Inner chunks per shard (1 when not sharded).
  uint64_t InnerPerShard() const;
  uint64_t InnerChunkBytes() const;  // bytes of one decoded inner chunk
  uint64_t ShardIndexBytes() const;  // 16 per inner chunk, + 4 with a CRC
};

// Parses `.zarray` (zarr_format 2) or `zarr.json` (zarr_format 3) text.
// Unsupported features (filters, Fortran order, big-endian, other codecs)
// are errors saying which.
Result<ZarrArray> ParseZarrMetadata(std::string_view text);

// One inner chunk of a shard: its bytes [offset, +nbytes) within the shard
// value; `absent`: the index marks it empty (the array's fill_value).
struct ShardEntry {
  uint64_t offset = 0, nbytes = 0;
  bool absent = false;
};
// Decodes a shard's index (`index` = its ShardIndexBytes() bytes) for a
// shard value of `value_bytes`; checks the CRC-32C and that every entry lies
// in the value before the index.
Result<std::vector<ShardEntry>> DecodeShardIndex(const ZarrArray& a, std::string_view index, uint64_t value_bytes);

}  // namespace ckptfs::formats::orbax

#endif  // CKPTFS_FORMATS_ORBAX_ZARR_ARRAYS_H_
