// Transforms conformance: every backend (CPU always; CUDA where a device is
// present, skipped with the reason otherwise) runs the same plans and must
// produce exactly the reference bytes: random tensors split into random boxes
// (uneven, empty, one element, transposed storage, unaligned offsets), TP
// merges along inner dims, row-parallel interleave, SwiGLU regrouping, ZeRO
// flat partitions with padding across partition boundaries, every widening
// bit pattern, offsets beyond 4 GiB, CRC-32C of ranges; and the read engine
// through a pipeline of several chunks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "../test_util.h"
#include "ckptfs/geometry.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"
#include "ckptfs/transforms.h"
#include "common/float_bits.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

// --- Backends under test.
enum class Backend { kCpu, kCuda };

struct Handle {
  Transforms* t = nullptr;
  std::unique_ptr<Transforms> owned;
  std::string skip;  // why it is not available
};

Handle Get(Backend b, uint64_t idle_ms = 2000) {
  Handle h;
  if (b == Backend::kCpu) {
    h.t = &CpuTransforms();
    return h;
  }
  CudaOptions o;
  o.idle_ms = idle_ms;
  auto g = MakeCudaTransforms(o);
  if (!g.ok()) {
    h.skip = "no CUDA backend here: " + g.status().message();
    return h;
  }
  h.owned = std::move(*g);
  h.t = h.owned.get();
  return h;
}

#define GET_BACKEND(h, ...)                  \
  Handle h = Get(GetParam(), ##__VA_ARGS__); \
  if (h.t == nullptr) {                      \
    GTEST_SKIP() << h.skip;                  \
  }

// --- Reference: a global tensor, fragments stored in a source buffer, ops
// derived from boxes by a planner independent of the read engine's.
struct Frag {
  std::vector<int64_t> off, len, str;  // box and storage strides (elements)
  uint64_t src_off = 0;
};

std::vector<int64_t> CStrides(const std::vector<int64_t>& shape) { return ContiguousStrides(shape); }
uint64_t Numel(const std::vector<int64_t>& shape) { return static_cast<uint64_t>(NumelOf(shape)); }

// Stores each fragment's slice of `full` (C order, `shape`) into `src` at its
// src_off with its strides.
void Store(const std::vector<char>& full, const std::vector<int64_t>& shape, size_t esz, const Frag& f,
           std::vector<char>& src) {
  const auto gs = CStrides(shape);
  const uint64_t n = Numel(f.len);
  for (uint64_t k = 0; k < n; ++k) {
    uint64_t r = k;
    int64_t g = 0, s = 0;
    for (size_t d = f.len.size(); d-- > 0;) {
      const int64_t i = static_cast<int64_t>(r % static_cast<uint64_t>(f.len[d]));
      r /= static_cast<uint64_t>(f.len[d]);
      g += (f.off[d] + i) * gs[d];
      s += i * f.str[d];
    }
    std::memcpy(src.data() + f.src_off + static_cast<uint64_t>(s) * esz, full.data() + static_cast<uint64_t>(g) * esz,
                esz);
  }
}

// Ops rendering the sub-box `view` of the tensor from `frags` into C order of
// the view, no dim coalescing (the read engine coalesces; this must not matter).
std::vector<GatherOp> OpsFor(const std::vector<Frag>& frags, const std::vector<int64_t>& vo,
                             const std::vector<int64_t>& vl, DType sd, DType out) {
  std::vector<GatherOp> ops;
  const auto os = CStrides(vl);
  const size_t rank = vl.size();
  for (const Frag& f : frags) {
    GatherOp op;
    op.sdtype = sd;
    op.rank = static_cast<uint8_t>(rank);
    bool empty = false;
    int64_t s = 0, d0 = 0;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t lo = std::max(vo[d], f.off[d]), hi = std::min(vo[d] + vl[d], f.off[d] + f.len[d]);
      if (lo >= hi) empty = true;
      op.len[d] = std::max<int64_t>(0, hi - lo);
      op.sstr[d] = f.str[d];
      op.dstr[d] = os[d];
      s += (lo - f.off[d]) * f.str[d];
      d0 += (lo - vo[d]) * os[d];
    }
    if (empty && rank > 0) continue;
    op.src_off = f.src_off + static_cast<uint64_t>(s) * DTypeSize(sd);
    op.dst_off = static_cast<uint64_t>(d0) * DTypeSize(out);
    ops.push_back(op);
  }
  return ops;
}

// The view of `full` converted element by element (ConvertRun's one-element
// path, itself checked against known values in read_engine_test.cc).
std::vector<char> Expected(const std::vector<char>& full, const std::vector<int64_t>& shape, DType sd,
                           const std::vector<int64_t>& vo, const std::vector<int64_t>& vl, DType out) {
  const auto gs = CStrides(shape);
  const uint64_t n = Numel(vl), ss = DTypeSize(sd), os = DTypeSize(out);
  std::vector<char> e(n * os);
  for (uint64_t k = 0; k < n; ++k) {
    uint64_t r = k;
    int64_t g = 0;
    for (size_t d = vl.size(); d-- > 0;) {
      const int64_t i = static_cast<int64_t>(r % static_cast<uint64_t>(vl[d]));
      r /= static_cast<uint64_t>(vl[d]);
      g += (vo[d] + i) * gs[d];
    }
    EXPECT_TRUE(ConvertRun(full.data() + static_cast<uint64_t>(g) * ss, sd, 1, e.data() + k * os, out, 1).ok());
  }
  return e;
}

