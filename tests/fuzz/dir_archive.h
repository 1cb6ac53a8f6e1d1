// The directory archive the fuzz targets take and the conformance suite
// reads its seeds from (tests/fuzz/make_corpus.py writes them). Little-endian,
// repeated until the input ends:
//   u16 name_len, name (a relative path; '/'-separated), u32 data_len, data.
// A truncated record ends the archive. Names are made safe before use: empty,
// '.' and '..' components dropped, NUL -> '_', at most 4 components of at
// most 64 bytes; a record whose name becomes empty is skipped.
#ifndef CKPTFS_TESTS_FUZZ_DIR_ARCHIVE_H_
#define CKPTFS_TESTS_FUZZ_DIR_ARCHIVE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace ckptfs::fuzz {

inline std::string SafeArchiveName(std::string_view raw) {
  std::string out;
  int parts = 0;
  size_t pos = 0;
  while (pos <= raw.size() && parts < 4) {
    size_t slash = raw.find('/', pos);
    if (slash == std::string_view::npos) slash = raw.size();
    std::string c(raw.substr(pos, std::min<size_t>(slash - pos, 64)));
    for (char& ch : c) {
      if (ch == '\0') ch = '_';
    }
    pos = slash + 1;
    if (c.empty() || c == "." || c == "..") continue;
    out += (parts++ ? "/" : "") + c;
  }
  return out;
}

// Calls fn(safe name, data) for each record whose name stays non-empty.
template <typename Fn>
void ForEachArchiveFile(const uint8_t* data, size_t size, Fn&& fn) {
  size_t p = 0;
  while (p + 2 <= size) {
    uint16_t nl;
    std::memcpy(&nl, data + p, 2);
    p += 2;
    if (p + nl + 4 > size) break;
    const std::string name = SafeArchiveName(std::string_view(reinterpret_cast<const char*>(data + p), nl));
    p += nl;
    uint32_t dl;
    std::memcpy(&dl, data + p, 4);
    p += 4;
    if (dl > size - p) dl = static_cast<uint32_t>(size - p);
    if (!name.empty()) fn(name, std::string_view(reinterpret_cast<const char*>(data + p), dl));
    p += dl;
  }
}

// Writes the archive's files under `dir` (which exists).
inline void UnpackArchive(const uint8_t* data, size_t size, const std::string& dir) {
  namespace fs = std::filesystem;
  ForEachArchiveFile(data, size, [&](const std::string& name, std::string_view bytes) {
    std::error_code ec;
    const fs::path path = fs::path(dir) / name;
    fs::create_directories(path.parent_path(), ec);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  });
}

}  // namespace ckptfs::fuzz

#endif  // CKPTFS_TESTS_FUZZ_DIR_ARCHIVE_H_
