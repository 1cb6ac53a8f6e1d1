// Binary codec for index records. Little-endian fixed-width fields, u32
// length-prefixed strings and vectors; every decode checks the remaining
// length first, so a corrupt index is an error, never a crash. The schema
// version in index.h changes whenever a layout here changes.
#ifndef CKPTFS_INDEX_CODEC_H_
#define CKPTFS_INDEX_CODEC_H_

#include <string>
#include <string_view>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::index {

std::string EncodeFile(const SourceFile& f);
std::string EncodeTensor(const TensorRecord& t);
std::string EncodeFragment(const Fragment& f);
std::string EncodeInfo(const CheckpointInfo& i);
std::string EncodeExport(const ExportFile& x);
std::string EncodeChecksum(const ChecksumRange& c);
Result<ChecksumRange> DecodeChecksum(std::string_view s);
Result<SourceFile> DecodeFile(std::string_view s);
Result<TensorRecord> DecodeTensor(std::string_view s);
Result<Fragment> DecodeFragment(std::string_view s);
Result<CheckpointInfo> DecodeInfo(std::string_view s);
Result<ExportFile> DecodeExport(std::string_view s);

// Big-endian numbers, so RocksDB's bytewise order equals numeric order.
std::string KeyU32(char tag, uint32_t a);
std::string KeyU32U32(char tag, uint32_t a, uint32_t b);
std::string KeyU32U64(char tag, uint32_t a, uint64_t b);

}  // namespace ckptfs::index

#endif  // CKPTFS_INDEX_CODEC_H_