// Packs fragments into a source buffer with garbage gaps, unaligned when
// `unaligned`, each stored C order or transposed.
std::vector<char> Pack(const std::vector<char>& full, const std::vector<int64_t>& shape, size_t esz,
                       std::vector<Frag>& frags, std::mt19937_64& rng, bool unaligned) {
  uint64_t pos = 0;
  for (Frag& f : frags) {
    pos += rng() % 40;
    if (!unaligned) pos = (pos + 15) & ~15ull;
    f.src_off = pos;
    f.str.assign(f.len.size(), 1);
    if (f.len.size() >= 2 && rng() % 3 == 0) {
      for (size_t d = 1; d < f.len.size(); ++d) f.str[d] = f.str[d - 1] * f.len[d - 1];
    } else {
      f.str = CStrides(f.len);
    }
    pos += Numel(f.len) * esz;
  }
  std::vector<char> src(pos + 64);
  for (auto& c : src) c = static_cast<char>(0xA5);
  for (const Frag& f : frags) Store(full, shape, esz, f, src);
  return src;
}

// Grid split: each dim cut at `cuts[d]` (sorted, includes 0 and the size).
std::vector<Frag> GridSplit(const std::vector<std::vector<int64_t>>& cuts) {
  std::vector<Frag> out;
  size_t combos = 1;
  for (const auto& c : cuts) combos *= c.size() - 1;
  for (size_t k = 0; k < combos; ++k) {
    Frag f;
    size_t r = k;
    f.off.resize(cuts.size());
    f.len.resize(cuts.size());
    for (size_t d = cuts.size(); d-- > 0;) {
      const size_t i = r % (cuts[d].size() - 1);
      r /= cuts[d].size() - 1;
      f.off[d] = cuts[d][i];
      f.len[d] = cuts[d][i + 1] - cuts[d][i];
    }
    out.push_back(f);
  }
  return out;
}

std::vector<char> RandomBytes(uint64_t n, std::mt19937_64& rng) {
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

class TransformsConformance : public ::testing::TestWithParam<Backend> {};

TEST_P(TransformsConformance, RandomSplitsAndDtypesEqualTheReference) {
  GET_BACKEND(h);
  std::mt19937_64 rng(7);
  const DType dtypes[] = {DType::kF32,        DType::kBF16,       DType::kF16, DType::kF8E4M3FN, DType::kF8E5M2,
                          DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kI64, DType::kU8,       DType::kBool,
                          DType::kC64,        DType::kC128,       DType::kI16};
  for (int it = 0; it < 300; ++it) {
    const DType sd = dtypes[rng() % std::size(dtypes)];
    const DType out = CanConvert(sd, DType::kF32) && sd != DType::kF32 && rng() % 2 ? DType::kF32 : sd;
    const size_t rank = rng() % 6;
    std::vector<int64_t> shape;
    for (size_t d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(rng() % 7));
    if (rank > 0 && rng() % 3 == 0) shape[rng() % rank] = 1;
    if (rank > 0 && rng() % 8 == 0) shape[rng() % rank] = 0;  // 0-size tensor
    const size_t esz = DTypeSize(sd);
    const auto full = RandomBytes(Numel(shape) * esz, rng);
    std::vector<std::vector<int64_t>> cuts(rank);
    for (size_t d = 0; d < rank; ++d) {
      cuts[d] = {0, shape[d]};
      for (int k = static_cast<int>(rng() % 3); k > 0; --k)
        cuts[d].push_back(static_cast<int64_t>(rng() % (shape[d] + 1)));
      std::sort(cuts[d].begin(), cuts[d].end());  // repeated cuts: empty fragments
    }
    std::vector<Frag> frags = GridSplit(cuts);
    auto src = Pack(full, shape, esz, frags, rng, rng() % 2 == 0);
    // The whole tensor, or a random sub-box of it (a resharded slice).
    std::vector<int64_t> vo(rank, 0), vl = shape;
    if (rng() % 2) {
      for (size_t d = 0; d < rank; ++d) {
        vo[d] = shape[d] ? static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d])) : 0;
        vl[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d] - vo[d] + 1));
      }
    }
    const auto ops = OpsFor(frags, vo, vl, sd, out);
    const auto want = Expected(full, shape, sd, vo, vl, out);
    const uint64_t pad = rng() % 24;  // output at an unaligned offset
    std::vector<char> got(want.size() + pad + 8, '\x3c');
    std::vector<GatherOp> shifted = ops;
    for (auto& op : shifted) op.dst_off += pad;
    Status s = h.t->Gather(src.data(), src.size(), shifted, out, got.data(), got.size());
    ASSERT_TRUE(s.ok()) << s.message();
    ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + static_cast<ptrdiff_t>(pad)))
        << "iteration " << it << " " << DTypeName(sd) << "->" << DTypeName(out) << " rank " << rank;
    // Bytes no op writes are left alone.
    for (uint64_t i = 0; i < pad; ++i) ASSERT_EQ(got[i], '\x3c');
    for (uint64_t i = want.size() + pad; i < got.size(); ++i) ASSERT_EQ(got[i], '\x3c');
  }
}

