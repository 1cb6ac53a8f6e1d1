#include "formats/safetensors/safetensors_header.h"

#include <nlohmann/json.hpp>

#include "ckptfs/geometry.h"
#include "formats/byte_reader.h"

namespace ckptfs::formats {
namespace {

using json = nlohmann::json;

Result<std::vector<int64_t>> ShapeOf(const json& s) {
  if (!s.is_array() || s.size() > 64) return Invalid("shape is not a list of at most 64 sizes");
  std::vector<int64_t> shape;
  for (const json& d : s) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 62))
      return Invalid("shape has a size that is not a count");
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

}  // namespace

bool LooksLikeSafetensorsAt(int fd, uint64_t base, uint64_t limit) {
  char b[9];
  if (limit < base || limit - base < 10 || !PreadExact(fd, base, b, 9, "").ok()) return false;
  if (b[0] == 'P' && b[1] == 'K') return false;  // a ZIP (torch.save) item
  const uint64_t n = LoadLE<uint64_t>(b);
  return n >= 2 && n <= limit - base - 8;
}

Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t base, uint64_t limit, const std::string& name) {
  auto bad = [&](const std::string& why) { return Invalid("cannot parse " + name + ": " + why); };
  if (limit < base || limit - base < 8) return bad("shorter than a safetensors header length (8 bytes; truncated?)");
  char lenb[8];
  RETURN_IF_ERROR(PreadExact(fd, base, lenb, 8, name));
  const uint64_t n = LoadLE<uint64_t>(lenb);
  if (n > kMaxSafetensorsHeader) {
    return bad("safetensors header of " + std::to_string(n) + " bytes is more than the format's limit (" +
               std::to_string(kMaxSafetensorsHeader) + ")");
  }
  if (n > limit - base - 8) {
    return bad("safetensors header of " + std::to_string(n) + " bytes passes the end of the data (" +
               std::to_string(limit - base - 8) + " bytes after the length; truncated?)");
  }
  std::string text(n, '\0');
  RETURN_IF_ERROR(PreadExact(fd, base + 8, text.data(), n, name));
  const json h = json::parse(text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) return bad("safetensors header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = base + 8 + n;
  const uint64_t data_bytes = limit - out.data_start;
  for (const auto& item : h.items()) {
    const std::string& key = item.key();  // a variable, not a binding: clang 14 cannot capture bindings
    const json& v = item.value();
    if (key == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string()) return bad("__metadata__ value '" + mk + "' is not a string");
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    auto tensor = [&](const std::string& why) { return bad("tensor '" + key + "': " + why); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return tensor("entry lacks dtype, shape or data_offsets");
    }
    SafetensorsEntry e;
    e.name = key;
    const json& dt = v["dtype"];
    if (!dt.is_string()) return tensor("dtype is not a string");
    e.dtype = DTypeFromSafetensorsName(dt.get<std::string>());
    if (e.dtype == DType::kInvalid)
      return Unsupported("cannot read " + name + ": tensor '" + key + "' has dtype " + dt.dump() +
                         ", which ckptfs does not read");
    auto shape = ShapeOf(v["shape"]);
    if (!shape.ok()) return tensor(shape.status().message());
    e.shape = std::move(*shape);
    const json& offs = v["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned()) {
      return tensor("data_offsets is not [begin, end]");
    }
    const uint64_t b = offs[0].get<uint64_t>(), en = offs[1].get<uint64_t>();
    if (b > en || en > data_bytes) {
      return tensor("data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] lie outside the " +
                    std::to_string(data_bytes) + " data bytes (truncated?)");
    }
    uint64_t bytes = DTypeSize(e.dtype);
    for (int64_t d : e.shape) {
      if (MulOverflow(bytes, static_cast<uint64_t>(d), &bytes)) return tensor("shape overflows");
    }
    if (bytes != en - b) {
      return tensor("shape " + ShapeStr(e.shape) + " of " + std::string(DTypeName(e.dtype)) + " needs " +
                    std::to_string(bytes) + " bytes, data_offsets give " + std::to_string(en - b));
    }
    e.begin = out.data_start + b;
    e.end = out.data_start + en;
    out.entries.push_back(std::move(e));
  }
  return out;
}

Result<std::map<std::string, std::vector<int64_t>>> DcpShardingInfo(const SafetensorsHeader& h,
                                                                    const std::string& name) {
  std::map<std::string, std::vector<int64_t>> out;
  auto it = h.metadata.find("DCP_SHARDING_INFO");
  if (it == h.metadata.end()) return out;
  auto bad = [&](const std::string& why) { return Invalid("cannot parse " + name + ": DCP_SHARDING_INFO " + why); };
  const json j = json::parse(it->second, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("is not a JSON object");
  for (const auto& [fqn, v] : j.items()) {
    if (!v.is_object() || !v.contains("saved_offsets") || !v["saved_offsets"].is_array()) {
      return bad("entry '" + fqn + "' has no saved_offsets list");
    }
    std::vector<int64_t> offs;
    for (const json& o : v["saved_offsets"]) {
      if (!o.is_number_unsigned() || o.get<uint64_t>() > (uint64_t{1} << 62)) {
        return bad("entry '" + fqn + "' has an offset that is not a count");
      }
      offs.push_back(o.get<int64_t>());
    }
    out.emplace(fqn, std::move(offs));
  }
  return out;
}

}  // namespace ckptfs::formats
