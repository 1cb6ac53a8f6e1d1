// The trust boundary of source files (docs/design.md): OpenSourceFile stays inside
// the checkpoint directory, never blocks on special files, and opens only
// regular files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "../test_util.h"
#include "ckptfs/common.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

TEST(OpenSourceFileTest, StaysInsideNeverBlocksRegularOnly) {
  testing::TempDir t;
  const fs::path root = fs::path(t.path()) / "ck", outside = fs::path(t.path()) / "secret";
  fs::create_directories(root / "sub");
  std::ofstream(root / "sub" / "a.distcp") << "bytes";
  std::ofstream(outside) << "not yours";
  fs::create_symlink("sub/a.distcp", root / "inside_link");            // stays inside: followed
  fs::create_symlink(outside, root / "abs_link");                      // absolute, leaves the tree
  fs::create_symlink("../secret", root / "rel_link");                  // relative, leaves the tree
  fs::create_directory_symlink(fs::path(t.path()), root / "dirlink");  // a directory outside
  ASSERT_EQ(::mkfifo((root / "fifo").c_str(), 0600), 0);

  for (const char* ok : {"sub/a.distcp", "inside_link", "sub/../sub/a.distcp"}) {
    auto fd = OpenSourceFile(root.string(), ok);
    ASSERT_TRUE(fd.ok()) << ok << ": " << fd.status().message();
    ::close(*fd);
  }
  for (const char* out : {"abs_link", "rel_link", "../secret", "dirlink/secret"}) {
    auto fd = OpenSourceFile(root.string(), out);
    ASSERT_FALSE(fd.ok()) << out;
    EXPECT_NE(fd.status().message().find("outside the checkpoint directory"), std::string::npos)
        << fd.status().message();
  }
  const auto start = std::chrono::steady_clock::now();
  auto fifo = OpenSourceFile(root.string(), "fifo");  // would block forever without O_NONBLOCK
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("a FIFO, not a regular file"), std::string::npos) << fifo.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  auto dir = OpenSourceFile(root.string(), "sub");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("a directory"), std::string::npos);
  auto missing = OpenSourceFile(root.string(), "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  auto fifo2 = OpenRegularFile((root / "fifo").string());
  ASSERT_FALSE(fifo2.ok());
}

}  // namespace
}  // namespace ckptfs