// TP merges of real layer types: column-parallel (dim 0), row-parallel
// (dim 1: each output row interleaves TP shards), and SwiGLU, where each
// shard holds [W_r; V_r] and the merge regroups to [W_0..W_T; V_0..V_T].
TEST_P(TransformsConformance, TensorParallelMergesAndSwigluRegrouping) {
  GET_BACKEND(h);
  std::mt19937_64 rng(11);
  for (int tp : {1, 2, 3, 4, 8}) {
    for (DType sd : {DType::kBF16, DType::kF32}) {
      const int64_t rows = 6 * tp, cols = 5 * tp;
      const std::vector<int64_t> shape{rows, cols};
      const size_t esz = DTypeSize(sd);
      const auto full = RandomBytes(Numel(shape) * esz, rng);
      for (int layer = 0; layer < 3; ++layer) {
        std::vector<Frag> frags;
        if (layer == 0) {  // column-parallel
          for (int r = 0; r < tp; ++r) frags.push_back(Frag{{rows / tp * r, 0}, {rows / tp, cols}, {}, 0});
        } else if (layer == 1) {  // row-parallel
          for (int r = 0; r < tp; ++r) frags.push_back(Frag{{0, cols / tp * r}, {rows, cols / tp}, {}, 0});
        } else {  // SwiGLU: shard r stores W rows [r*h, (r+1)*h) then V rows [half + r*h, ...)
          const int64_t half = rows / 2, hr = half / tp;
          for (int r = 0; r < tp; ++r) {
            frags.push_back(Frag{{hr * r, 0}, {hr, cols}, {}, 0});
            frags.push_back(Frag{{half + hr * r, 0}, {hr, cols}, {}, 0});
          }
        }
        auto src = Pack(full, shape, esz, frags, rng, false);
        if (layer == 2) {  // the two halves of one shard are adjacent in its storage
          for (size_t i = 1; i < frags.size(); i += 2)
            frags[i].src_off = frags[i - 1].src_off + Numel(frags[i - 1].len) * esz;
          src.assign(src.size(), '\0');
          for (const Frag& f : frags) Store(full, shape, esz, f, src);
        }
        for (DType out : {sd, DType::kF32}) {
          const auto ops = OpsFor(frags, {0, 0}, shape, sd, out);
          const auto want = Expected(full, shape, sd, {0, 0}, shape, out);
          std::vector<char> got(want.size());
          ASSERT_TRUE(h.t->Gather(src.data(), src.size(), ops, out, got.data(), got.size()).ok());
          EXPECT_EQ(got, want) << "tp " << tp << " layer " << layer << " " << DTypeName(sd) << "->" << DTypeName(out);
        }
      }
    }
  }
}

// ZeRO-1/2: parameters flattened into one group, padded to a multiple of
// DP * align, cut into DP equal partitions (each its own "file" region with
// padding garbage after it). A parameter that spans a partition boundary
// becomes runs from two partitions; the padding is never read.
TEST_P(TransformsConformance, ZeroPaddingStripAcrossPartitions) {
  GET_BACKEND(h);
  std::mt19937_64 rng(13);
  for (int dp : {1, 2, 3, 8, 64}) {
    for (DType sd : {DType::kBF16, DType::kF16, DType::kF32}) {
      std::vector<uint64_t> numels;
      for (int i = 0; i < 12; ++i) numels.push_back(i % 5 == 0 ? rng() % 2 : rng() % 3000);  // 0 and 1 too
      uint64_t total = 0;
      for (uint64_t n : numels) total += n;
      const uint64_t align = 2 * static_cast<uint64_t>(dp), padded = (total + align - 1) / align * align + align;
      const uint64_t part = padded / static_cast<uint64_t>(dp), esz = DTypeSize(sd);
      const auto flat = RandomBytes(total * esz, rng);
      // Partition p lives at base[p]; the bytes between are garbage.
      std::vector<uint64_t> base(static_cast<size_t>(dp));
      std::vector<char> src;
      for (int p = 0; p < dp; ++p) {
        src.resize(src.size() + rng() % 100, '\x77');
        base[static_cast<size_t>(p)] = src.size();
        for (uint64_t e = 0; e < part; ++e) {
          const uint64_t g = static_cast<uint64_t>(p) * part + e;
          for (uint64_t b = 0; b < esz; ++b) src.push_back(g < total ? flat[g * esz + b] : '\xEE');
        }
      }
      for (DType out : {sd, DType::kF32}) {
        // One output per parameter, concatenated: the stripped layout.
        std::vector<GatherOp> ops;
        uint64_t start = 0, dst = 0;
        for (uint64_t n : numels) {
          for (uint64_t e = start; e < start + n;) {
            const uint64_t p = e / part, in = e % part, run = std::min(start + n - e, part - in);
            GatherOp op;
            op.sdtype = sd;
            op.rank = 1;
            op.len[0] = static_cast<int64_t>(run), op.sstr[0] = 1, op.dstr[0] = 1;
            op.src_off = base[p] + in * esz;
            op.dst_off = dst;
            ops.push_back(op);
            dst += run * DTypeSize(out);
            e += run;
          }
          start += n;
        }
        const auto want = Expected(flat, {static_cast<int64_t>(total)}, sd, {0}, {static_cast<int64_t>(total)}, out);
        std::vector<char> got(want.size());
        ASSERT_TRUE(h.t->Gather(src.data(), src.size(), ops, out, got.data(), got.size()).ok());
        EXPECT_EQ(got, want) << "dp " << dp << " " << DTypeName(sd) << "->" << DTypeName(out);
      }
    }
  }
}

