// JSON text of values that may hold names from a checkpoint. nlohmann's dump
// throws (type_error.316) on a string that is not valid UTF-8; every dump in
// ckptfs goes through JsonText, which cannot throw for that reason: names are
// made valid at ReadCheckpoint (EscapeNonUtf8), and anything else that slips
// through (a file name in a message) has its invalid bytes replaced by U+FFFD.
#ifndef CKPTFS_COMMON_JSON_TEXT_H_
#define CKPTFS_COMMON_JSON_TEXT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ckptfs {

template <typename Json>
std::string JsonText(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

// Appends [a,b,...]: what nlohmann's compact dump writes for a list of ints.
inline void AppendJsonInts(std::string& out, const std::vector<int64_t>& v) {
  out += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(v[i]);
  }
  out += ']';
}

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_JSON_TEXT_H_
