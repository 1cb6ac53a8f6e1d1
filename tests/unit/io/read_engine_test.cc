// Read-engine conformance: random tensors split into random boxes along any
// dimension (uneven, empty, transposed storage), written to a data file,
// indexed, then read back in random byte ranges by every engine and compared
// with the tensor itself. Also conversions and range decomposition.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "../test_util.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

TEST(DecomposeRangeTest, BoxesTileTheRangeInOrder) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 500; ++iter) {
    size_t rank = rng() % 4;
    std::vector<int64_t> shape(rank);
    uint64_t numel = 1;
    for (auto& s : shape) {
      s = 1 + rng() % 5;
      numel *= static_cast<uint64_t>(s);
    }
    uint64_t a = rng() % (numel + 1), b = rng() % (numel + 1);
    if (a > b) std::swap(a, b);
    std::vector<Box> boxes = DecomposeRange(shape, a, b);
    EXPECT_LE(boxes.size(), std::max<size_t>(1, 2 * rank));
    std::vector<uint64_t> flat;
    for (const Box& bx : boxes) {
      // enumerate the box in row-major order
      std::vector<int64_t> idx(rank, 0);
      uint64_t vol = 1;
      for (auto l : bx.lengths) vol *= static_cast<uint64_t>(l);
      for (uint64_t k = 0; k < vol; ++k) {
        uint64_t rem = k, f = 0;
        for (size_t d = rank; d-- > 0;) {
          idx[d] = bx.offsets[d] + static_cast<int64_t>(rem % static_cast<uint64_t>(bx.lengths[d]));
          rem /= static_cast<uint64_t>(bx.lengths[d]);
        }
        for (size_t d = 0; d < rank; ++d) f = f * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(idx[d]);
        flat.push_back(f);
      }
    }
    std::vector<uint64_t> want(b - a);
    std::iota(want.begin(), want.end(), a);
    EXPECT_EQ(flat, want);
  }
}

TEST(ConvertTest, WideningIsExact) {
  const uint16_t bf[] = {0x3f80, 0xc020, 0x0001, 0x7f80};
  float out[4];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(bf), DType::kBF16, 1, reinterpret_cast<char*>(out), DType::kF32, 4)
          .ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_GT(out[2], 0.0f);
  EXPECT_TRUE(std::isinf(out[3]));
  const uint16_t h[] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0xfc00};
  float ho[5];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(h), DType::kF16, 1, reinterpret_cast<char*>(ho), DType::kF32, 5).ok());
  EXPECT_EQ(ho[0], 1.0f);
  EXPECT_EQ(ho[1], -2.0f);
  EXPECT_EQ(ho[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(ho[3], 65504.0f);
  EXPECT_TRUE(std::isinf(ho[4]) && ho[4] < 0);
  // fp8 e4m3fn: 0x38 = 1.0, 0x7e = 448 (max), 0x7f = NaN, 0x01 = 2^-9.
  const uint8_t f8[] = {0x38, 0x7e, 0x7f, 0x01, 0xb8};
  float fo[5];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(f8), DType::kF8E4M3FN, 1, reinterpret_cast<char*>(fo), DType::kF32, 5)
          .ok());
  EXPECT_EQ(fo[0], 1.0f);
  EXPECT_EQ(fo[1], 448.0f);
  EXPECT_TRUE(std::isnan(fo[2]));
  EXPECT_EQ(fo[3], std::ldexp(1.0f, -9));
  EXPECT_EQ(fo[4], -1.0f);
  // e5m2: 0x3c = 1.0, 0x7c = inf, 0x7b = 57344.
  const uint8_t e5[] = {0x3c, 0x7c, 0x7b};
  float eo[3];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(e5), DType::kF8E5M2, 1, reinterpret_cast<char*>(eo), DType::kF32, 3)
          .ok());
  EXPECT_EQ(eo[0], 1.0f);
  EXPECT_TRUE(std::isinf(eo[1]));
  EXPECT_EQ(eo[2], 57344.0f);
  // Narrowing float32 rounds to nearest even (ties to even, overflow to inf,
  // NaN canonical), strided sources too.
  const uint32_t f[] = {0x3F801000u, 0x3F803000u, 0x477FF000u, 0x3F808000u, 0x7FC01234u, 0x3F818000u};
  uint16_t n16[3];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(f), DType::kF32, 2, reinterpret_cast<char*>(n16), DType::kF16, 3).ok());
  EXPECT_EQ(n16[0], 0x3C00);  // 1 + 2^-11: the tie goes to the even 1.0
  EXPECT_EQ(n16[1], 0x7C00);  // 65520: inf
  EXPECT_EQ(n16[2], 0x7E00);  // NaN
  uint16_t b16[6];
  ASSERT_TRUE(
      ConvertRun(reinterpret_cast<const char*>(f), DType::kF32, 1, reinterpret_cast<char*>(b16), DType::kBF16, 6).ok());
  EXPECT_EQ(b16[1], 0x3F80);  // 1 + 2^-11 rounds down
  EXPECT_EQ(b16[3], 0x3F80);  // 1 + 2^-8: the tie goes to the even 1.0
  EXPECT_EQ(b16[5], 0x3F82);  // 1 + 3 * 2^-8: the tie goes up to the even
  EXPECT_EQ(b16[4], 0x7FC0);
  EXPECT_TRUE(CanConvert(DType::kF32, DType::kF16));
  EXPECT_TRUE(CanConvert(DType::kF32, DType::kBF16));
  EXPECT_FALSE(CanConvert(DType::kF64, DType::kF32));
  EXPECT_FALSE(CanConvert(DType::kBF16, DType::kF16));
  EXPECT_FALSE(CanConvert(DType::kF32, DType::kF8E4M3FN));
}

