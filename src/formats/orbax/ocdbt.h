// tensorstore's OCDBT key-value store ("Optionally-Cooperative Distributed
// B+Tree"), read from the format itself (docs/formats/orbax.md): the
// manifest, the latest version's B+tree (interior and leaf nodes,
// prefix-compressed keys), inline and out-of-line values. Read-only, no
// tensorstore: every structure's CRC-32C is checked, every length and count is
// bounded before it allocates, data-file paths stay beneath the database
// directory, and only the nodes of the latest version are read (the stale
// generations orbax leaves in d/ files are never scanned).
#ifndef CKPTFS_FORMATS_ORBAX_OCDBT_H_
#define CKPTFS_FORMATS_ORBAX_OCDBT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"

namespace ckptfs::formats::orbax {

// Bounds on what an untrusted database may make the reader do.
struct OcdbtLimits {
  // A node after decompression (orbax writes max_decoded_node_bytes = 1e8;
  // the manifest's own value applies when smaller).
  uint64_t max_decoded_node_bytes = uint64_t{128} << 20;
  // An encoded node or manifest.
  uint64_t max_encoded_bytes = uint64_t{256} << 20;
  // Keys over the whole tree, and nodes visited.
  uint64_t max_entries = uint64_t{64} << 20;
  uint64_t max_nodes = uint64_t{1} << 20;
  // All nodes of the tree together, decoded.
  uint64_t max_total_decoded_bytes = uint64_t{4} << 30;
  uint32_t max_height = 32;
};

// Reads `len` bytes at `off` of file `rel` (relative to the database
// directory, already checked to stay beneath it); an error when the file is
// shorter. `size_of` gives a file's size (for the bounds checks).
struct OcdbtFiles {
  std::function<Result<std::string>(const std::string& rel, uint64_t off, uint64_t len)> read;
  std::function<Result<uint64_t>(const std::string& rel)> size_of;
};

// An encoded structure's envelope: magic u32be | length u64le | version
// varint | compression varint | body | crc32c u32le.
struct OcdbtEnvelope {
  uint64_t header_bytes = 0;  // before the body
  bool zstd = false;          // the body is one zstd frame
  std::string body;           // decoded
};
// Checks magic, length (== data.size()), version 0, the CRC and decodes the
// body (bounded by max_decoded). `what` names the structure for errors.
Result<OcdbtEnvelope> DecodeOcdbtEnvelope(std::string_view data, uint32_t magic, uint64_t max_decoded,
                                          const std::string& what);

inline constexpr uint32_t kOcdbtManifestMagic = 0x0cdb3a2a;
inline constexpr uint32_t kOcdbtBtreeNodeMagic = 0x0cdb20de;
inline constexpr uint32_t kOcdbtVersionNodeMagic = 0x0cdb1234;

struct OcdbtConfig {
  std::string uuid;  // 16 bytes
  uint64_t manifest_kind = 0;
  uint64_t max_inline_value_bytes = 0;
  uint64_t max_decoded_node_bytes = 0;
  uint32_t version_tree_arity_log2 = 0;
  uint64_t compression = 0;  // 0 none, 1 zstd
  int32_t zstd_level = 0;
};

// One key's value.
struct OcdbtValue {
  std::string key;
  uint64_t length = 0;  // bytes
  bool is_inline = false;
  // Out-of-line: the data file and the value's offset in it.
  // Inline: the data file holding the node whose body holds the value.
  std::string file;
  uint64_t offset = 0;
  // Inline: the node's envelope [node_offset, +node_length) of `file`, its
  // header size, whether its body is a zstd frame, and the value's offset in
  // the decoded body; `bytes` is the value itself.
  uint64_t node_offset = 0, node_length = 0, node_header = 0;
  bool node_zstd = false;
  uint64_t body_offset = 0;
  std::string bytes;
};

struct OcdbtListing {
  OcdbtConfig config;
  uint64_t generation = 0;         // the latest version's generation number
  uint64_t commit_time_ns = 0;     // its commit time (orbax's tensorstore writes nanoseconds)
  uint64_t versions = 0;           // versions the manifest holds inline
  std::vector<OcdbtValue> values;  // sorted by key
};

// Reads the database whose manifest is `manifest` (usually "manifest.ocdbt")
// through `files`. Errors name the file and the structure.
Result<OcdbtListing> ReadOcdbt(const OcdbtFiles& files, const std::string& manifest, const OcdbtLimits& limits = {});

// Whether `rel` is a path a data file may have: relative, no empty, "." or
// ".." component, no NUL.
bool SafeRelativePath(std::string_view rel);

}  // namespace ckptfs::formats::orbax

#endif  // CKPTFS_FORMATS_ORBAX_OCDBT_H_
