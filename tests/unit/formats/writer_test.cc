// The writers behind synthesized files: PickleWriter round-trips through the
// pickle VM, and TorchSaveParts lays out archives the torch.save reader (and
// its ZIP/ZIP64 directory parser) accepts, with correct CRCs and 64-byte
// aligned records.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include "../test_util.h"
#include "formats/byte_reader.h"
#include "formats/pickle.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save.h"
#include "formats/torch_save_writer.h"
#include "formats/zip.h"

namespace ckptfs::formats {
namespace {

std::string WriteSample() {
  PickleWriter w;
  w.BeginDict();
  w.Str("small");
  w.Int(7);
  w.Str("mid");
  w.Int(40000);
  w.Str("neg");
  w.Int(-5);
  w.Str("big");
  w.Int(-(int64_t{1} << 40) - 3);
  w.Str("f");
  w.Float(0.1);
  w.Str("flags");
  w.BeginTuple();
  w.Bool(true);
  w.Bool(false);
  w.None();
  w.EndTuple();
  w.Str("blob");
  w.Bytes(std::string("\x00\xff\x10", 3));
  w.Str("list");
  w.BeginList();
  w.Str("a");
  w.Int(1);
  w.EndList();
  w.Str("obj");  // argparse.Namespace() with state, the NEWOBJ + BUILD form
  w.Global("argparse", "Namespace");
  w.BeginTuple();
  w.EndTuple();
  w.NewObj();
  w.BeginDict();
  w.Str("lr");
  w.Float(1e-3);
  w.EndDict();
  w.Build();
  w.EndDict();
  return w.Finish();
}

TEST(PickleWriterTest, RoundTripsThroughTheVm) {
  std::string data = WriteSample();
  auto v = Unpickle(data, "sample");
  ASSERT_TRUE(v.ok()) << v.status().message();
  const PyValue& d = **v;
  EXPECT_EQ(d.Get("small")->i, 7);
  EXPECT_EQ(d.Get("mid")->i, 40000);
  EXPECT_EQ(d.Get("neg")->i, -5);
  EXPECT_EQ(d.Get("big")->i, -(int64_t{1} << 40) - 3);
  EXPECT_DOUBLE_EQ(d.Get("f")->f, 0.1);
  ASSERT_EQ(d.Get("flags")->items.size(), 3u);
  EXPECT_TRUE(d.Get("flags")->items[0]->b);
  EXPECT_EQ(d.Get("flags")->items[2]->kind, PyKind::kNone);
  EXPECT_EQ(d.Get("blob")->s, std::string("\x00\xff\x10", 3));
  EXPECT_EQ(d.Get("list")->items[0]->s, "a");
  const PyValue* obj = d.Get("obj");
  EXPECT_EQ(obj->ClassName(), "Namespace");
  EXPECT_TRUE(obj->newobj);
  EXPECT_DOUBLE_EQ(obj->Attr("lr")->f, 1e-3);
}

TEST(PickleWriterTest, ReemittingAParsedValueIsStable) {
  std::string first = WriteSample();
  auto v = Unpickle(first, "sample");
  ASSERT_TRUE(v.ok());
  PickleWriter w;
  auto no_tensors = [](PickleWriter&, const PyValue&) { return Unsupported("tensor"); };
  ASSERT_TRUE(w.Value(**v, no_tensors).ok());
  EXPECT_EQ(w.Finish(), first);
}

// Renders parts with `content` standing for tensor 0's bytes.
std::string Materialize(const std::vector<ExportPart>& parts, const std::string& content) {
  std::string out;
  for (const auto& p : parts) {
    if (p.kind == PartKind::kLiteral) {
      out += p.literal;
    } else if (p.kind == PartKind::kTensor) {
      out += content;
    } else {
      uint32_t c = static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(content.data()), content.size()));
      char b[4];
      StoreLE(b, c);
      out.append(b, 4);
    }
  }
  return out;
}

TEST(TorchSaveWriterTest, ArchiveReadsBackWithAlignedRecordAndCrc) {
  PickleWriter w;
  w.BeginDict();
  w.Str("param");
  ASSERT_TRUE(w.Tensor("0", DType::kF32, 6, 0, {2, 3}, {3, 1}).ok());
  w.EndDict();
  std::string content(24, '\0');
  for (int i = 0; i < 24; ++i) content[i] = static_cast<char>(i * 7);
  auto parts = TorchSaveParts("fp32", w.Finish(), {ArchiveStorage{0, DType::kF32, 24, {}}});
  std::string file = Materialize(parts, content);
  EXPECT_EQ(file.size(), PartsSize(parts));
  MemoryReader r(file, "fp32.pt");
  auto a = ReadTorchSave(r);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->prefix, "fp32");
  const PyValue* t = a->root->Get("param");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->kind, PyKind::kTensor);
  EXPECT_EQ(t->tensor().shape, (std::vector<int64_t>{2, 3}));
  auto rt = ResolveTensor(r, *a, t->tensor());
  ASSERT_TRUE(rt.ok()) << rt.status().message();
  EXPECT_EQ(rt->data_offset % 64, 0u);
  EXPECT_EQ(file.substr(rt->data_offset, 24), content);
  const ZipEntry* e = a->zip.Find("fp32/data/0");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->crc32, static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(content.data()), 24)));
  EXPECT_NE(a->zip.Find("fp32/version"), nullptr);
}

TEST(TorchSaveWriterTest, Zip64WhenARecordPassesFourGiB) {
  // A 5 GiB record, materialized sparsely: only the literal parts are written.
  const uint64_t n = 5ull << 30;
  PickleWriter w;
  ASSERT_TRUE(w.Tensor("0", DType::kU8, n, 0, {static_cast<int64_t>(n)}, {1}).ok());
  auto parts = TorchSaveParts("big", w.Finish(), {ArchiveStorage{0, DType::kU8, n, {}}});
  testing::TempDir tmp;
  std::string path = tmp.path() + "/big.pt";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  uint64_t off = 0;
  for (const auto& p : parts) {
    if (p.kind == PartKind::kLiteral) {
      ASSERT_EQ(::pwrite(fd, p.literal.data(), p.literal.size(), static_cast<off_t>(off)),
                static_cast<ssize_t>(p.literal.size()));
    }
    off += p.size;
  }
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(off)), 0);
  FileSliceReader r(fd, 0, off, "big.pt");
  auto a = ReadTorchSave(r);
  ASSERT_TRUE(a.ok()) << a.status().message();
  const ZipEntry* e = a->zip.Find("big/data/0");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->size, n);
  auto rt = ResolveTensor(r, *a, a->root->tensor());
  ASSERT_TRUE(rt.ok()) << rt.status().message();
  EXPECT_EQ(rt->data_length, n);
  ::close(fd);
}

}  // namespace
}  // namespace ckptfs::formats