struct Synthetic {
  Checkpoint ck;
  std::vector<std::vector<char>> full;  // per tensor, C-order source bytes
};

// Writes tensors split into random boxes; each box stored C-order or
// transposed (reversed strides) in one data file.
Synthetic MakeSynthetic(const std::string& dir, uint32_t seed, int n_tensors) {
  std::mt19937 rng(seed);
  Synthetic s;
  s.ck.info.family = Family::kUnknown;
  s.ck.files.push_back(SourceFile{"data.bin", 0, 0, 0});
  std::string data;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kI64, DType::kF16, DType::kU8};
  for (int ti = 0; ti < n_tensors; ++ti) {
    TensorRecord t;
    t.key = "t" + std::to_string(ti);
    t.fqn = t.key;
    t.state = "param";
    t.role = Role::kParam;
    t.dtype = dtypes[rng() % 5];
    size_t rank = rng() % 4;
    for (size_t d = 0; d < rank; ++d) t.shape.push_back(static_cast<int64_t>(rng() % 9));
    if (rng() % 4 == 0 && rank > 0) t.shape[rng() % rank] = 1;
    const size_t esz = DTypeSize(t.dtype);
    const uint64_t numel = t.Numel();
    t.byte_size = numel * esz;
    std::vector<char> full(numel * esz);
    for (auto& c : full) c = static_cast<char>(rng());
    // Split each dim into 1-3 uneven parts (possibly empty).
    std::vector<std::vector<int64_t>> cuts(rank);
    for (size_t d = 0; d < rank; ++d) {
      cuts[d] = {0, t.shape[d]};
      int extra = static_cast<int>(rng() % 3);
      for (int k = 0; k < extra; ++k)
        cuts[d].push_back(t.shape[d] ? static_cast<int64_t>(rng() % (t.shape[d] + 1)) : 0);
      std::sort(cuts[d].begin(), cuts[d].end());
    }
    size_t combos = 1;
    for (size_t d = 0; d < rank; ++d) combos *= cuts[d].size() - 1;
    std::vector<Fragment> frags;
    for (size_t c = 0; c < combos; ++c) {
      std::vector<size_t> ci(rank);
      size_t rem = c;
      for (size_t d = rank; d-- > 0;) {
        ci[d] = rem % (cuts[d].size() - 1);
        rem /= cuts[d].size() - 1;
      }
      Fragment f;
      f.file = FileId{0};
      f.dtype = t.dtype;
      uint64_t vol = 1;
      for (size_t d = 0; d < rank; ++d) {
        f.offsets.push_back(cuts[d][ci[d]]);
        f.lengths.push_back(cuts[d][ci[d] + 1] - cuts[d][ci[d]]);
        vol *= static_cast<uint64_t>(f.lengths.back());
      }
      bool transposed = rank >= 2 && rng() % 2;
      f.strides.assign(rank, 1);
      if (transposed) {  // column-major storage of the box
        for (size_t d = 1; d < rank; ++d) f.strides[d] = f.strides[d - 1] * f.lengths[d - 1];
      } else {
        for (size_t d = rank; d-- > 1;) f.strides[d - 1] = f.strides[d] * f.lengths[d];
      }
      data.append(rng() % 50, '\x5a');  // unrelated bytes between fragments
      f.data_offset = data.size();
      f.data_length = vol * esz;
      std::string bytes(vol * esz, '\0');
      for (uint64_t k = 0; k < vol; ++k) {  // local row-major index -> storage position
        uint64_t r2 = k, gflat = 0, spos = 0;
        std::vector<int64_t> li(rank);
        for (size_t d = rank; d-- > 0;) {
          li[d] = static_cast<int64_t>(r2 % static_cast<uint64_t>(f.lengths[d]));
          r2 /= static_cast<uint64_t>(f.lengths[d]);
        }
        for (size_t d = 0; d < rank; ++d) {
          gflat = gflat * static_cast<uint64_t>(t.shape[d]) + static_cast<uint64_t>(f.offsets[d] + li[d]);
          spos += static_cast<uint64_t>(li[d] * f.strides[d]);
        }
        std::memcpy(bytes.data() + spos * esz, full.data() + gflat * esz, esz);
      }
      data += bytes;
      frags.push_back(f);
    }
    t.num_fragments = static_cast<uint32_t>(frags.size());
    s.ck.tensors.push_back(t);
    s.ck.fragments.Append(frags);
    s.full.push_back(full);
  }
  ckptfs::testing::WriteFile(dir + "/data.bin", data);
  ckptfs::testing::FillStat(dir, &s.ck.files[0]);
  return s;
}