// Every 16-bit pattern of bf16 and f16 and every byte of each fp8 format,
// widened to float32, bit for bit as the CPU does (NaN payloads included).
TEST_P(TransformsConformance, EveryWideningBitPattern) {
  GET_BACKEND(h);
  for (DType sd :
       {DType::kBF16, DType::kF16, DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ}) {
    const uint64_t n = DTypeSize(sd) == 2 ? 65536 : 256;
    std::vector<char> src(n * DTypeSize(sd));
    for (uint64_t i = 0; i < n; ++i) {
      if (DTypeSize(sd) == 2)
        StoreLE<uint16_t>(src.data() + 2 * i, static_cast<uint16_t>(i));
      else
        src[i] = static_cast<char>(i);
    }
    GatherOp op;
    op.sdtype = sd;
    op.rank = 1;
    op.len[0] = static_cast<int64_t>(n), op.sstr[0] = 1, op.dstr[0] = 1;
    std::vector<char> want(n * 4), got(n * 4);
    ASSERT_TRUE(ConvertRun(src.data(), sd, 1, want.data(), DType::kF32, n).ok());
    ASSERT_TRUE(
        h.t->Gather(src.data(), src.size(), std::span<const GatherOp>(&op, 1), DType::kF32, got.data(), got.size())
            .ok());
    EXPECT_EQ(got, want) << DTypeName(sd);
  }
}

// Offsets past 4 GiB in source and output (sparse anonymous mappings: only
// the touched pages exist).
TEST_P(TransformsConformance, OffsetsBeyondFourGiB) {
  GET_BACKEND(h);
  const uint64_t size = (5ull << 30);
  void* sm = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* dm = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (sm == MAP_FAILED || dm == MAP_FAILED) GTEST_SKIP() << "cannot map 2 x 5 GiB of address space";
  char* src = static_cast<char*>(sm);
  char* dst = static_cast<char*>(dm);
  std::mt19937_64 rng(17);
  const uint64_t soff = (4ull << 30) + 4096 * 3 + 6, doff = (4ull << 30) + 1000 * 4;
  // A 2-d bf16 block [64, 48] inside rows of 100 (a row-parallel slice),
  // widened into rows of 80 floats.
  for (uint64_t i = 0; i < 64 * 100 * 2; ++i) src[soff + i] = static_cast<char>(rng());
  GatherOp op;
  op.sdtype = DType::kBF16;
  op.rank = 2;
  op.src_off = soff, op.dst_off = doff;
  op.len[0] = 64, op.len[1] = 48;
  op.sstr[0] = 100, op.sstr[1] = 1;
  op.dstr[0] = 80, op.dstr[1] = 1;
  ASSERT_TRUE(h.t->Gather(src, size, std::span<const GatherOp>(&op, 1), DType::kF32, dst, size).ok());
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 48; ++c) {
      const uint16_t b = LoadLE<uint16_t>(src + soff + (static_cast<uint64_t>(r) * 100 + c) * 2);
      uint32_t want = static_cast<uint32_t>(b) << 16, got;
      std::memcpy(&got, dst + doff + (static_cast<uint64_t>(r) * 80 + c) * 4, 4);
      ASSERT_EQ(got, want) << r << "," << c;
    }
  }
  // A source span that ends exactly at the end of the 5 GiB buffer.
  GatherOp tail;
  tail.sdtype = DType::kU8;
  tail.rank = 1;
  tail.len[0] = 100, tail.sstr[0] = 1, tail.dstr[0] = 1;
  tail.src_off = size - 100, tail.dst_off = size - 100;
  for (int i = 0; i < 100; ++i) src[size - 100 + static_cast<uint64_t>(i)] = static_cast<char>(i);
  ASSERT_TRUE(h.t->Gather(src, size, std::span<const GatherOp>(&tail, 1), DType::kU8, dst, size).ok());
  for (int i = 0; i < 100; ++i) ASSERT_EQ(dst[size - 100 + static_cast<uint64_t>(i)], static_cast<char>(i));
  ::munmap(sm, size);
  ::munmap(dm, size);
}

