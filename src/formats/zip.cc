#include "formats/zip.h"

#include <algorithm>

namespace ckptfs::formats {
namespace {

constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint64_t kEocdSize = 22;
constexpr uint64_t kMaxComment = 65535;
constexpr uint64_t kMaxCentralDir = 256ull << 20;

Status Bad(const ByteReader& r, const std::string& why) {
  return Invalid("cannot read zip " + r.Describe() + ": " + why);
}

}  // namespace

const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<ZipDirectory> ReadZipDirectory(const ByteReader& r) {
  const uint64_t size = r.size();
  if (size < kEocdSize) return Bad(r, "too small to be a zip (" + std::to_string(size) + " bytes)");
  // 4.3.16: the EOCD is the last record, followed only by a comment.
  uint64_t tail_len = std::min(size, kEocdSize + kMaxComment);
  ASSIGN_OR_RETURN(std::string tail, r.ReadAt(size - tail_len, tail_len));
  int64_t pos = -1;
  for (int64_t i = static_cast<int64_t>(tail_len - kEocdSize); i >= 0; --i) {
    if (LoadLE<uint32_t>(tail.data() + i) == kEocdSig) {
      uint16_t comment = LoadLE<uint16_t>(tail.data() + i + 20);
      if (static_cast<uint64_t>(i) + kEocdSize + comment == tail_len) {
        pos = i;
        break;
      }
    }
  }
  if (pos < 0) return Bad(r, "no end-of-central-directory record (truncated?)");
  const char* eocd = tail.data() + pos;
  uint64_t eocd_abs = size - tail_len + static_cast<uint64_t>(pos);
  uint64_t count = LoadLE<uint16_t>(eocd + 10);
  uint64_t cd_size = LoadLE<uint32_t>(eocd + 12);
  uint64_t cd_offset = LoadLE<uint32_t>(eocd + 16);

  // 4.3.15: a ZIP64 locator sits right before the EOCD.
  if (eocd_abs >= 20) {
    ASSIGN_OR_RETURN(std::string loc, r.ReadAt(eocd_abs - 20, 20));
    if (LoadLE<uint32_t>(loc.data()) == kZip64LocatorSig) {
      uint64_t z64 = LoadLE<uint64_t>(loc.data() + 8);
      if (z64 > eocd_abs || eocd_abs - z64 < 56) return Bad(r, "ZIP64 locator points outside the archive");
      ASSIGN_OR_RETURN(std::string rec, r.ReadAt(z64, 56));
      if (LoadLE<uint32_t>(rec.data()) != kZip64EocdSig) return Bad(r, "bad ZIP64 end-of-central-directory signature");
      count = LoadLE<uint64_t>(rec.data() + 32);
      cd_size = LoadLE<uint64_t>(rec.data() + 40);
      cd_offset = LoadLE<uint64_t>(rec.data() + 48);
    }
  }
  uint64_t cd_end;
  if (AddOverflow(cd_offset, cd_size, &cd_end) || cd_end > eocd_abs) {
    return Bad(r, "central directory [" + std::to_string(cd_offset) + ", +" + std::to_string(cd_size) +
                      ") lies outside the archive");
  }
  if (cd_size > kMaxCentralDir) return Bad(r, "central directory too large");
  if (count > cd_size / 46) return Bad(r, "entry count " + std::to_string(count) + " does not fit the directory");
  ASSIGN_OR_RETURN(std::string cd, r.ReadAt(cd_offset, cd_size));

  ZipDirectory dir;
  dir.entries.reserve(count);
  uint64_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (p + 46 > cd.size()) return Bad(r, "central directory truncated at entry " + std::to_string(i));
    const char* h = cd.data() + p;
    if (LoadLE<uint32_t>(h) != kCentralSig) return Bad(r, "bad central header signature at entry " + std::to_string(i));
    ZipEntry e;
    e.method = LoadLE<uint16_t>(h + 10);
    e.crc32 = LoadLE<uint32_t>(h + 16);
    e.compressed_size = LoadLE<uint32_t>(h + 20);
    e.size = LoadLE<uint32_t>(h + 24);
    uint16_t name_len = LoadLE<uint16_t>(h + 28);
    uint16_t extra_len = LoadLE<uint16_t>(h + 30);
    uint16_t comment_len = LoadLE<uint16_t>(h + 32);
    e.local_header_offset = LoadLE<uint32_t>(h + 42);
    uint64_t rec_len = 46ull + name_len + extra_len + comment_len;
    if (p + rec_len > cd.size()) return Bad(r, "central header " + std::to_string(i) + " passes the directory end");
    e.name.assign(h + 46, name_len);
    // 4.5.3: ZIP64 extra holds, in order, the fields whose 32-bit value is 0xFFFFFFFF.
    const char* x = h + 46 + name_len;
    uint64_t xp = 0;
    while (xp + 4 <= extra_len) {
      uint16_t id = LoadLE<uint16_t>(x + xp);
      uint16_t len = LoadLE<uint16_t>(x + xp + 2);
      if (xp + 4 + len > extra_len) return Bad(r, "extra field of '" + e.name + "' passes its header");
      if (id == 0x0001) {
        const char* v = x + xp + 4;
        uint64_t vp = 0;
        auto take = [&](uint64_t* field) -> bool {
          if (*field != 0xFFFFFFFFull) return true;
          if (vp + 8 > len) return false;
          *field = LoadLE<uint64_t>(v + vp);
          vp += 8;
          return true;
        };
        if (!take(&e.size) || !take(&e.compressed_size) || !take(&e.local_header_offset)) {
          return Bad(r, "short ZIP64 extra field in '" + e.name + "'");
        }
      }
      xp += 4ull + len;
    }
    dir.entries.push_back(std::move(e));
    p += rec_len;
  }
  return dir;
}

Result<uint64_t> ZipDataOffset(const ByteReader& r, const ZipEntry& e) {
  if (e.method != 0) {
    return Bad(r, "entry '" + e.name + "' is compressed (method " + std::to_string(e.method) +
                      "); torch.save archives store entries uncompressed");
  }
  if (e.compressed_size != e.size) return Bad(r, "entry '" + e.name + "' has differing stored and real sizes");
  if (e.local_header_offset > r.size() || r.size() - e.local_header_offset < 30) {
    return Bad(r, "local header of '" + e.name + "' lies outside the archive");
  }
  ASSIGN_OR_RETURN(std::string h, r.ReadAt(e.local_header_offset, 30));
  if (LoadLE<uint32_t>(h.data()) != kLocalSig) return Bad(r, "bad local header signature for '" + e.name + "'");
  uint64_t data = e.local_header_offset + 30 + LoadLE<uint16_t>(h.data() + 26) + LoadLE<uint16_t>(h.data() + 28);
  uint64_t end;
  if (AddOverflow(data, e.size, &end) || end > r.size()) {
    return Bad(r, "data of '" + e.name + "' (" + std::to_string(e.size) + " bytes at " + std::to_string(data) +
                      ") passes the end of the archive (" + std::to_string(r.size()) + " bytes)");
  }
  return data;
}

}  // namespace ckptfs::formats
