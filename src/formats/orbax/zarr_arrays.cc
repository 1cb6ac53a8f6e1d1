#include "formats/orbax/zarr_arrays.h"

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/json_text.h"
#include "formats/zarr/zarr_reader.h"

namespace ckptfs::formats::orbax {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 40;
constexpr uint64_t kMaxInnerPerShard = uint64_t{1} << 20;

// zarr v2 dtype strings (numpy's, bfloat16: ZarrV2DType; tensorstore's fp8
// extensions) and zarr v3 data_type names.
Result<DType> DTypeOf(const std::string& d, int format) {
  static const std::pair<const char*, DType> kFloat8[] = {{"float8_e4m3fn", DType::kF8E4M3FN},
                                                          {"float8_e5m2", DType::kF8E5M2},
                                                          {"float8_e4m3fnuz", DType::kF8E4M3FNUZ},
                                                          {"float8_e5m2fnuz", DType::kF8E5M2FNUZ}};
  static const std::pair<const char*, DType> kV3[] = {
      {"float32", DType::kF32},   {"float16", DType::kF16},     {"float64", DType::kF64},  {"int64", DType::kI64},
      {"int32", DType::kI32},     {"int16", DType::kI16},       {"int8", DType::kI8},      {"uint8", DType::kU8},
      {"bool", DType::kBool},     {"uint16", DType::kU16},      {"uint32", DType::kU32},   {"uint64", DType::kU64},
      {"complex64", DType::kC64}, {"complex128", DType::kC128}, {"bfloat16", DType::kBF16}};
  for (const auto& [name, dt] : kFloat8) {
    if (d == name) return dt;
  }
  if (format == 2) return ZarrV2DType(d);
  for (const auto& [name, dt] : kV3) {
    if (d == name) return dt;
  }
  return Unsupported("dtype '" + d + "' is not supported");
}

Status CheckGeometry(const ZarrArray& a) {
  if (a.chunks.size() != a.shape.size()) return Invalid("chunk shape and shape have different ranks");
  if (a.shape.size() > 32) return Invalid("more than 32 dimensions");
  uint64_t bytes = DTypeSize(a.dtype);
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (a.shape[d] < 0 || a.chunks[d] <= 0) return Invalid("bad shape or chunk shape");
    if (MulOverflow(bytes, static_cast<uint64_t>(a.chunks[d]), &bytes) || bytes > kMaxChunkBytes) {
      return Invalid("a chunk of " + JsonText(json(a.chunks)) + " elements is larger than 1 TiB");
    }
  }
  if (a.sharded) {
    if (a.inner.size() != a.chunks.size()) return Invalid("inner chunk shape and shard shape have different ranks");
    uint64_t n = 1;
    for (size_t d = 0; d < a.inner.size(); ++d) {
      if (a.inner[d] <= 0 || a.chunks[d] % a.inner[d] != 0) {
        return Invalid("inner chunk shape " + JsonText(json(a.inner)) + " does not divide the shard shape " +
                       JsonText(json(a.chunks)));
      }
      if (MulOverflow(n, static_cast<uint64_t>(a.chunks[d] / a.inner[d]), &n) || n > kMaxInnerPerShard) {
        return Invalid("more than " + std::to_string(kMaxInnerPerShard) + " inner chunks per shard");
      }
    }
  }
  return Status::Ok();
}