TEST_P(TransformsConformance, OpsOutsideTheBuffersAreRefusedBeforeAnyWrite) {
  GET_BACKEND(h);
  std::vector<char> src(64, 1), dst(64, 0);
  GatherOp good;
  good.sdtype = DType::kU8, good.rank = 1, good.len[0] = 8, good.sstr[0] = 1, good.dstr[0] = 1;
  GatherOp bad = good;
  bad.src_off = 60;
  std::vector<GatherOp> ops{good, bad};
  Status s = h.t->Gather(src.data(), src.size(), ops, DType::kU8, dst.data(), dst.size());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("op 1 of 2"), std::string::npos) << s.message();
  EXPECT_EQ(dst, std::vector<char>(64, 0));
  bad = good;
  bad.dst_off = 57;
  ops = {good, bad};
  EXPECT_FALSE(h.t->Gather(src.data(), src.size(), ops, DType::kU8, dst.data(), dst.size()).ok());
  bad = good;
  bad.rank = kMaxGatherDims + 1;
  ops = {bad};
  EXPECT_FALSE(h.t->Gather(src.data(), src.size(), ops, DType::kU8, dst.data(), dst.size()).ok());
  bad = good;
  bad.sdtype = DType::kF32;
  ops = {bad};  // f32 -> u8 is not a conversion the engine does
  EXPECT_FALSE(h.t->Gather(src.data(), src.size(), ops, DType::kU8, dst.data(), dst.size()).ok());
  EXPECT_EQ(dst, std::vector<char>(64, 0));
}

// Bit-at-a-time CRC-32C: the definition, independent of both backends.
uint32_t Crc32cBitwise(const char* p, uint64_t n) {
  uint32_t c = ~0u;
  for (uint64_t i = 0; i < n; ++i) {
    c ^= static_cast<unsigned char>(p[i]);
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST_P(TransformsConformance, Crc32cOfRanges) {
  GET_BACKEND(h);
  const char* check = "123456789";  // the catalogue check value
  ByteRange r{0, 9};
  uint32_t c = 0;
  ASSERT_TRUE(h.t->Crc32c(check, 9, std::span<const ByteRange>(&r, 1), &c).ok());
  EXPECT_EQ(c, 0xE3069283u);
  std::mt19937_64 rng(19);
  const auto data = RandomBytes((70ull << 20) + 13, rng);  // more than one 64 MiB device piece
  std::vector<ByteRange> ranges{{0, 0}, {5, 1}, {3, 100}, {1, 16 << 10}, {7, (16 << 10) + 1}, {0, data.size()}};
  for (int i = 0; i < 20; ++i) {
    const uint64_t a = rng() % data.size(), n = rng() % std::min<uint64_t>(data.size() - a, 3 << 20);
    ranges.push_back({a, n});
  }
  std::vector<uint32_t> got(ranges.size());
  ASSERT_TRUE(h.t->Crc32c(data.data(), data.size(), ranges, got.data()).ok());
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].length > (8 << 20)) {  // the bitwise reference is slow: check big ones by concatenation
      const uint64_t cut = ranges[i].length / 3;
      uint32_t a = 0, b = 0;
      ByteRange ra{ranges[i].offset, cut}, rb{ranges[i].offset + cut, ranges[i].length - cut};
      ASSERT_TRUE(CpuTransforms().Crc32c(data.data(), data.size(), std::span<const ByteRange>(&ra, 1), &a).ok());
      ASSERT_TRUE(CpuTransforms().Crc32c(data.data(), data.size(), std::span<const ByteRange>(&rb, 1), &b).ok());
      EXPECT_EQ(got[i], Crc32cConcat(a, b, rb.length)) << "range " << i;
      continue;
    }
    EXPECT_EQ(got[i], Crc32cBitwise(data.data() + ranges[i].offset, ranges[i].length)) << "range " << i;
  }
  ByteRange out_of{data.size() - 4, 5};
  EXPECT_FALSE(h.t->Crc32c(data.data(), data.size(), std::span<const ByteRange>(&out_of, 1), got.data()).ok());
}