class ReadEngineConformance : public ::testing::TestWithParam<EngineKind> {
 protected:
  // Indexes `s` (written under t_) and opens a reader with the engine under
  // test. An io_uring the machine refuses leaves reader_ null and says why in
  // skip_ (the test skips).
  void Open(const Synthetic& s) {
    ASSERT_TRUE(Index::Build(s.ck, t_.path() + "/index").ok());
    auto ix = Index::Open(t_.path() + "/index", t_.path());
    ASSERT_TRUE(ix.ok()) << ix.status().message();
    ix_ = std::move(*ix);
    auto reader = TensorReader::Open(*ix_, GetParam());
    if (!reader.ok() && GetParam() == EngineKind::kUring) {
      skip_ = reader.status().message();
      return;
    }
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    reader_ = std::move(*reader);
  }
  TempDir t_;
  std::unique_ptr<Index> ix_;
  std::unique_ptr<TensorReader> reader_;
  std::string skip_;
};

#define OPEN_OR_SKIP(s)             \
  ASSERT_NO_FATAL_FAILURE(Open(s)); \
  if (!reader_) GTEST_SKIP() << skip_

TEST_P(ReadEngineConformance, RandomRangesEqualTheTensor) {
  Synthetic s = MakeSynthetic(t_.path(), 11, 60);
  OPEN_OR_SKIP(s);
  std::mt19937 rng(3);
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    const auto& full = s.full[i];
    std::vector<char> out(full.size());
    ASSERT_TRUE(reader_->Read(TensorId{i}, s.ck.tensors[i].dtype, 0, full.size(), out.data()).ok());
    EXPECT_EQ(out, full) << "tensor " << i;
    for (int k = 0; k < 20 && !full.empty(); ++k) {
      uint64_t a = rng() % full.size(), b = rng() % (full.size() + 1);
      if (a > b) std::swap(a, b);
      std::vector<char> part(b - a);
      Status st = reader_->Read(TensorId{i}, s.ck.tensors[i].dtype, a, b - a, part.data());
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_TRUE(std::equal(part.begin(), part.end(), full.begin() + static_cast<ptrdiff_t>(a)))
          << "tensor " << i << " range " << a << "-" << b;
    }
    if (s.ck.tensors[i].dtype == DType::kBF16 && !full.empty()) {  // widened read
      std::vector<char> wide(full.size() * 2);
      ASSERT_TRUE(reader_->Read(TensorId{i}, DType::kF32, 0, wide.size(), wide.data()).ok());
      for (size_t e = 0; e < full.size() / 2; ++e) {
        EXPECT_EQ(wide[4 * e + 2], full[2 * e]);
        EXPECT_EQ(wide[4 * e + 3], full[2 * e + 1]);
        EXPECT_EQ(wide[4 * e], 0);
      }
    }
  }
}

