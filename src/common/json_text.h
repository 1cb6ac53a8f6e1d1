// JSON text of values that may hold names from a checkpoint. nlohmann's dump
// throws (type_error.316) on a string that is not valid UTF-8; every dump in
// ckptfs goes through JsonText, which cannot throw for that reason: names are
// made valid at ReadCheckpoint (EscapeNonUtf8), and anything else that slips
// through (a file name in a message) has its invalid bytes replaced by U+FFFD.
#ifndef CKPTFS_COMMON_JSON_TEXT_H_
#define CKPTFS_COMMON_JSON_TEXT_H_

#include <string>

namespace ckptfs {

template <typename Json>
std::string JsonText(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_JSON_TEXT_H_