// DeepSpeed's parameter_to_average_patterns: ds_to_universal.py computes
// sum(slices) / len(slices) on torch tensors. Known values (per-step rounding
// for bf16, 0 + -0.0 = +0.0 from Python's sum start), then random copies of
// every dtype against a host loop written here, and the backends agree.
TEST_P(TransformsConformance, MeanOfCopiesIsPythonSumOverN) {
  GET_BACKEND(h);
  auto f32 = [](float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return b;
  };
  {
    const float src[] = {1.0f, -0.0f, 2.0f, -0.0f, 4.0f, -0.0f};  // 3 copies of 2 elements
    float dst[2];
    ASSERT_TRUE(h.t->Mean(reinterpret_cast<const char*>(src), 3, 2, DType::kF32, reinterpret_cast<char*>(dst)).ok());
    EXPECT_EQ(f32(dst[0]), f32(7.0f / 3.0f));
    EXPECT_EQ(f32(dst[1]), 0u);  // +0.0, not -0.0
  }
  {
    // bf16 copies {1, 2^-8, 2^-8}: rounded after each add, 1 + 2^-8 ties to
    // 1.0 twice, then 1/3 -> 0x3EAB; accumulating in float would give 0x3EAC.
    const uint16_t src[] = {0x3F80, 0x3B80, 0x3B80};
    uint16_t dst = 0;
    ASSERT_TRUE(h.t->Mean(reinterpret_cast<const char*>(src), 3, 1, DType::kBF16, reinterpret_cast<char*>(&dst)).ok());
    EXPECT_EQ(dst, 0x3EAB);
  }
  std::mt19937_64 rng(23);
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    for (uint32_t copies : {1u, 2u, 3u, 4u, 8u}) {
      const uint64_t numel = 1 + rng() % 5000, esz = DTypeSize(dt);
      std::vector<char> src(copies * numel * esz);
      std::normal_distribution<double> nd(0.0, 3.0);
      for (uint64_t k = 0; k < copies * numel; ++k) {
        const double v = nd(rng);
        if (dt == DType::kF64) {
          std::memcpy(src.data() + k * 8, &v, 8);
        } else {
          const uint32_t b = f32(static_cast<float>(v));
          if (dt == DType::kF32) std::memcpy(src.data() + k * 4, &b, 4);
          const uint16_t hb = dt == DType::kBF16 ? FloatBitsToBFloat16Bits(b) : FloatBitsToHalfBits(b);
          if (esz == 2) std::memcpy(src.data() + k * 2, &hb, 2);
        }
      }
      std::vector<char> got(numel * esz), want(numel * esz);
      ASSERT_TRUE(h.t->Mean(src.data(), copies, numel, dt, got.data()).ok());
      for (uint64_t i = 0; i < numel; ++i) {
        auto at = [&](uint32_t k) { return src.data() + (k * numel + i) * esz; };
        if (dt == DType::kF64) {
          double acc = 0.0, v;
          for (uint32_t k = 0; k < copies; ++k) std::memcpy(&v, at(k), 8), acc = acc + v;
          acc = acc / copies;
          std::memcpy(want.data() + i * 8, &acc, 8);
        } else if (dt == DType::kF32) {
          float acc = 0.0f, v;
          for (uint32_t k = 0; k < copies; ++k) std::memcpy(&v, at(k), 4), acc = acc + v;
          acc = acc / static_cast<float>(copies);
          std::memcpy(want.data() + i * 4, &acc, 4);
        } else {
          auto widen = [&](uint16_t x) {
            uint32_t b = dt == DType::kBF16 ? BFloat16BitsToFloatBits(x) : HalfBitsToFloatBits(x);
            float f;
            std::memcpy(&f, &b, 4);
            return f;
          };
          auto round = [&](float f) {
            return dt == DType::kBF16 ? FloatBitsToBFloat16Bits(f32(f)) : FloatBitsToHalfBits(f32(f));
          };
          uint16_t acc = 0, v;
          for (uint32_t k = 0; k < copies; ++k) std::memcpy(&v, at(k), 2), acc = round(widen(acc) + widen(v));
          acc = round(widen(acc) / static_cast<float>(copies));
          std::memcpy(want.data() + i * 2, &acc, 2);
        }
      }
      ASSERT_EQ(got, want) << DTypeName(dt) << " x" << copies;
    }
  }
  char out[4];
  EXPECT_FALSE(h.t->Mean(out, 2, 1, DType::kI32, out).ok());
}

TEST(FloatBitsTest, NarrowingRoundsToNearestEven) {
  // Every half and bfloat16 value survives the round trip through float32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const bool nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0;
    if (!nan) {
      EXPECT_EQ(FloatBitsToHalfBits(HalfBitsToFloatBits(static_cast<uint16_t>(h))), h) << h;
    }
    const bool bnan = (h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0;
    if (!bnan) {
      EXPECT_EQ(FloatBitsToBFloat16Bits(BFloat16BitsToFloatBits(static_cast<uint16_t>(h))), h) << h;
    }
  }
  // Ties: 1 + 2^-11 (half) and 1 + 2^-8 (bf16) go to the even 1.0; the next ties up.
  EXPECT_EQ(FloatBitsToHalfBits(0x3F801000u), 0x3C00);
  EXPECT_EQ(FloatBitsToHalfBits(0x3F803000u), 0x3C02);
  EXPECT_EQ(FloatBitsToBFloat16Bits(0x3F808000u), 0x3F80);
  EXPECT_EQ(FloatBitsToBFloat16Bits(0x3F818000u), 0x3F82);
  EXPECT_EQ(FloatBitsToHalfBits(0x477FF000u), 0x7C00);  // 65520 -> inf
  EXPECT_EQ(FloatBitsToHalfBits(0x477FEFFFu), 0x7BFF);  // just below -> 65504
  EXPECT_EQ(FloatBitsToHalfBits(0x33000000u), 0x0000);  // 2^-25 ties to 0
  EXPECT_EQ(FloatBitsToHalfBits(0x33000001u), 0x0001);  // above it: the smallest subnormal
  EXPECT_EQ(FloatBitsToHalfBits(0xFFC00000u), 0xFE00);  // NaN keeps its sign
}

