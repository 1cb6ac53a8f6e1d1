// zstd stream decompression for DCP storage transforms ("stream.zstd/1",
// torch.distributed.checkpoint._extension.ZStandard): frames may be
// concatenated; the output is bounded so that a corrupt or hostile stream
// cannot exhaust memory.
#ifndef CKPTFS_FORMATS_ZSTD_H_
#define CKPTFS_FORMATS_ZSTD_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "ckptfs/common.h"

namespace ckptfs::formats {

// Fails, naming `what`, when the output would pass `max_out` bytes: before
// allocating when the frames declare their size, else as soon as it does.
Result<std::string> ZstdDecompress(std::string_view in, uint64_t max_out, const std::string& what);

// The decompressed size of a compressed item whose input is fetched in
// pieces (ZstdCursor's Input), counted by decoding it through a fixed
// buffer: memory is the decoder's window plus 1 MiB of input, whatever the
// item's size (a bytes item whose frames declare no content size). Fails,
// naming `what`, past `max_out` decompressed bytes or on a corrupt or
// truncated stream.
Result<uint64_t> ZstdCountDecompressed(const std::function<Status(uint64_t, uint64_t, char*)>& input, uint64_t in_size,
                                       uint64_t max_out, const std::string& what);

// Forward-only streaming decompression of one compressed item whose input is
// fetched in pieces: a large item is never held whole, and sequential reads
// continue where the last one stopped (a read behind the cursor needs a new
// cursor). Memory: the decoder's window plus 1 MiB of input.
class ZstdCursor {
 public:
  // Reads n compressed bytes at `off` (relative to the item) into dst.
  using Input = std::function<Status(uint64_t off, uint64_t n, char* dst)>;
  ZstdCursor(Input input, uint64_t in_size, uint64_t max_out, std::string what);
  ~ZstdCursor();
  ZstdCursor(const ZstdCursor&) = delete;
  ZstdCursor& operator=(const ZstdCursor&) = delete;
  // Decompressed bytes produced so far.
  uint64_t position() const { return out_pos_; }
  // Decompressed bytes [from, from + len), from >= position(): the bytes
  // before `from` are decoded and dropped. Fails (naming `what`) on a corrupt
  // or truncated stream, or past max_out.
  Result<std::string> Read(uint64_t from, uint64_t len);

 private:
  Input input_;
  uint64_t in_size_, max_out_;
  std::string what_;
  void* ds_ = nullptr;  // ZSTD_DStream
  std::string in_buf_;
  size_t in_buf_pos_ = 0;
  uint64_t in_pos_ = 0;   // compressed bytes fetched
  uint64_t out_pos_ = 0;  // decompressed bytes produced
};

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ZSTD_H_
