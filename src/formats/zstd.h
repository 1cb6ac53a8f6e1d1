// zstd stream decompression for DCP storage transforms ("stream.zstd/1",
// torch.distributed.checkpoint._extension.ZStandard): frames may be
// concatenated; the output is bounded so that a corrupt or hostile stream
// cannot exhaust memory.
#ifndef CKPTFS_FORMATS_ZSTD_H_
#define CKPTFS_FORMATS_ZSTD_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "ckptfs/common.h"

namespace ckptfs::formats {

// Fails, naming `what`, when the output would pass `max_out` bytes: before
// allocating when the frames declare their size, else as soon as it does.
Result<std::string> ZstdDecompress(std::string_view in, uint64_t max_out, const std::string& what);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ZSTD_H_