// Row boxes of every 2-D tensor (fragments split and stored transposed at
// random), concatenated out of order and transposed: every range of the
// result equals the transpose computed here, at any byte offset.
TEST_P(ReadEngineConformance, TransposedRowBoxesEqualTheTranspose) {
  Synthetic s = MakeSynthetic(t_.path(), 17, 80);
  OPEN_OR_SKIP(s);
  std::mt19937 rng(5);
  int checked = 0;
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    const TensorRecord& tr = s.ck.tensors[i];
    if (tr.shape.size() != 2 || tr.shape[0] < 2) continue;
    const int64_t rows = tr.shape[0], cols = tr.shape[1];
    const uint64_t esz = DTypeSize(tr.dtype);
    // The second half of the rows, then the first (GPT-2's q|k|v regrouping is such a reorder).
    const int64_t half = rows / 2;
    const std::vector<Box> boxes = {Box{{half, 0}, {rows - half, cols}}, Box{{0, 0}, {half, cols}}};
    std::vector<int64_t> order;
    for (int64_t r = half; r < rows; ++r) order.push_back(r);
    for (int64_t r = 0; r < half; ++r) order.push_back(r);
    std::vector<char> want(s.full[i].size());
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t k = 0; k < rows; ++k) {
        std::memcpy(want.data() + static_cast<size_t>(c * rows + k) * esz,
                    s.full[i].data() + static_cast<size_t>(order[static_cast<size_t>(k)] * cols + c) * esz, esz);
      }
    }
    std::vector<char> got(want.size());
    Status st = reader_->ReadTransposedRows(TensorId{i}, tr.dtype, boxes, Transpose{}, 0, got.size(), got.data());
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(got, want) << "tensor " << i;
    for (int k = 0; k < 10 && !want.empty(); ++k) {
      uint64_t a = rng() % want.size(), b = rng() % (want.size() + 1);
      if (a > b) std::swap(a, b);
      std::vector<char> part(b - a);
      st = reader_->ReadTransposedRows(TensorId{i}, tr.dtype, boxes, Transpose{}, a, b - a, part.data());
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + static_cast<ptrdiff_t>(a)))
          << "tensor " << i << " range " << a << "-" << b;
    }
    ++checked;
    // Boxes whose columns differ are refused.
    if (cols > 1) {
      const std::vector<Box> partial = {Box{{0, 0}, {1, cols}}, Box{{0, 0}, {1, cols - 1}}};
      std::vector<char> one(esz);
      EXPECT_FALSE(reader_->ReadTransposedRows(TensorId{i}, tr.dtype, partial, Transpose{}, 0, esz, one.data()).ok());
    }
  }
  EXPECT_GT(checked, 5);
}

// A box of every tensor of rank 3 or more, one index of axis 1 (a MaxText
// layer of a scanned stack), read as a matrix whose columns are its last
// axes, transposed, and with each group of output rows reordered from
// interleaved pairs to halves (a rotary head): every range equals the
// transpose computed here element by element.
TEST_P(ReadEngineConformance, TransposedBoxesOfAnyRankWithRotaryGroups) {
  Synthetic s = MakeSynthetic(t_.path(), 23, 120);
  OPEN_OR_SKIP(s);
  int checked = 0;
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    const TensorRecord& tr = s.ck.tensors[i];
    const size_t rank = tr.shape.size();
    if (rank < 3 || NumelOf(tr.shape) == 0) continue;
    const uint64_t esz = DTypeSize(tr.dtype);
    for (uint32_t col_axes = 1; col_axes + 1 < rank; ++col_axes) {
      Box box{std::vector<int64_t>(rank, 0), tr.shape};
      box.offsets[1] = tr.shape[1] - 1;
      box.lengths[1] = 1;
      const size_t a = rank - col_axes;
      int64_t rows = 1, cols = 1;
      for (size_t d = 0; d < rank; ++d) (d < a ? rows : cols) *= box.lengths[d];
      const uint32_t group = tr.shape.back() % 2 == 0 ? static_cast<uint32_t>(tr.shape.back()) : 0;
      const std::vector<int64_t> strides = ContiguousStrides(tr.shape);
      std::vector<char> want(static_cast<size_t>(rows * cols) * esz);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          // Element (r, c) of the box-matrix: unravel r over the row axes,
          // c over the column axes (C order), offset by the box.
          std::vector<int64_t> idx(rank);
          int64_t rr = r, cc = c;
          for (size_t d = rank; d-- > 0;) {
            int64_t& v = d < a ? rr : cc;
            idx[d] = box.offsets[d] + v % box.lengths[d];
            v /= box.lengths[d];
          }
          // Output row of column c: within its group, halves from pairs.
          int64_t out_row = c;
          if (group > 0) {
            const int64_t g = group, base = c - c % g, k = c % g;
            out_row = base + (k % 2 == 0 ? k / 2 : g / 2 + k / 2);
          }
          std::memcpy(want.data() + static_cast<size_t>(out_row * rows + r) * esz,
                      s.full[i].data() + static_cast<size_t>(FlatIndex(idx, strides)) * esz, esz);
        }
      }
      const Transpose how{col_axes, group};
      std::vector<char> got(want.size());
      Status st = reader_->ReadTransposedRows(TensorId{i}, tr.dtype, {box}, how, 0, got.size(), got.data());
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(got, want) << "tensor " << i << " col_axes " << col_axes;
      // A range at an odd offset.
      if (got.size() > 3) {
        std::vector<char> part(got.size() - 3);
        ASSERT_TRUE(reader_->ReadTransposedRows(TensorId{i}, tr.dtype, {box}, how, 1, part.size(), part.data()).ok());
        EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + 1));
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 3);
}

