// Large zstd items are streamed, never held whole: reads in order, out of
// order and through sub-boxes equal the tensor; a truncated or corrupt item
// is an error naming it, never short or wrong bytes.
#include <gtest/gtest.h>
#include <zstd.h>

#include <cstdlib>
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
    ck.info.family = Family::kUnknown;
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
  ASSERT_TRUE(
      fx.reader->ReadBox(TensorId{0}, DType::kF32, &box, 0, sub.size() * 4, reinterpret_cast<char*>(sub.data())).ok());
  for (int r = 0; r < 50; ++r) {
    for (int c = 0; c < 11; ++c) ASSERT_EQ(sub[r * 11 + c], fx.values[(100 + r) * 384 + 7 + c]);
  }
}

// One layer after another of a stacked array, each a box across the whole
// item (MaxText's [emb, layers, mlp] read per layer for hf/): the second pass
// from the item's start decodes it once into a file in $TMPDIR, and every
// later box is read from there, so the source is read about twice, not once
// per layer. Without a usable $TMPDIR the same reads stream, with the same
// bytes.
TEST(ZstdStreamTest, OutOfOrderReadsOfALargeItemDecodeItOnce) {
  for (bool usable_tmp : {true, false}) {
    Fixture fx;
    ASSERT_TRUE(fx.Make(256, 8 * 96).ok());  // [256, 8 layers x 96]
    const char* old = std::getenv("TMPDIR");
    const std::string saved = old != nullptr ? old : "";
    if (!usable_tmp) ::setenv("TMPDIR", (fx.t.path() + "/missing").c_str(), 1);
    const uint64_t compressed = ckptfs::testing::ReadFile(fx.t.path() + "/d").size() - 100;
    for (int layer = 7; layer >= 0; --layer) {
      Box box{{0, layer * 96}, {256, 96}};
      std::vector<float> sub(256 * 96);
      ASSERT_TRUE(
          fx.reader->ReadBox(TensorId{0}, DType::kF32, &box, 0, sub.size() * 4, reinterpret_cast<char*>(sub.data()))
              .ok());
      for (int r = 0; r < 256; r += 17) {
        for (int c = 0; c < 96; c += 5) ASSERT_EQ(sub[r * 96 + c], fx.values[r * 768 + layer * 96 + c]);
      }
    }
    if (usable_tmp) {
      EXPECT_LE(fx.reader->source_bytes_read(), 2 * compressed + (1 << 20));
    } else {
      EXPECT_GE(fx.reader->source_bytes_read(), 4 * compressed);  // streamed: a pass per layer
    }
    if (old != nullptr) {
      ::setenv("TMPDIR", saved.c_str(), 1);
    } else {
      ::unsetenv("TMPDIR");
    }
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

#include <sys/resource.h>

#include "formats/zstd.h"

namespace ckptfs {
namespace {

// Frames that declare no content size (a streaming compressor's, as torch's
// ZStandard transform writes them), several of them back to back.
std::string StreamCompress(const std::string& raw, size_t frames) {
  std::string out;
  const size_t per = (raw.size() + frames - 1) / frames;
  for (size_t f = 0; f < frames; ++f) {
    const size_t a = std::min(raw.size(), f * per), b = std::min(raw.size(), a + per);
    ZSTD_CStream* cs = ZSTD_createCStream();
    ZSTD_initCStream(cs, 1);
    std::string buf(ZSTD_CStreamOutSize(), '\0');
    ZSTD_inBuffer ib{raw.data() + a, b - a, 0};
    while (ib.pos < ib.size) {
      ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
      ZSTD_compressStream(cs, &ob, &ib);
      out.append(buf.data(), ob.pos);
    }
    size_t left = 1;
    while (left != 0) {
      ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
      left = ZSTD_endStream(cs, &ob);
      out.append(buf.data(), ob.pos);
    }
    ZSTD_freeCStream(cs);
  }
  return out;
}

std::function<Status(uint64_t, uint64_t, char*)> From(const std::string& z) {
  return [&z](uint64_t off, uint64_t n, char* dst) {
    std::memcpy(dst, z.data() + off, n);
    return Status::Ok();
  };
}

TEST(ZstdCountTest, CountsUndeclaredSizesWithinTheBound) {
  std::mt19937 rng(3);
  std::string raw(3 << 20, '\0');
  for (size_t i = 0; i < raw.size(); i += 3) raw[i] = static_cast<char>(rng() % 7);
  const std::string z = StreamCompress(raw, 3);
  ASSERT_EQ(ZSTD_getFrameContentSize(z.data(), z.size()), ZSTD_CONTENTSIZE_UNKNOWN);
  auto n = formats::ZstdCountDecompressed(From(z), z.size(), raw.size(), "item");
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(*n, raw.size());
  auto over = formats::ZstdCountDecompressed(From(z), z.size(), raw.size() - 1, "x.distcp @ 0");
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("x.distcp @ 0"), std::string::npos);
  EXPECT_NE(over.status().message().find("--max-item-bytes"), std::string::npos);
  auto cut = formats::ZstdCountDecompressed(From(z), z.size() - 9, raw.size(), "item");
  ASSERT_FALSE(cut.ok());
  std::string bad = z;
  bad[bad.size() / 2] ^= 0x5A;
  bad[bad.size() / 2 + 1] ^= 0x33;
  EXPECT_FALSE(formats::ZstdCountDecompressed(From(bad), bad.size(), raw.size() * 2, "item").ok());
  EXPECT_FALSE(formats::ZstdCountDecompressed(From(z), 0, raw.size(), "item").ok());
}

// 1 GiB of undeclared-size output counted with the memory of the decoder and
// a 1 MiB input piece: the peak RSS grows by far less than the item.
TEST(ZstdCountTest, AGigabyteItemIsCountedInBoundedMemory) {
  std::string zeros(64 << 20, '\0');
  std::string z;
  for (int i = 0; i < 16; ++i) z += StreamCompress(zeros, 1);
  zeros.clear();
  zeros.shrink_to_fit();
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  auto n = formats::ZstdCountDecompressed(From(z), z.size(), 2ull << 30, "item");
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(*n, 1ull << 30);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 64 << 10) << "KiB of peak RSS growth";
}

}  // namespace
}  // namespace ckptfs