// The pipeline contract the read engine relies on: staging, submit, then the
// other slot's I/O, then wait; the outputs of chunks in flight never mix.
TEST_P(TransformsConformance, TwoSlotPipelineKeepsChunksApart) {
  GET_BACKEND(h);
  std::mt19937_64 rng(23);
  auto pipe = h.t->Begin();
  ASSERT_TRUE(pipe.ok()) << pipe.status().message();
  const uint64_t chunk = 3 << 20;  // bf16 elements per chunk
  std::vector<char> all = RandomBytes(4 * chunk * 2, rng), got(4 * chunk * 4, 0), want(4 * chunk * 4);
  ASSERT_TRUE(ConvertRun(all.data(), DType::kBF16, 1, want.data(), DType::kF32, 4 * chunk).ok());
  bool pending[2] = {false, false};
  for (int c = 0; c < 4; ++c) {
    const int slot = c & 1;
    if (pending[slot]) {
      ASSERT_TRUE((*pipe)->Wait(slot).ok());
    }
    auto st = (*pipe)->Staging(slot, chunk * 2);
    ASSERT_TRUE(st.ok()) << st.status().message();
    std::memcpy(*st, all.data() + static_cast<uint64_t>(c) * chunk * 2, chunk * 2);
    GatherOp op;
    op.sdtype = DType::kBF16, op.rank = 1, op.len[0] = static_cast<int64_t>(chunk), op.sstr[0] = 1, op.dstr[0] = 1;
    op.dst_off = static_cast<uint64_t>(c) * chunk * 4;
    ASSERT_TRUE(
        (*pipe)->Submit(slot, chunk * 2, std::span<const GatherOp>(&op, 1), DType::kF32, got.data(), got.size()).ok());
    pending[slot] = true;
  }
  for (int s = 0; s < 2; ++s) ASSERT_TRUE((*pipe)->Wait(s).ok());
  EXPECT_EQ(got, want);
}

// The read engine end to end, through each backend: a bf16 weight merged from
// three uneven TP shards along dim 1, widened, over several 16 MiB chunks,
// with one shard stored past 4 GiB in a sparse file.
TEST_P(TransformsConformance, ReadEngineThroughTheBackendAcrossChunks) {
  GET_BACKEND(h);
  TempDir t;
  const std::vector<int64_t> shape{2100, 3000};  // 25 MB of float32 output: 2 chunks
  std::mt19937_64 rng(29);
  const auto full = RandomBytes(Numel(shape) * 2, rng);
  std::vector<Frag> frags = GridSplit({{0, 2100}, {0, 700, 1900, 3000}});
  auto src = Pack(full, shape, 2, frags, rng, false);
  const uint64_t far = 5ull << 30;  // shard 2 moves past 4 GiB
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.files.push_back(SourceFile{"data.bin", 0, 0, 0});
  TensorRecord rec;
  rec.key = rec.fqn = "w";
  rec.state = "param";
  rec.role = Role::kParam;
  rec.dtype = DType::kBF16;
  rec.shape = shape;
  rec.byte_size = Numel(shape) * 2;
  rec.num_fragments = 3;
  std::vector<Fragment> fr;
  for (size_t i = 0; i < frags.size(); ++i) {
    Fragment f;
    f.file = FileId{0};
    f.dtype = DType::kBF16;
    f.offsets = frags[i].off;
    f.lengths = frags[i].len;
    f.strides = frags[i].str;
    f.data_offset = i == 2 ? far : frags[i].src_off;
    f.data_length = Numel(frags[i].len) * 2;
    fr.push_back(f);
  }
  ck.tensors.push_back(rec);
  ck.fragments.Append(fr);
  {
    const std::string path = t.path() + "/data.bin";
    int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, src.data(), src.size(), 0), static_cast<ssize_t>(src.size()));
    ASSERT_EQ(::pwrite(fd, src.data() + frags[2].src_off, fr[2].data_length, static_cast<off_t>(far)),
              static_cast<ssize_t>(fr[2].data_length));
    ::close(fd);
  }
  ckptfs::testing::FillStat(t.path(), &ck.files[0]);
  ASSERT_TRUE(Index::Build(ck, t.path() + "/index").ok());
  auto ix = Index::Open(t.path() + "/index", t.path());
  ASSERT_TRUE(ix.ok()) << ix.status().message();
  auto policy = TransformPolicy::Make(GetParam() == Backend::kCpu ? GpuMode::kOff : GpuMode::kOn, "");
  ASSERT_TRUE(policy.ok()) << policy.status().message();
  auto reader = TensorReader::Open(**ix, EngineKind::kPread, std::move(*policy));
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  const auto want = Expected(full, shape, DType::kBF16, {0, 0}, shape, DType::kF32);
  std::vector<char> got(want.size());
  Status s = (*reader)->Read(TensorId{0}, DType::kF32, 0, got.size(), got.data());
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(got, want);
  // An unaligned window across the chunk boundary, and a sub-box (a TP=4 slice of dim 1).
  const uint64_t a = (16ull << 20) - 4097, n = 1234567;
  std::vector<char> part(n);
  ASSERT_TRUE((*reader)->Read(TensorId{0}, DType::kF32, a, n, part.data()).ok());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + static_cast<ptrdiff_t>(a)));
  Box box{{0, 750}, {2100, 750}};
  const auto wbox = Expected(full, shape, DType::kBF16, box.offsets, box.lengths, DType::kBF16);
  std::vector<char> gbox(wbox.size());
  ASSERT_TRUE((*reader)->ReadBox(TensorId{0}, DType::kBF16, &box, 0, gbox.size(), gbox.data()).ok());
  EXPECT_EQ(gbox, wbox);
  const auto counts = (*reader)->transform_counts();
  if (GetParam() == Backend::kCuda) {
    EXPECT_GT(counts.gpu_plans, 0u);
    EXPECT_EQ(counts.gpu_fallbacks, 0u);
  } else {
    EXPECT_EQ(counts.gpu_plans, 0u);
  }
}