// A transpose larger than one slab (about 4 MiB of output rows): ranges
// across slab borders, a second row plan of the same tensor, and a slab kept
// from an earlier read is not served once its source changed.
TEST_P(ReadEngineConformance, TransposedReadsAcrossSlabsAndStaleSlabs) {
  Synthetic s;
  s.ck.info.family = Family::kUnknown;
  s.ck.files.push_back(SourceFile{"data.bin", 0, 0, 0});
  const int64_t rows = 6, cols = 400000, split = 123457;  // 6 rows of bf16: slabs of 349525 output rows
  TensorRecord t;
  t.key = t.fqn = "w";
  t.state = "param";
  t.role = Role::kParam;
  t.dtype = DType::kBF16;
  t.shape = {rows, cols};
  t.byte_size = static_cast<uint64_t>(rows * cols) * 2;
  std::mt19937 rng(9);
  std::vector<char> full(t.byte_size);
  for (char& c : full) c = static_cast<char>(rng());
  // Two column blocks: [:, :split] row-major, [:, split:] column-major.
  std::string data;
  std::vector<Fragment> frags;
  for (int part = 0; part < 2; ++part) {
    Fragment f;
    f.file = FileId{0};
    f.dtype = t.dtype;
    const int64_t c0 = part == 0 ? 0 : split, w = part == 0 ? split : cols - split;
    f.offsets = {0, c0};
    f.lengths = {rows, w};
    f.strides = part == 0 ? std::vector<int64_t>{w, 1} : std::vector<int64_t>{1, rows};
    f.data_offset = data.size();
    f.data_length = static_cast<uint64_t>(rows * w) * 2;
    for (int64_t k = 0; k < rows * w; ++k) {
      const int64_t r = part == 0 ? k / w : k % rows, c = part == 0 ? k % w : k / rows;
      data.append(full.data() + (r * cols + c0 + c) * 2, 2);
    }
    frags.push_back(f);
  }
  t.num_fragments = 2;
  s.ck.tensors.push_back(t);
  s.ck.fragments.Append(frags);
  ckptfs::testing::WriteFile(t_.path() + "/data.bin", data);
  ckptfs::testing::FillStat(t_.path(), &s.ck.files[0]);
  OPEN_OR_SKIP(s);

  auto transpose = [&](const std::vector<int64_t>& order) {
    std::vector<char> want(full.size());
    for (int64_t c = 0; c < cols; ++c) {
      for (size_t k = 0; k < order.size(); ++k) {
        std::memcpy(want.data() + (c * rows + static_cast<int64_t>(k)) * 2, full.data() + (order[k] * cols + c) * 2, 2);
      }
    }
    return want;
  };
  const std::vector<Box> halves = {Box{{3, 0}, {3, cols}}, Box{{0, 0}, {3, cols}}};
  const std::vector<char> want = transpose({3, 4, 5, 0, 1, 2});
  std::vector<char> got(want.size());
  ASSERT_TRUE(reader_->ReadTransposedRows(TensorId{0}, t.dtype, halves, Transpose{}, 0, got.size(), got.data()).ok());
  EXPECT_TRUE(got == want);
  const uint64_t border = 349525ull * rows * 2;
  for (auto [a, b] : std::vector<std::pair<uint64_t, uint64_t>>{
           {border - 1, border + 1}, {border - 7, border + 4096}, {0, 3}, {want.size() - 5, want.size()}}) {
    std::vector<char> part(b - a);
    ASSERT_TRUE(reader_->ReadTransposedRows(TensorId{0}, t.dtype, halves, Transpose{}, a, b - a, part.data()).ok());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + static_cast<ptrdiff_t>(a))) << a << "-" << b;
  }
  // Another plan of the same tensor (one row per box, reversed) is not served from the first plan's slabs.
  std::vector<Box> reversed;
  for (int64_t r = rows; r-- > 0;) reversed.push_back(Box{{r, 0}, {1, cols}});
  const std::vector<char> want_rev = transpose({5, 4, 3, 2, 1, 0});
  std::vector<char> part(4096);
  ASSERT_TRUE(
      reader_->ReadTransposedRows(TensorId{0}, t.dtype, reversed, Transpose{}, border - 100, part.size(), part.data())
          .ok());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), want_rev.begin() + static_cast<ptrdiff_t>(border - 100)));
  // The source changes: a range whose slab is kept is refused, not served.
  ckptfs::testing::WriteFile(t_.path() + "/data.bin", data + "x");
  Status st = reader_->ReadTransposedRows(TensorId{0}, t.dtype, halves, Transpose{}, 0, 16, part.data());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("remount"), std::string::npos) << st.message();
}