// v3 codecs "bytes" (+ "zstd") for an array or inside a shard.
Status ChunkCodecs(const json& codecs, ZarrArray& a) {
  if (!codecs.is_array() || codecs.empty()) return Invalid("no codecs");
  bool bytes = false;
  for (const json& c : codecs) {
    const std::string name = c.at("name").get<std::string>();
    const json cfg = c.value("configuration", json::object());
    if (name == "bytes") {
      if (bytes) return Invalid("two bytes codecs");
      const std::string endian = cfg.value("endian", std::string("little"));
      if (endian != "little" && a.dtype != DType::kU8 && a.dtype != DType::kI8 && a.dtype != DType::kBool) {
        return Unsupported("big-endian chunks are not supported");
      }
      bytes = true;
    } else if (name == "zstd" && bytes && !a.zstd) {
      a.zstd = true;
    } else if (name == "crc32c" && bytes) {
      return Unsupported("a crc32c codec on chunk data is not supported");
    } else {
      return Unsupported("codec '" + name + "' " + (bytes ? "after" : "before") + " bytes is not supported");
    }
  }
  if (!bytes) return Invalid("no bytes codec");
  return Status::Ok();
}

}  // namespace

std::string ZarrArray::ChunkKey(const std::vector<int64_t>& idx) const {
  std::string key = v3_default_keys ? "c" : "";
  for (size_t d = 0; d < idx.size(); ++d) {
    if (d > 0 || v3_default_keys) key += separator;
    key += std::to_string(idx[d]);
  }
  if (key.empty()) key = "0";  // v2 (and v3 "v2" encoding) 0-d arrays
  return key;
}

uint64_t ZarrArray::InnerPerShard() const {
  uint64_t n = 1;
  if (sharded) {
    for (size_t d = 0; d < inner.size(); ++d) n *= static_cast<uint64_t>(chunks[d] / inner[d]);
  }
  return n;
}

uint64_t ZarrArray::InnerChunkBytes() const {
  uint64_t n = DTypeSize(dtype);
  for (int64_t c : (sharded ? inner : chunks)) n *= static_cast<uint64_t>(c);
  return n;
}

uint64_t ZarrArray::ShardIndexBytes() const { return 16 * InnerPerShard() + (index_crc ? 4 : 0); }

Result<ZarrArray> ParseZarrMetadata(std::string_view text) {
  json z = json::parse(text, nullptr, false);
  if (z.is_discarded() || !z.is_object()) return Invalid("not a JSON object");
  ZarrArray a;
  try {
    a.zarr_format = z.value("zarr_format", 0);
    if (a.zarr_format == 2) {
      ASSIGN_OR_RETURN(a.dtype, DTypeOf(z.at("dtype").get<std::string>(), 2));
      a.shape = z.at("shape").get<std::vector<int64_t>>();
      a.chunks = z.at("chunks").get<std::vector<int64_t>>();
      if (z.contains("compressor") && !z["compressor"].is_null()) {
        const std::string id = z["compressor"].value("id", std::string());
        if (id != "zstd") return Unsupported("compressor " + JsonText(z["compressor"]) + " is not supported");
        a.zstd = true;
      }
      if (z.contains("filters") && !z["filters"].is_null()) return Unsupported("filters are not supported");
      if (z.value("order", std::string("C")) != "C") return Unsupported("Fortran order is not supported");
      a.separator = z.value("dimension_separator", std::string("."));
      if (a.separator != "." && a.separator != "/") return Invalid("bad dimension_separator");
      if (z.contains("fill_value")) a.fill_value = JsonText(z["fill_value"]);
    } else if (a.zarr_format == 3) {
      if (z.value("node_type", std::string("array")) != "array") return Invalid("node_type is not array");
      ASSIGN_OR_RETURN(a.dtype, DTypeOf(z.at("data_type").get<std::string>(), 3));
      a.shape = z.at("shape").get<std::vector<int64_t>>();
      const json& grid = z.at("chunk_grid");
      if (grid.value("name", std::string()) != "regular") return Unsupported("a chunk grid that is not regular");
      a.chunks = grid.at("configuration").at("chunk_shape").get<std::vector<int64_t>>();
      const json& enc = z.value("chunk_key_encoding", json{{"name", "default"}});
      const std::string enc_name = enc.value("name", std::string());
      const json enc_cfg = enc.value("configuration", json::object());
      if (enc_name == "default") {
        a.v3_default_keys = true;
        a.separator = enc_cfg.value("separator", std::string("/"));
      } else if (enc_name == "v2") {
        a.separator = enc_cfg.value("separator", std::string("."));
      } else {
        return Unsupported("chunk_key_encoding '" + enc_name + "'");
      }
      if (a.separator != "." && a.separator != "/") return Invalid("bad chunk key separator");
      if (z.contains("fill_value")) a.fill_value = JsonText(z["fill_value"]);
      const json& codecs = z.at("codecs");
      if (codecs.is_array() && codecs.size() == 1 && codecs[0].value("name", std::string()) == "sharding_indexed") {
        const json& cfg = codecs[0].at("configuration");
        a.sharded = true;
        a.inner = cfg.at("chunk_shape").get<std::vector<int64_t>>();
        RETURN_IF_ERROR(ChunkCodecs(cfg.at("codecs"), a));
        const std::string loc = cfg.value("index_location", std::string("end"));
        if (loc != "end" && loc != "start") return Invalid("index_location '" + loc + "'");
        a.index_at_end = loc == "end";
        const json& ic = cfg.value("index_codecs", json::array());
        for (size_t i = 0; i < ic.size(); ++i) {
          const std::string name = ic[i].at("name").get<std::string>();
          if (i == 0 && name == "bytes" &&
              ic[i].value("configuration", json::object()).value("endian", std::string("little")) == "little") {
            continue;
          }
          if (i == 1 && name == "crc32c" && i + 1 == ic.size()) {
            a.index_crc = true;
            continue;
          }
          return Unsupported("shard index codecs " + JsonText(ic) + " are not supported");
        }
      } else {
        RETURN_IF_ERROR(ChunkCodecs(codecs, a));
      }
    } else {
      return Unsupported("zarr_format " + std::to_string(a.zarr_format) + " (2 and 3 are read)");
    }
  } catch (const json::exception& e) {
    return Invalid(std::string("bad zarr metadata: ") + e.what());
  }
  RETURN_IF_ERROR(CheckGeometry(a));
  return a;
}

