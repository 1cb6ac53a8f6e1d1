// libFuzzer target: the OCDBT reader (manifest, B+tree nodes, data file
// tables, inline and out-of-line values) over an in-memory database. The
// input is a directory archive (dir_archive.h) of one database directory:
// manifest.ocdbt and its d/ files (seeds: real orbax saves, packed by
// tests/fuzz/make_corpus.py into tests/fuzz/ocdbt_seeds/).
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "dir_archive.h"
#include "formats/orbax/ocdbt.h"
#include "formats/orbax/zarr_arrays.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  std::map<std::string, std::string_view> files;
  fuzz::ForEachArchiveFile(data, size, [&](const std::string& name, std::string_view bytes) { files[name] = bytes; });
  formats::orbax::OcdbtFiles io;
  io.size_of = [&](const std::string& rel) -> Result<uint64_t> {
    auto it = files.find(rel);
    if (it == files.end()) return NotFound(rel);
    return static_cast<uint64_t>(it->second.size());
  };
  io.read = [&](const std::string& rel, uint64_t off, uint64_t len) -> Result<std::string> {
    auto it = files.find(rel);
    if (it == files.end() || off > it->second.size() || len > it->second.size() - off) return Invalid(rel);
    return std::string(it->second.substr(off, len));
  };
  formats::orbax::OcdbtLimits limits;
  limits.max_decoded_node_bytes = 16 << 20;
  auto listing = formats::orbax::ReadOcdbt(io, "manifest.ocdbt", limits);
  if (listing.ok()) {
    for (const auto& v : listing->values) {
      // Array metadata values go through the zarr parser, as the reader does.
      if (v.is_inline && (v.key.ends_with("/.zarray") || v.key.ends_with("/zarr.json"))) {
        auto a = formats::orbax::ParseZarrMetadata(v.bytes);
        if (a.ok() && a->sharded && v.bytes.size() >= a->ShardIndexBytes()) {
          (void)formats::orbax::DecodeShardIndex(*a, std::string_view(v.bytes).substr(0, a->ShardIndexBytes()),
                                                 v.bytes.size())
              .ok();
        }
      }
    }
  }
  return 0;
}