// The mapped-reply plan: where PlanCopy accepts a range, the mapped spans'
// bytes are exactly ReadBox's, at any byte offset and over sub-boxes; it
// declines conversions, storage that is not row-contiguous, too many spans,
// holes, and a source that changed.
TEST_P(ReadEngineConformance, MappedCopiesEqualReadsOrAreDeclined) {
  Synthetic s = MakeSynthetic(t_.path(), 23, 80);
  OPEN_OR_SKIP(s);
  std::mt19937 rng(7);
  std::vector<SourceSpan> spans;
  MappedBytes mapped;
  auto gather = [&](std::vector<char>* got) {
    mapped.Clear();
    Status st = reader_->MapSpans(spans, &mapped);
    ASSERT_TRUE(st.ok()) << st.message();
    got->clear();
    for (const iovec& p : mapped.pieces) {
      const char* b = static_cast<const char*>(p.iov_base);
      got->insert(got->end(), b, b + p.iov_len);
    }
  };
  int accepted = 0, declined = 0;
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    const TensorRecord& tr = s.ck.tensors[i];
    const auto& full = s.full[i];
    const size_t rank = tr.shape.size();
    for (int k = 0; k < 12 && !full.empty(); ++k) {
      // A random sub-box (every other try) and a random byte range of it.
      Box box{std::vector<int64_t>(rank, 0), tr.shape};
      if (k % 2 == 1) {
        for (size_t d = 0; d < rank; ++d) {
          box.offsets[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(tr.shape[d] + 1));
          box.lengths[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(tr.shape[d] - box.offsets[d] + 1));
        }
      }
      const uint64_t size = static_cast<uint64_t>(NumelOf(box.lengths)) * DTypeSize(tr.dtype);
      if (size == 0) continue;
      uint64_t a = rng() % size, b = rng() % (size + 1);
      if (a > b) std::swap(a, b);
      if (k == 0) a = 0, b = size;
      std::vector<char> want(b - a), got;
      ASSERT_TRUE(reader_->ReadBox(TensorId{i}, tr.dtype, &box, a, b - a, want.data()).ok());
      if (!reader_->PlanCopy(TensorId{i}, tr.dtype, &box, a, b - a, 1000, &spans)) {
        ++declined;
        continue;
      }
      ++accepted;
      ASSERT_NO_FATAL_FAILURE(gather(&got));
      EXPECT_EQ(got, want) << "tensor " << i << " box " << BoxString(box) << " bytes " << a << "-" << b;
      for (size_t j = 1; j < spans.size(); ++j) {  // adjacent runs are merged
        EXPECT_FALSE(spans[j - 1].file == spans[j].file &&
                     spans[j - 1].offset + spans[j - 1].length == spans[j].offset);
      }
      if (spans.size() > 1) {  // a budget below the spans needed declines
        std::vector<SourceSpan> few;
        EXPECT_FALSE(reader_->PlanCopy(TensorId{i}, tr.dtype, &box, a, b - a, 0, &few));
      }
    }
    // A rendering in another dtype is never a copy.
    if (tr.dtype == DType::kBF16 && !full.empty()) {
      EXPECT_FALSE(reader_->PlanCopy(TensorId{i}, DType::kF32, nullptr, 0, full.size() * 2, 1000, &spans));
    }
  }
  // Both outcomes occur (column-major fragments decline), and most ranges map.
  EXPECT_GT(accepted, 200);
  EXPECT_GT(declined, 10);
  // A whole tensor in one C-order fragment is one span.
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    std::vector<Fragment> frags = s.ck.fragments.Get(i);
    if (frags.size() != 1 || s.full[i].empty()) continue;
    ASSERT_TRUE(reader_->PlanCopy(TensorId{i}, s.ck.tensors[i].dtype, nullptr, 0, s.full[i].size(), 1, &spans) ||
                s.ck.tensors[i].shape.size() >= 2);
  }
  // The source changes: mapping is refused (stale), as a read is.
  uint32_t id = 0;
  while (id < s.ck.tensors.size() &&
         (s.full[id].empty() ||
          !reader_->PlanCopy(TensorId{id}, s.ck.tensors[id].dtype, nullptr, 0, s.full[id].size(), 1000, &spans))) {
    ++id;
  }
  ASSERT_LT(id, s.ck.tensors.size());
  std::string data = ckptfs::testing::ReadFile(t_.path() + "/data.bin");
  ckptfs::testing::WriteFile(t_.path() + "/data.bin", data + "x");
  mapped.Clear();
  EXPECT_EQ(reader_->MapSpans(spans, &mapped).code(), Code::kStale);
}