Result<std::vector<ShardEntry>> DecodeShardIndex(const ZarrArray& a, std::string_view index, uint64_t value_bytes) {
  const uint64_t n = a.InnerPerShard();
  if (index.size() != a.ShardIndexBytes()) return Invalid("a shard index of the wrong size");
  if (value_bytes < index.size()) {
    return Invalid("a shard of " + std::to_string(value_bytes) + " bytes is shorter than its index (" +
                   std::to_string(index.size()) + ")");
  }
  auto le = [&](size_t at, int bytes) {
    uint64_t v = 0;
    for (int i = bytes; i-- > 0;) v = (v << 8) | static_cast<unsigned char>(index[at + i]);
    return v;
  };
  if (a.index_crc) {
    const uint32_t want = static_cast<uint32_t>(le(16 * n, 4));
    const uint32_t got = Crc32cUpdate(0, index.data(), 16 * n);
    if (want != got) return Invalid("the shard index fails its CRC-32C");
  }
  // Chunk data lies between the index and the other end of the shard.
  const uint64_t lo = a.index_at_end ? 0 : index.size();
  const uint64_t hi = a.index_at_end ? value_bytes - index.size() : value_bytes;
  std::vector<ShardEntry> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    ShardEntry& e = out[i];
    e.offset = le(16 * i, 8);
    e.nbytes = le(16 * i + 8, 8);
    if (e.offset == UINT64_MAX && e.nbytes == UINT64_MAX) {
      e.absent = true;
      continue;
    }
    if (e.offset < lo || e.offset > hi || e.nbytes > hi - e.offset) {
      return Invalid("inner chunk " + std::to_string(i) + " at [" + std::to_string(e.offset) + ", +" +
                     std::to_string(e.nbytes) + ") lies outside the shard's data");
    }
  }
  return out;
}

}  // namespace ckptfs::formats::orbax
