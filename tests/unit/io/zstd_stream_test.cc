// Large zstd items are streamed, never held whole: reads in order, out of
// order and through sub-boxes equal the tensor; a truncated or corrupt item
// is an error naming it, never short or wrong bytes.
#include <gtest/gtest.h>
#include <zstd.h>

#include <numeric>
#include <random>

#include "../test_util.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

struct Fixture {
  TempDir t;
  std::vector<float> values;
  std::unique_ptr<Index> ix;
  std::unique_ptr<TensorReader> reader;

  // rows x cols floats in one zstd item at offset 100 of file "d";
  // `cut` bytes dropped from the compressed item, `flip` flips one byte.
  Status Make(int64_t rows, int64_t cols, size_t cut = 0, bool flip = false) {
    values.resize(static_cast<size_t>(rows * cols));
    std::mt19937 rng(3);
    for (auto& v : values) v = static_cast<float>(rng() % 1000) / 7.f;
    std::string raw(reinterpret_cast<const char*>(values.data()), values.size() * 4);
    std::string z(ZSTD_compressBound(raw.size()), '\0');
    z.resize(ZSTD_compress(z.data(), z.size(), raw.data(), raw.size(), 1));
    z.resize(z.size() - cut);
    if (flip) z[z.size() / 2] ^= 0x5a;
    ckptfs::testing::WriteFile(t.path() + "/d", std::string(100, 'x') + z);
    Checkpoint ck;
    ck.info.family = "synthetic";
    ck.files.push_back(SourceFile{"d", 0, 0, 0});
    ckptfs::testing::FillStat(t.path(), &ck.files[0]);
    TensorRecord r;
    r.key = r.fqn = "w";
    r.role = Role::kParam;
    r.state = "param";
    r.dtype = DType::kF32;
    r.shape = {rows, cols};
    Fragment f;
    f.file = FileId{0};
    f.offsets = {0, 0};
    f.lengths = {rows, cols};
    f.strides = {cols, 1};
    f.dtype = DType::kF32;
    f.compression = Compression::kZstd;
    f.item_offset = 100;
    f.item_length = z.size();
    f.data_offset = 0;
    f.data_length = raw.size();
    ck.AddTensor(r, {f});
    RETURN_IF_ERROR(Index::Build(ck, t.path() + "/ix"));
    ASSIGN_OR_RETURN(ix, Index::Open(t.path() + "/ix", t.path()));
    ASSIGN_OR_RETURN(reader, TensorReader::Open(*ix, EngineKind::kPread));
    reader->set_stream_items_above(1 << 16);
    return Status::Ok();
  }
};

TEST(ZstdStreamTest, RangesInAnyOrderAndSubBoxesEqualTheTensor) {
  Fixture fx;
  ASSERT_TRUE(fx.Make(512, 384).ok());
  const uint64_t size = fx.values.size() * 4;
  const char* want = reinterpret_cast<const char*>(fx.values.data());
  std::mt19937_64 rng(5);
  std::string got;
  for (int i = 0; i < 60; ++i) {  // forward, backward, overlapping
    const uint64_t off = rng() % size, len = 1 + rng() % std::min<uint64_t>(size - off, 300000);
    got.assign(len, '\0');
    ASSERT_TRUE(fx.reader->Read(TensorId{0}, DType::kF32, off, len, got.data()).ok());
    ASSERT_EQ(0, std::memcmp(got.data(), want + off, len)) << off << "+" << len;
  }
  got.assign(size, '\0');
  for (uint64_t off = 0; off < size; off += 65536) {  // sequential: one cursor, no restart
    const uint64_t len = std::min<uint64_t>(65536, size - off);
    ASSERT_TRUE(fx.reader->Read(TensorId{0}, DType::kF32, off, len, got.data() + off).ok());
  }
  EXPECT_EQ(0, std::memcmp(got.data(), want, size));
  Box box{{100, 7}, {50, 11}};  // strided: many small spans
  std::vector<float> sub(50 * 11);
  ASSERT_TRUE(fx.reader->ReadBox(TensorId{0}, DType::kF32, &box, 0, sub.size() * 4,
                                 reinterpret_cast<char*>(sub.data())).ok());
  for (int r = 0; r < 50; ++r) {
    for (int c = 0; c < 11; ++c) ASSERT_EQ(sub[r * 11 + c], fx.values[(100 + r) * 384 + 7 + c]);
  }
}

TEST(ZstdStreamTest, TruncatedOrCorruptItemsAreErrors) {
  for (bool flip : {false, true}) {
    Fixture fx;
    ASSERT_TRUE(fx.Make(512, 384, flip ? 0 : 40, flip).ok());
    std::string got(fx.values.size() * 4, '\0');
    Status s = fx.reader->Read(TensorId{0}, DType::kF32, 0, got.size(), got.data());
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("cannot decompress d @ 100"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace ckptfs