// Conversions planned as source spans and converted from the mappings
// (what the daemon does for a widened .npy, and for float32 narrowed to
// bfloat16): the bytes are exactly ReadBox's, at any byte offset (inside an
// element too) and over sub-boxes; a same-dtype rendering is PlanCopy's, not
// a conversion; a changed source is stale.
TEST_P(ReadEngineConformance, MappedConversionsEqualReads) {
  if (Status g = InstallSigbusGuard(); g.code() == Code::kUnsupported) GTEST_SKIP() << g.message();
  ASSERT_TRUE(SigbusGuardInstalled());
  Synthetic s = MakeSynthetic(t_.path(), 29, 80);
  OPEN_OR_SKIP(s);
  std::mt19937 rng(11);
  ConvertPlan plan;
  int accepted = 0, declined = 0, narrowed = 0;
  for (uint32_t i = 0; i < s.ck.tensors.size(); ++i) {
    const TensorRecord& tr = s.ck.tensors[i];
    const DType out = tr.dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
    if (s.full[i].empty() || !CanConvert(tr.dtype, out)) continue;
    EXPECT_FALSE(reader_->PlanConvert(TensorId{i}, tr.dtype, nullptr, 0, s.full[i].size(), 1000, &plan));
    const uint64_t osz = DTypeSize(out);
    const size_t rank = tr.shape.size();
    for (int k = 0; k < 12; ++k) {
      Box box{std::vector<int64_t>(rank, 0), tr.shape};
      if (k % 2 == 1) {
        for (size_t d = 0; d < rank; ++d) {
          box.offsets[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(tr.shape[d] + 1));
          box.lengths[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(tr.shape[d] - box.offsets[d] + 1));
        }
      }
      const uint64_t size = static_cast<uint64_t>(NumelOf(box.lengths)) * osz;
      if (size == 0) continue;
      uint64_t a = rng() % size, b = rng() % (size + 1);
      if (a > b) std::swap(a, b);
      if (k == 0) a = 0, b = size;
      if (a == b) continue;
      std::vector<char> want(b - a), got(b - a, 'z');
      ASSERT_TRUE(reader_->ReadBox(TensorId{i}, out, &box, a, b - a, want.data()).ok());
      if (!reader_->PlanConvert(TensorId{i}, out, &box, a, b - a, 1000, &plan)) {
        ++declined;
        continue;
      }
      ++accepted;
      if (out == DType::kBF16) ++narrowed;
      EXPECT_EQ(plan.src, tr.dtype);
      EXPECT_EQ(plan.skip, a % osz);
      Status st = reader_->ConvertMapped(plan, got.data());
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(got, want) << "tensor " << i << " as " << DTypeName(out) << " box " << BoxString(box) << " bytes " << a
                           << "-" << b;
    }
  }
  EXPECT_GT(accepted, 20);
  EXPECT_GT(narrowed, 5);
  EXPECT_GT(declined, 0);  // column-major fragments
  // The source changes: converting is refused (stale), as a read is.
  uint32_t id = 0;
  while (id < s.ck.tensors.size() &&
         (s.full[id].empty() ||
          !reader_->PlanConvert(TensorId{id}, DType::kF32, nullptr, 0, s.full[id].size() * 2, 1000, &plan))) {
    ++id;
  }
  ASSERT_LT(id, s.ck.tensors.size());
  std::string data = ckptfs::testing::ReadFile(t_.path() + "/data.bin");
  ckptfs::testing::WriteFile(t_.path() + "/data.bin", data + "x");
  std::vector<char> out(plan.len);
  EXPECT_EQ(reader_->ConvertMapped(plan, out.data()).code(), Code::kStale);
}

