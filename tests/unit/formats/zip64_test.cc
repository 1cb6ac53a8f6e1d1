// ZIP64 and large offsets: a hand-built archive whose sizes and offsets live in
// ZIP64 extra fields (APPNOTE 4.5.3) behind 0xFFFFFFFF markers, with a local
// extra that differs from the central one, and a torch.save item placed 5 GiB
// into a sparse file (a .distcp item beyond 4 GiB).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "../test_util.h"
#include "formats/torch_save.h"
#include "formats/zip.h"

namespace ckptfs::formats {
namespace {

template <typename T>
void Put(std::string& s, T v) {
  char b[sizeof(T)];
  StoreLE(b, v);
  s.append(b, sizeof(T));
}

std::string BuildZip64(const std::string& name, const std::string& data, uint16_t local_pad) {
  std::string z;
  // Local header: sizes zero (data descriptor flag), extras: ZIP64 (16 bytes) + an "FB" pad.
  Put<uint32_t>(z, 0x04034b50);
  Put<uint16_t>(z, 45);
  Put<uint16_t>(z, 0x0808);
  Put<uint16_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint16_t>(z, static_cast<uint16_t>(name.size()));
  Put<uint16_t>(z, static_cast<uint16_t>(20 + 4 + local_pad));
  z += name;
  Put<uint16_t>(z, 0x0001);
  Put<uint16_t>(z, 16);
  Put<uint64_t>(z, data.size());
  Put<uint64_t>(z, data.size());
  Put<uint16_t>(z, 0x4246);
  Put<uint16_t>(z, local_pad);
  z.append(local_pad, 'Z');
  z += data;
  // Data descriptor, ZIP64 form.
  Put<uint32_t>(z, 0x08074b50);
  Put<uint32_t>(z, 0);
  Put<uint64_t>(z, data.size());
  Put<uint64_t>(z, data.size());
  uint64_t cd = z.size();
  Put<uint32_t>(z, 0x02014b50);
  Put<uint16_t>(z, 45);
  Put<uint16_t>(z, 45);
  Put<uint16_t>(z, 0x0808);
  Put<uint16_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint16_t>(z, static_cast<uint16_t>(name.size()));
  Put<uint16_t>(z, 28);
  Put<uint16_t>(z, 0);
  Put<uint16_t>(z, 0);
  Put<uint16_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0xFFFFFFFF);
  z += name;
  Put<uint16_t>(z, 0x0001);
  Put<uint16_t>(z, 24);
  Put<uint64_t>(z, data.size());
  Put<uint64_t>(z, data.size());
  Put<uint64_t>(z, 0);  // local header offset
  uint64_t cd_size = z.size() - cd;
  uint64_t z64 = z.size();
  Put<uint32_t>(z, 0x06064b50);
  Put<uint64_t>(z, 44);
  Put<uint16_t>(z, 45);
  Put<uint16_t>(z, 45);
  Put<uint32_t>(z, 0);
  Put<uint32_t>(z, 0);
  Put<uint64_t>(z, 1);
  Put<uint64_t>(z, 1);
  Put<uint64_t>(z, cd_size);
  Put<uint64_t>(z, cd);
  Put<uint32_t>(z, 0x07064b50);
  Put<uint32_t>(z, 0);
  Put<uint64_t>(z, z64);
  Put<uint32_t>(z, 1);
  Put<uint32_t>(z, 0x06054b50);
  Put<uint16_t>(z, 0);
  Put<uint16_t>(z, 0);
  Put<uint16_t>(z, 0xFFFF);
  Put<uint16_t>(z, 0xFFFF);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint32_t>(z, 0xFFFFFFFF);
  Put<uint16_t>(z, 0);
  return z;
}

TEST(Zip64Test, SizesAndOffsetsFromExtrasDataFromLocalHeader) {
  std::string z = BuildZip64("archive/data/0", "0123456789", 33);
  MemoryReader r(z, "z64");
  auto dir = ReadZipDirectory(r);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  ASSERT_EQ(dir->entries.size(), 1u);
  EXPECT_EQ(dir->entries[0].size, 10u);
  auto off = ZipDataOffset(r, dir->entries[0]);
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_EQ(z.substr(*off, 10), "0123456789");
  // Every truncation fails cleanly.
  for (size_t n = 0; n < z.size(); ++n) {
    std::string cut = z.substr(0, n);
    MemoryReader rc(cut, "cut");
    auto d = ReadZipDirectory(rc);
    if (d.ok() && !d->entries.empty()) (void)ZipDataOffset(rc, d->entries[0]).ok();
  }
}

TEST(Zip64Test, ItemBeyondFourGiBInASparseFile) {
  ckptfs::testing::TempDir t;
  std::string item = ckptfs::testing::ReadFile(std::string(CKPTFS_TEST_DATA) + "/sample.pt");
  const uint64_t base = 5ull << 30;
  std::string path = t.path() + "/big.distcp";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, item.data(), item.size(), static_cast<off_t>(base)), static_cast<ssize_t>(item.size()));
  FileSliceReader r(fd, base, item.size(), "big.distcp @ 5 GiB");
  auto a = ReadTorchSave(r);
  ASSERT_TRUE(a.ok()) << a.status().message();
  const PyValue* v = a->root->Get("view");
  auto rt = ResolveTensor(r, *a, v->tensor());
  ASSERT_TRUE(rt.ok());
  float f;
  ASSERT_EQ(::pread(fd, &f, 4, static_cast<off_t>(base + rt->data_offset)), 4);
  EXPECT_EQ(f, 5.0f);
  ::close(fd);
}

}  // namespace
}  // namespace ckptfs::formats
