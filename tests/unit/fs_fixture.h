// Unit-test helper: a committed fixture (tests/data/<rel>) copied into a
// temporary directory and opened by the FUSE-free core, its index beside the
// copy, so nothing is written into tests/data.
#ifndef CKPTFS_TESTS_UNIT_FS_FIXTURE_H_
#define CKPTFS_TESTS_UNIT_FS_FIXTURE_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>

#include "ckptfs/fs.h"
#include "test_util.h"

namespace ckptfs::testing {

inline std::unique_ptr<Filesystem> OpenFixtureCopy(const TempDir& tmp, const std::string& rel,
                                                   bool read_ahead = false) {
  const std::string src = tmp.path() + "/ck";
  std::filesystem::copy(std::string(CKPTFS_TEST_DATA) + "/" + rel, src, std::filesystem::copy_options::recursive);
  FsOptions o;
  o.src = src;
  o.index_dir = tmp.path() + "/index";
  o.gpu = GpuMode::kOff;
  o.read_ahead = read_ahead;
  auto f = Filesystem::Open(o);
  EXPECT_TRUE(f.ok()) << rel << ": " << f.status().message();
  return f.ok() ? std::move(f).value() : nullptr;
}

// The whole of file `path` of the view, read through fs.Read in 1 MiB pieces.
inline std::string ReadAll(Filesystem& fs, const std::string& path) {
  auto ino = fs.view().Resolve(path);
  EXPECT_TRUE(ino.ok()) << path;
  if (!ino.ok()) return "";
  auto a = fs.GetAttr(*ino);
  std::string out(a->size, '\0');
  for (uint64_t off = 0; off < out.size();) {
    auto n = fs.Read(*ino, off, std::min<size_t>(1 << 20, out.size() - off), out.data() + off);
    EXPECT_TRUE(n.ok()) << n.status().message();
    if (!n.ok() || *n == 0) break;
    off += *n;
  }
  return out;
}

}  // namespace ckptfs::testing

#endif  // CKPTFS_TESTS_UNIT_FS_FIXTURE_H_
