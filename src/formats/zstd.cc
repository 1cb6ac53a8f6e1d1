#include "formats/zstd.h"

#include <zstd.h>

#include <memory>

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

Result<uint64_t> ZstdCountDecompressed(const std::function<Status(uint64_t, uint64_t, char*)>& input, uint64_t in_size,
                                       uint64_t max_out, const std::string& what) {
  std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream*)> ds(ZSTD_createDStream(), ZSTD_freeDStream);
  if (ds == nullptr) return Internal("cannot allocate a zstd stream");
  constexpr uint64_t kInPiece = 1 << 20;
  std::string in, buf(ZSTD_DStreamOutSize(), '\0');
  uint64_t in_pos = 0, total = 0;
  size_t ret = 0;
  bool started = false;
  while (in_pos < in_size) {
    const uint64_t n = std::min(kInPiece, in_size - in_pos);
    in.assign(static_cast<size_t>(n), '\0');
    RETURN_IF_ERROR(input(in_pos, n, in.data()));
    in_pos += n;
    ZSTD_inBuffer ib{in.data(), in.size(), 0};
    // Drain this piece; the decoder may still hold output when it is used up.
    while (ib.pos < ib.size || (ret != 0 && started)) {
      ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
      ret = ZSTD_decompressStream(ds.get(), &ob, &ib);
      started = true;
      if (ZSTD_isError(ret)) return Invalid("cannot decompress " + what + ": " + ZSTD_getErrorName(ret));
      total += ob.pos;
      if (total > max_out) {
        return Invalid("cannot decompress " + what + ": output larger than " + std::to_string(max_out) +
                       " (--max-item-bytes)");
      }
      if (ob.pos == 0 && ib.pos == ib.size) break;  // needs more input (or done)
    }
  }
  if (!started || ret != 0) return Invalid("cannot decompress " + what + ": truncated zstd stream");
  return total;
}

ZstdCursor::ZstdCursor(Input input, uint64_t in_size, uint64_t max_out, std::string what)
    : input_(std::move(input)), in_size_(in_size), max_out_(max_out), what_(std::move(what)) {
  ds_ = ZSTD_createDStream();
}

ZstdCursor::~ZstdCursor() { ZSTD_freeDStream(static_cast<ZSTD_DStream*>(ds_)); }

Result<std::string> ZstdCursor::Read(uint64_t from, uint64_t len) {
  if (ds_ == nullptr) return Internal("cannot allocate a zstd stream");
  if (from < out_pos_) return Internal("zstd cursor asked to go back");
  uint64_t end = 0;
  if (AddOverflow(from, len, &end) || end > max_out_) {
    return Invalid("cannot decompress " + what_ + ": output larger than " + std::to_string(max_out_));
  }
  auto* ds = static_cast<ZSTD_DStream*>(ds_);
  std::string out;
  out.reserve(static_cast<size_t>(len));
  std::string buf(ZSTD_DStreamOutSize(), '\0');
  constexpr uint64_t kInPiece = 1 << 20;
  while (out_pos_ < end) {
    if (in_buf_pos_ == in_buf_.size()) {
      if (in_pos_ == in_size_) return Invalid("cannot decompress " + what_ + ": truncated zstd stream");
      const uint64_t n = std::min(kInPiece, in_size_ - in_pos_);
      in_buf_.assign(static_cast<size_t>(n), '\0');
      RETURN_IF_ERROR(input_(in_pos_, n, in_buf_.data()));
      in_pos_ += n;
      in_buf_pos_ = 0;
    }
    ZSTD_inBuffer ib{in_buf_.data(), in_buf_.size(), in_buf_pos_};
    // Never past `end`: what follows stays in the decoder for the next read.
    ZSTD_outBuffer ob{buf.data(), static_cast<size_t>(std::min<uint64_t>(buf.size(), end - out_pos_)), 0};
    const size_t ret = ZSTD_decompressStream(ds, &ob, &ib);
    if (ZSTD_isError(ret)) return Invalid("cannot decompress " + what_ + ": " + ZSTD_getErrorName(ret));
    in_buf_pos_ = ib.pos;
    // Keep the part of [out_pos_, out_pos_ + ob.pos) that falls in [from, end).
    const uint64_t lo = std::max(out_pos_, from), hi = out_pos_ + ob.pos;
    if (hi > lo) out.append(buf.data() + (lo - out_pos_), static_cast<size_t>(hi - lo));
    out_pos_ += ob.pos;
    if (ob.pos == 0 && ib.pos == ib.size && in_pos_ == in_size_ && ret == 0) {
      return Invalid("cannot decompress " + what_ + ": the item ends at byte " + std::to_string(out_pos_) +
                     ", the metadata needs " + std::to_string(end));
    }
  }
  return out;
}

}  // namespace ckptfs::formats