TEST_P(ReadEngineConformance, HoleIsAnErrorNotZeros) {
  Synthetic s = MakeSynthetic(t_.path(), 5, 20);
  size_t victim = SIZE_MAX;
  for (size_t i = 0; i < s.ck.tensors.size(); ++i) {
    std::vector<Fragment> frags = s.ck.fragments.Get(i);
    if (frags.size() >= 2 && s.ck.tensors[i].Numel() > 0) {
      // drop a non-empty fragment
      for (size_t j = 0; j < frags.size(); ++j) {
        uint64_t vol = 1;
        for (auto l : frags[j].lengths) vol *= static_cast<uint64_t>(l);
        if (vol > 0) {
          frags.erase(frags.begin() + static_cast<ptrdiff_t>(j));
          s.ck.fragments.Set(i, frags);
          s.ck.tensors[i].num_fragments--;
          victim = i;
          break;
        }
      }
      if (victim != SIZE_MAX) break;
    }
  }
  ASSERT_NE(victim, SIZE_MAX);
  OPEN_OR_SKIP(s);
  std::vector<char> out(s.full[victim].size());
  Status st =
      reader_->Read(TensorId{static_cast<uint32_t>(victim)}, s.ck.tensors[victim].dtype, 0, out.size(), out.data());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("hole"), std::string::npos) << st.message();
  std::vector<SourceSpan> spans;
  EXPECT_FALSE(reader_->PlanCopy(TensorId{static_cast<uint32_t>(victim)}, s.ck.tensors[victim].dtype, nullptr, 0,
                                 out.size(), 1000, &spans));
}

TEST_P(ReadEngineConformance, ModifiedSourceIsStale) {
  Synthetic s = MakeSynthetic(t_.path(), 9, 5);
  OPEN_OR_SKIP(s);
  std::string data = ckptfs::testing::ReadFile(t_.path() + "/data.bin");
  ckptfs::testing::WriteFile(t_.path() + "/data.bin", data + "x");
  uint32_t id = 0;
  while (id < s.ck.tensors.size() && s.full[id].empty()) ++id;
  ASSERT_LT(id, s.ck.tensors.size());
  std::vector<char> out(s.full[id].size());
  Status st = reader_->Read(TensorId{id}, s.ck.tensors[id].dtype, 0, out.size(), out.data());
  EXPECT_EQ(st.code(), Code::kStale) << st.message();
  EXPECT_EQ(reader_->CheckFresh(TensorId{id}).code(), Code::kStale);
}

INSTANTIATE_TEST_SUITE_P(Engines, ReadEngineConformance, ::testing::Values(EngineKind::kPread, EngineKind::kUring),
                         [](const auto& info) { return info.param == EngineKind::kPread ? "pread" : "io_uring"; });

TEST(EngineTest, ShortReadPastEndIsAnError) {
  TempDir t;
  ckptfs::testing::WriteFile(t.path() + "/f", "hello");
  int fd = ::open((t.path() + "/f").c_str(), O_RDONLY);
  char buf[16];
  for (auto& e : {MakePreadEngine(), MakeUringEngine()}) {
    if (!e) continue;
    IoRequest ok{fd, 1, 3, buf};
    ASSERT_TRUE(e->ReadBatch(std::span<IoRequest>(&ok, 1)).ok()) << e->name();
    EXPECT_EQ(std::string(buf, 3), "ell");
    IoRequest past{fd, 2, 10, buf};
    EXPECT_FALSE(e->ReadBatch(std::span<IoRequest>(&past, 1)).ok()) << e->name();
  }
  ::close(fd);
}

}  // namespace
}  // namespace ckptfs