// An idle GPU backend gives its memory (and context) back.
TEST_P(TransformsConformance, IdleBackendHoldsNoMemory) {
  GET_BACKEND(h, 100);
  std::vector<char> src(1 << 20, 1), dst(2 << 20);
  GatherOp op;
  op.sdtype = DType::kBF16, op.rank = 1, op.len[0] = 1 << 19, op.sstr[0] = 1, op.dstr[0] = 1;
  ASSERT_TRUE(
      h.t->Gather(src.data(), src.size(), std::span<const GatherOp>(&op, 1), DType::kF32, dst.data(), dst.size()).ok());
  if (GetParam() == Backend::kCuda) {
    EXPECT_GT(h.t->HeldBytes(), 0u);
  }
  for (int i = 0; i < 50 && h.t->HeldBytes() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(h.t->HeldBytes(), 0u);
  // And takes it again on the next use, with the same bytes.
  std::vector<char> again(dst.size());
  ASSERT_TRUE(
      h.t->Gather(src.data(), src.size(), std::span<const GatherOp>(&op, 1), DType::kF32, again.data(), again.size())
          .ok());
  EXPECT_EQ(again, dst);
}

// The check the policy runs before trusting a GPU (every supported
// conversion, odd and unaligned plans, means of replicas of arbitrary bit
// patterns, NaNs included, CRC-32C around the chunk size) passes: a real
// device's bytes equal the CPU's, so a mount never disables a sound GPU.
TEST_P(TransformsConformance, PassesThePolicysTrustCheck) {
  GET_BACKEND(h);
  Status s = CheckAgainstCpu(*h.t);
  EXPECT_TRUE(s.ok()) << s.message();
}

INSTANTIATE_TEST_SUITE_P(Backends, TransformsConformance, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return std::string(i.param == Backend::kCpu ? "cpu" : "cuda");
                         });

TEST(TransformPolicyTest, ModesAndTheirErrors) {
  EXPECT_EQ(*ParseGpuMode("auto"), GpuMode::kAuto);
  EXPECT_EQ(*ParseGpuMode("off"), GpuMode::kOff);
  EXPECT_EQ(*ParseGpuMode("on"), GpuMode::kOn);
  auto bad = ParseGpuMode("yes");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("auto, on, off"), std::string::npos);
  auto off = TransformPolicy::Make(GpuMode::kOff, "");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(&(*off)->For(TransformKind::kWiden, 1ull << 30), &CpuTransforms());
  auto cuda = MakeCudaTransforms();
  auto on = TransformPolicy::Make(GpuMode::kOn, "");
  auto aut = TransformPolicy::Make(GpuMode::kAuto, "");
  ASSERT_TRUE(aut.ok());
  if (!cuda.ok()) {
    // No device: `on` is an error that says why; `auto` is the CPU.
    ASSERT_FALSE(on.ok());
    EXPECT_NE(on.status().message().find("--gpu=on"), std::string::npos) << on.status().message();
    EXPECT_EQ((*aut)->Describe(), "cpu");
    EXPECT_EQ(&(*aut)->For(TransformKind::kWiden, 1ull << 30), &CpuTransforms());
  } else {
    ASSERT_TRUE(on.ok());
    EXPECT_NE(&(*on)->For(TransformKind::kWiden, 1), &CpuTransforms());
    // auto never sends a plan under 1 MiB to the GPU.
    EXPECT_EQ(&(*aut)->For(TransformKind::kWiden, 4096), &CpuTransforms());
  }
}

TEST(TransformPlanTest, ClassifiesPlans) {
  GatherOp wide;
  wide.sdtype = DType::kBF16, wide.rank = 1, wide.len[0] = 1000, wide.sstr[0] = 1, wide.dstr[0] = 1;
  EXPECT_EQ(ClassifyPlan(std::span<const GatherOp>(&wide, 1), DType::kF32), TransformKind::kWiden);
  GatherOp rows;  // 4-element rows of a TP=8 merge
  rows.sdtype = DType::kF32, rows.rank = 2, rows.len[0] = 1000, rows.len[1] = 4;
  rows.sstr[0] = 4, rows.sstr[1] = 1, rows.dstr[0] = 32, rows.dstr[1] = 1;
  EXPECT_EQ(ClassifyPlan(std::span<const GatherOp>(&rows, 1), DType::kF32), TransformKind::kTinyRuns);
  rows.len[1] = 4096, rows.sstr[0] = 4096, rows.dstr[0] = 8192;
  EXPECT_EQ(ClassifyPlan(std::span<const GatherOp>(&rows, 1), DType::kF32), TransformKind::kCopy);
  EXPECT_EQ(rows.SrcSpan(), 1000ull * 4096 * 4);
  EXPECT_EQ(rows.DstSpan(DType::kF32), (999ull * 8192 + 4096) * 4);
}

}  // namespace
}  // namespace ckptfs
