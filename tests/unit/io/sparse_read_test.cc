// A box strided through a large fragment (one layer of a stack [emb, layers,
// mlp], as hf/ reads MaxText's scanned kernels) reads its rows, not the
// gaps between them: the source bytes read stay near the bytes the box
// needs, and the bytes equal the tensor's.
#include <gtest/gtest.h>

#include <random>

#include "../test_util.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"

namespace ckptfs {
namespace {

TEST(SparseReadTest, ALayerOfAStackReadsItsRowsOnly) {
  ckptfs::testing::TempDir t;
  constexpr int64_t kEmb = 64, kLayers = 16, kMlp = 2048;  // 120 KiB between two rows of a layer
  std::vector<float> values(static_cast<size_t>(kEmb * kLayers * kMlp));
  std::mt19937 rng(11);
  for (auto& v : values) v = static_cast<float>(rng() % 10000) / 3.f;
  ckptfs::testing::WriteFile(t.path() + "/d",
                             std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.files.push_back(SourceFile{"d", 0, 0, 0});
  ckptfs::testing::FillStat(t.path(), &ck.files[0]);
  TensorRecord r;
  r.key = r.fqn = "wi";
  r.role = Role::kParam;
  r.state = "param";
  r.dtype = DType::kF32;
  r.shape = {kEmb, kLayers, kMlp};
  ck.AddTensor(r, {ckptfs::testing::WholeFragment(r.shape, DType::kF32, 0)});
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  for (EngineKind kind : {EngineKind::kPread, EngineKind::kUring}) {
    auto reader = TensorReader::Open(**ix, kind);
    if (!reader.ok()) continue;  // io_uring unavailable here
    const uint64_t needed = kEmb * kMlp * 4;
    for (int64_t layer : {5, 0, 15}) {
      const uint64_t before = (*reader)->source_bytes_read();
      Box box{{0, layer, 0}, {kEmb, 1, kMlp}};
      std::vector<float> got(static_cast<size_t>(kEmb * kMlp));
      ASSERT_TRUE((*reader)
                      ->ReadBox(TensorId{0}, DType::kF32, &box, 0, got.size() * 4, reinterpret_cast<char*>(got.data()))
                      .ok());
      for (int64_t e = 0; e < kEmb; ++e) {
        for (int64_t m = 0; m < kMlp; ++m) {
          ASSERT_EQ(got[static_cast<size_t>(e * kMlp + m)],
                    values[static_cast<size_t>((e * kLayers + layer) * kMlp + m)]);
        }
      }
      const uint64_t read = (*reader)->source_bytes_read() - before;
      EXPECT_LE(read, 2 * needed) << "layer " << layer << ": read " << read << " bytes for " << needed;
      // A sub-box inside a row is still one span per row.
      Box part{{3, layer, 100}, {40, 1, 7}};  // rows of 28 bytes, 128 KiB apart
      std::vector<float> small(40 * 7);
      ASSERT_TRUE(
          (*reader)
              ->ReadBox(TensorId{0}, DType::kF32, &part, 0, small.size() * 4, reinterpret_cast<char*>(small.data()))
              .ok());
      for (int64_t e = 0; e < 40; ++e) {
        for (int64_t m = 0; m < 7; ++m) {
          ASSERT_EQ(small[static_cast<size_t>(e * 7 + m)],
                    values[static_cast<size_t>(((3 + e) * kLayers + layer) * kMlp + 100 + m)]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace ckptfs
