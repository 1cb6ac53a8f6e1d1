#include "formats/zstd.h"

#include <zstd.h>

namespace ckptfs::formats {

Result<std::string> ZstdDecompress(std::string_view in, uint64_t max_out, const std::string& what) {
  // A first frame that declares its size (zstd's default) is checked before any
  // output is allocated; the others are bounded while streaming, below.
  const unsigned long long declared = ZSTD_getFrameContentSize(in.data(), in.size());
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != ZSTD_CONTENTSIZE_ERROR && declared > max_out) {
    return Invalid("cannot decompress " + what + ": its first frame declares " + std::to_string(declared) +
                   " bytes, more than the " + std::to_string(max_out) + " the metadata allows");
  }
  std::string out;
  ZSTD_DStream* ds = ZSTD_createDStream();
  if (ds == nullptr) return Internal("cannot allocate a zstd stream");
  ZSTD_inBuffer ib{in.data(), in.size(), 0};
  std::string buf(ZSTD_DStreamOutSize(), '\0');
  size_t ret = 1;
  while (ib.pos < ib.size) {
    ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
    ret = ZSTD_decompressStream(ds, &ob, &ib);
    if (ZSTD_isError(ret)) {
      ZSTD_freeDStream(ds);
      return Invalid("cannot decompress " + what + ": " + ZSTD_getErrorName(ret));
    }
    out.append(buf.data(), ob.pos);
    if (out.size() > max_out) {
      ZSTD_freeDStream(ds);
      return Invalid("cannot decompress " + what + ": output larger than " + std::to_string(max_out));
    }
    if (ob.pos == 0 && ret != 0 && ib.pos == ib.size) break;
  }
  // Flush what the decoder still holds.
  while (ret != 0) {
    ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
    ret = ZSTD_decompressStream(ds, &ob, &ib);
    if (ZSTD_isError(ret)) {
      ZSTD_freeDStream(ds);
      return Invalid("cannot decompress " + what + ": " + ZSTD_getErrorName(ret));
    }
    if (ob.pos == 0) break;
    out.append(buf.data(), ob.pos);
  }
  ZSTD_freeDStream(ds);
  if (ret != 0) return Invalid("cannot decompress " + what + ": truncated zstd stream");
  return out;
}

}  // namespace ckptfs::formats
