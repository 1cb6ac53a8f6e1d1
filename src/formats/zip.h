// ZIP directory reader (PKWARE APPNOTE 6.3.x), enough for torch.save archives:
// stored (method 0) entries, ZIP64 (4.3.14-4.3.15 EOCD record and locator,
// 4.5.3 extended information extra field), data descriptors (4.3.9: the local
// header's sizes and CRC may be zero, so sizes come from the central
// directory). The data offset is computed from the *local* header
// (offset + 30 + local name length + local extra length), because torch
// writes local extras (the "FB" alignment pad) that differ from the central
// ones. Every size is checked against the archive size before use.
#ifndef CKPTFS_FORMATS_ZIP_H_
#define CKPTFS_FORMATS_ZIP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "formats/byte_reader.h"

namespace ckptfs::formats {

struct ZipEntry {
  std::string name;
  uint16_t method = 0;  // 0 stored; anything else is refused when read
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0;
  uint64_t size = 0;
  uint64_t local_header_offset = 0;
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;
  const ZipEntry* Find(std::string_view name) const;
};

Result<ZipDirectory> ReadZipDirectory(const ByteReader& r);

// Offset of the entry's first data byte, from its local header. Refuses
// compressed entries and data that would pass the end of the archive.
Result<uint64_t> ZipDataOffset(const ByteReader& r, const ZipEntry& e);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ZIP_H_
