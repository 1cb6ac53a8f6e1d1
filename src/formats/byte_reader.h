// Random access to bytes for the parsers: a memory buffer or a slice of a file.
// Parsers only see this interface, so every parser is testable on in-memory
// bytes and fuzzable; FileSliceReader keeps a head and a tail window so that
// parsing a torch.save item (data.pkl near the start, the ZIP directory at the
// end) costs two preads however many small reads the parser makes.
#ifndef CKPTFS_FORMATS_BYTE_READER_H_
#define CKPTFS_FORMATS_BYTE_READER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

class ByteReader {
 public:
  virtual ~ByteReader() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly [offset, offset+len); an error if that passes size().
  virtual Result<std::string> ReadAt(uint64_t offset, uint64_t len) const = 0;
  // Name used in error messages ("__0_0.distcp @ 431").
  virtual std::string Describe() const = 0;
};

class MemoryReader final : public ByteReader {
 public:
  MemoryReader(std::string_view data, std::string name) : data_(data), name_(std::move(name)) {}
  uint64_t size() const override { return data_.size(); }
  Result<std::string> ReadAt(uint64_t offset, uint64_t len) const override;
  std::string Describe() const override { return name_; }

 private:
  std::string_view data_;
  std::string name_;
};

// A slice [base, base+size) of an open file. Not thread-safe (window cache).
class FileSliceReader final : public ByteReader {
 public:
  static constexpr uint64_t kWindow = 16 * 1024;
  FileSliceReader(int fd, uint64_t base, uint64_t size, std::string name)
      : fd_(fd), base_(base), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  Result<std::string> ReadAt(uint64_t offset, uint64_t len) const override;
  std::string Describe() const override { return name_; }

 private:
  Result<std::string> Pread(uint64_t offset, uint64_t len) const;
  int fd_;
  uint64_t base_;
  uint64_t size_;
  std::string name_;
  mutable std::string head_, tail_;  // [0, head_.size()), [size_-tail_.size(), size_)
  mutable bool head_loaded_ = false, tail_loaded_ = false;
};

// Reads exactly [offset, offset + len) of `fd` into `dst`; a short file is an
// error naming `name`.
Status PreadExact(int fd, uint64_t offset, char* dst, uint64_t len, const std::string& name);

// Opens a regular file read-only and sets `size`, refusing files larger than
// max_bytes. The caller closes the descriptor.
Result<int> OpenBoundedFile(const std::string& path, uint64_t max_bytes, uint64_t* size);

// Reads a whole regular file, refusing files larger than max_bytes.
Result<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes);
// The same for file `rel` of the checkpoint at `root`, opened through
// OpenSourceFile (never a path out of the tree).
Result<std::string> ReadWholeSourceFile(const std::string& root, const std::string& rel, uint64_t max_bytes);

// The entry names of a directory (no "." / ".."), sorted; empty when it
// cannot be listed.
std::vector<std::string> ListDirectory(const std::string& path);

// The `global_step` of the HF Trainer's trainer_state.json in `dir`; -1 when
// it is absent or says none.
int64_t TrainerStateStep(const std::string& dir);

// Opens <dir>/<f.rel_path> read-only and records its fingerprint in `f` (size,
// mtime, inode: what the index checks for staleness). A file that cannot be
// opened is recorded as missing (mtime_ns = -1) and the error says why.
Result<int> OpenAndFingerprint(const std::string& dir, SourceFile& f);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_BYTE_READER_H_
