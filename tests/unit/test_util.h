// Helpers shared by the unit tests: temporary directories and a synthetic
// checkpoint writer (a raw data file plus a Checkpoint record) that lets the
// index, views and read engine be tested without any family parser.
#ifndef CKPTFS_TESTS_UNIT_TEST_UTIL_H_
#define CKPTFS_TESTS_UNIT_TEST_UTIL_H_

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ckptfs/geometry.h"
#include "ckptfs/model.h"

namespace ckptfs::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ckptfs-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void WriteFile(const std::string& p, const std::string& data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline void FillStat(const std::string& dir, SourceFile* f) {
  struct stat st {};
  ::stat((dir + "/" + f->rel_path).c_str(), &st);
  f->size = static_cast<uint64_t>(st.st_size);
  f->mtime_ns = StatNs(st.st_mtim);
  f->ctime_ns = StatNs(st.st_ctim);
  f->inode = st.st_ino;
}

// One fragment holding a whole tensor of `shape`, contiguous (C order) at
// byte `offset` of the data file.
inline Fragment WholeFragment(const std::vector<int64_t>& shape, DType dtype, uint64_t offset) {
  Fragment f;
  f.offsets.assign(shape.size(), 0);
  f.lengths = shape;
  f.strides = ContiguousStrides(shape);
  f.dtype = dtype;
  f.data_offset = offset;
  f.data_length = static_cast<uint64_t>(NumelOf(shape)) * DTypeSize(dtype);
  return f;
}

}  // namespace ckptfs::testing

#endif  // CKPTFS_TESTS_UNIT_TEST_UTIL_H_
