// The CUDA kernels, run on the CPU: io/kernels.h holds every kernel's body as
// host-and-device functions (cuda_transforms.cu's kernels only call them), so
// this test drives the very same code through an emulated launch — every
// (block, thread) of the launch configuration the .cu uses, device buffers
// laid out as the .cu lays them out — and compares the bytes with the CPU
// backend's, bit for bit: random plans of every dtype pair the transforms
// support (odd sizes, unaligned offsets, strided and broadcast sources, mixed
// conversions in one plan), the calibration's synthetic plans, every widening
// bit pattern, the narrowing rounding cases, means of replicas of random bit
// patterns, CRC-32C chunks and their fold. Deliberately wrong bodies (an off-by-one index, a mean that
// rounds once, a CRC chunk one byte short) must be caught, so the comparison
// is shown to be able to fail. No GPU is needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ckptfs/io.h"
#include "ckptfs/transforms.h"
#include "io/kernels.h"
#include "io/transform_internal.h"

namespace ckptfs {
namespace {

using kernels::DevOp;
using kernels::Launch;

// The fp8 tables as the host has them (the device's constant memory holds
// copies of these floats).
struct HostFp8 {
  uint32_t operator()(int table, unsigned char b) const {
    return kernels::FloatToBits(Fp8DecodeTable(kernels::kFp8Dtypes[table])[b]);
  }
};

// A device allocation: 256-byte aligned as cudaMalloc's, filled with garbage
// as uninitialized device memory may be.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t n, unsigned char fill = 0xCD) : n_(n) {
    p_ = static_cast<unsigned char*>(std::aligned_alloc(256, std::max<uint64_t>(256, (n + 255) / 256 * 256)));
    std::memset(p_, fill, n);
  }
  ~DeviceBuffer() { std::free(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  unsigned char* data() { return p_; }
  uint64_t size() const { return n_; }

 private:
  unsigned char* p_;
  uint64_t n_;
};

// Where two byte strings first differ; nullopt when equal.
std::optional<uint64_t> FirstDifference(const std::vector<char>& a, const std::vector<char>& b) {
  if (a.size() != b.size()) return std::min(a.size(), b.size());
  for (uint64_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return i;
  }
  return std::nullopt;
}

// --- Gather.

// What one thread of GatherKernel runs: (block, block_dim, thread, grid_dim)
// and the kernel's arguments.
using GatherBody = std::function<void(uint32_t, uint32_t, uint32_t, uint32_t, const unsigned char*, unsigned char*,
                                      const DevOp*, int, uint64_t)>;

void RealGatherBody(uint32_t b, uint32_t bd, uint32_t t, uint32_t gd, const unsigned char* src, unsigned char* dst,
                    const DevOp* ops, int nops, uint64_t total) {
  kernels::GatherThread(b, bd, t, gd, src, dst, ops, nops, total, HostFp8{});
}

struct GatherRun {
  std::optional<Launch> grid;  // the .cu's GatherLaunch when absent
  bool force_wide = false;     // every op through the 64-bit index path
};

// CudaBackend::Gather + Pipeline::Submit, with the launch emulated: the ops
// rebased to 16-byte aligned device buffers, the caller's output bytes
// preloaded where ops leave holes, every thread of the grid run, [dst_lo,
// dst_hi) copied back.
void EmulateGather(const std::vector<char>& src, std::span<const GatherOp> ops, DType out, std::vector<char>& dst,
                   const GatherBody& body, const GatherRun& run = {}) {
  ASSERT_TRUE(ValidateOps(src.size(), ops, out, dst.size()).ok());
  const PlanExtent ext = ExtentOf(ops, out);
  if (ext.elements == 0) return;
  const kernels::ChunkLayout lay = kernels::LayoutChunk(ext);
  kernels::KernelOps kops = kernels::BuildKernelOps(ops, out, lay.sbase, lay.dbase);
  for (const DevOp& op : kops.ops) {
    // The typed loads and stores the device does where `aligned` is set must
    // be aligned on 256-byte aligned buffers.
    if (op.aligned) {
      ASSERT_EQ(op.src_off % op.ssize, 0u);
      ASSERT_EQ(op.dst_off % op.dsize, 0u);
    }
    ASSERT_GE(op.conv, 0);
  }
  if (run.force_wide) {
    for (DevOp& op : kops.ops) op.small = 0;
  }
  DeviceBuffer dsrc(lay.sbytes), ddst(lay.dbytes);
  std::memcpy(dsrc.data(), src.data() + lay.sbase, lay.sbytes);
  if (lay.prefill) std::memcpy(ddst.data() + lay.head, dst.data() + ext.dst_lo, lay.obytes);
  const Launch l = run.grid ? *run.grid : kernels::GatherLaunch(kops.total);
  for (uint32_t b = 0; b < l.blocks; ++b) {
    for (uint32_t t = 0; t < l.threads; ++t) {
      body(b, l.threads, t, l.blocks, dsrc.data(), ddst.data(), kops.ops.data(), static_cast<int>(kops.ops.size()),
           kops.total);
    }
  }
  std::memcpy(dst.data() + ext.dst_lo, ddst.data() + lay.head, lay.obytes);
}

// The CPU backend's bytes and the emulated kernel's on the same plan and the
// same prior output contents; the first difference, if any.
std::optional<uint64_t> CompareGather(const std::vector<char>& src, std::span<const GatherOp> ops, DType out,
                                      uint64_t dst_len, const GatherBody& body, const GatherRun& run = {}) {
  std::vector<char> want(dst_len), got(dst_len);
  for (uint64_t i = 0; i < dst_len; ++i) want[i] = got[i] = static_cast<char>(i * 131 + 7);
  Status s = CpuTransforms().Gather(src.data(), src.size(), ops, out, want.data(), want.size());
  EXPECT_TRUE(s.ok()) << s.message();
  EmulateGather(src, ops, out, got, body, run);
  return FirstDifference(want, got);
}

std::vector<char> RandomBytes(uint64_t n, std::mt19937_64& rng) {
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

constexpr DType kAllDtypes[] = {DType::kBool,     DType::kU8,     DType::kI8,         DType::kI16,       DType::kI32,
                                DType::kI64,      DType::kU16,    DType::kU32,        DType::kU64,       DType::kF16,
                                DType::kBF16,     DType::kF32,    DType::kF64,        DType::kC64,       DType::kC128,
                                DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ};

// Every (source, output) pair the transforms support.
std::vector<std::pair<DType, DType>> SupportedPairs() {
  std::vector<std::pair<DType, DType>> v;
  for (DType s : kAllDtypes) {
    for (DType o : kAllDtypes) {
      if (CanConvert(s, o)) v.emplace_back(s, o);
    }
  }
  return v;
}

// A random plan rendering into `out`: `nops` ops of source dtypes drawn from
// `sources`, each of rank 0..5 with small (odd, one, zero) lengths, source
// strides C order, transposed, padded or 0 (broadcast), output strides C
// order of a padded box; outputs one after another at unaligned offsets with
// gaps (holes the kernel must not touch), sources anywhere (unaligned,
// overlapping).
struct RandomPlan {
  std::vector<char> src;
  std::vector<GatherOp> ops;
  uint64_t dst_len = 0;
};
RandomPlan MakeRandomPlan(std::mt19937_64& rng, const std::vector<DType>& sources, DType out, int nops) {
  RandomPlan p;
  const uint64_t osz = DTypeSize(out);
  uint64_t dpos = rng() % 13;
  uint64_t src_len = 64 + rng() % 4096;
  for (int k = 0; k < nops; ++k) {
    GatherOp op;
    op.sdtype = sources[rng() % sources.size()];
    op.rank = static_cast<uint8_t>(rng() % 6);
    const uint64_t ssz = DTypeSize(op.sdtype);
    for (int d = 0; d < op.rank; ++d) {
      const uint64_t r = rng() % 10;
      op.len[d] = r == 0 ? 1 : r == 1 ? static_cast<int64_t>(rng() % 2) : static_cast<int64_t>(1 + rng() % 7);
    }
    // Output: C order of the box with each dim padded by 0..2 elements.
    int64_t st = 1;
    for (int d = op.rank - 1; d >= 0; --d) {
      op.dstr[d] = st;
      st *= op.len[d] + static_cast<int64_t>(rng() % 3);
    }
    // Source: C order, transposed (Fortran), padded, or broadcast along a dim.
    const uint64_t mode = rng() % 4;
    st = 1;
    if (mode == 1) {
      for (int d = 0; d < op.rank; ++d) op.sstr[d] = st, st *= op.len[d];
    } else {
      for (int d = op.rank - 1; d >= 0; --d) {
        op.sstr[d] = st;
        st *= op.len[d] + (mode == 2 ? static_cast<int64_t>(rng() % 4) : 0);
      }
      if (mode == 3 && op.rank > 0) op.sstr[rng() % op.rank] = 0;
    }
    op.dst_off = dpos;
    dpos += op.DstSpan(out) + rng() % 9;                      // a gap: bytes no op writes
    if (rng() % 4 == 0) dpos = (dpos + osz - 1) / osz * osz;  // sometimes aligned
    const uint64_t span = op.SrcSpan();
    if (span + 16 > src_len) src_len = span + 16 + rng() % 64;
    op.src_off = rng() % (src_len - span);
    if (rng() % 3 == 0) op.src_off -= op.src_off % ssz;  // sometimes aligned
    p.ops.push_back(op);
  }
  p.src = RandomBytes(src_len, rng);
  p.dst_len = dpos + rng() % 17;
  return p;
}

TEST(KernelEmulationTest, RandomPlansOfEveryDtypePairEqualTheCpu) {
  std::mt19937_64 rng(101);
  const auto pairs = SupportedPairs();
  ASSERT_GT(pairs.size(), 20u);
  int plans = 0;
  for (const auto& [sd, out] : pairs) {
    for (int it = 0; it < 12; ++it) {
      RandomPlan p = MakeRandomPlan(rng, {sd}, out, 1 + static_cast<int>(rng() % 6));
      for (const GatherRun& run : {GatherRun{}, GatherRun{Launch{3, 32}, false}, GatherRun{Launch{1, 1}, true}}) {
        const auto diff = CompareGather(p.src, p.ops, out, p.dst_len, RealGatherBody, run);
        ASSERT_FALSE(diff.has_value()) << DTypeName(sd) << "->" << DTypeName(out) << " iteration " << it
                                       << ": first differing byte " << *diff;
      }
      ++plans;
    }
  }
  // Plans mixing every conversion into float32: ops of different kinds side by
  // side, so each thread's binary search picks the right one.
  std::vector<DType> into_f32;
  for (const auto& [sd, out] : pairs) {
    if (out == DType::kF32) into_f32.push_back(sd);
  }
  for (int it = 0; it < 200; ++it) {
    RandomPlan p = MakeRandomPlan(rng, into_f32, DType::kF32, 1 + static_cast<int>(rng() % 40));
    const auto diff = CompareGather(p.src, p.ops, DType::kF32, p.dst_len, RealGatherBody);
    ASSERT_FALSE(diff.has_value()) << "mixed plan " << it << ": first differing byte " << *diff;
    const auto diff2 = CompareGather(p.src, p.ops, DType::kF32, p.dst_len, RealGatherBody, {Launch{2, 64}, true});
    ASSERT_FALSE(diff2.has_value()) << "mixed plan " << it << " (small grid, 64-bit index): first differing byte "
                                    << *diff2;
    ++plans;
  }
  EXPECT_GT(plans, 400);
}

// The plans calibration times (TP=2 and TP=8 merges, bf16 widen, fp8 and f16
// merges) at sizes whose launches have many blocks and a partial last block.
TEST(KernelEmulationTest, SyntheticMergePlansEqualTheCpu) {
  struct P {
    DType sd;
    int64_t run, parts;
    uint64_t bytes;
  };
  for (const P& c : {P{DType::kF32, 4096, 2, 1 << 20}, P{DType::kF32, 4, 8, (1 << 20) + 44},
                     P{DType::kBF16, 1 << 18, 1, 1 << 20}, P{DType::kBF16, 7, 3, 300001}, P{DType::kF16, 33, 4, 100000},
                     P{DType::kF8E4M3FN, 5, 8, 77777}, P{DType::kF8E5M2, 1, 2, 4099}}) {
    SyntheticPlan s = MakeMergePlan(c.sd, c.run, c.parts, c.bytes);
    const auto diff = CompareGather(s.src, s.ops, DType::kF32, s.out_bytes, RealGatherBody);
    ASSERT_FALSE(diff.has_value()) << DTypeName(c.sd) << " run " << c.run << " parts " << c.parts
                                   << ": first differing byte " << *diff;
  }
}

// Every bf16 and f16 pattern and every byte of each fp8 format, widened at an
// aligned and an unaligned output offset (typed vs byte stores on the device).
TEST(KernelEmulationTest, EveryWideningBitPattern) {
  for (DType sd :
       {DType::kBF16, DType::kF16, DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ}) {
    const uint64_t n = DTypeSize(sd) == 2 ? 65536 : 256, ssz = DTypeSize(sd);
    for (uint64_t shift : {0, 1, 3}) {
      std::vector<char> src(n * ssz + shift);
      for (uint64_t i = 0; i < n; ++i) {
        if (ssz == 2)
          StoreLE<uint16_t>(src.data() + shift + 2 * i, static_cast<uint16_t>(i));
        else
          src[shift + i] = static_cast<char>(i);
      }
      GatherOp op;
      op.sdtype = sd, op.rank = 1, op.len[0] = static_cast<int64_t>(n), op.sstr[0] = 1, op.dstr[0] = 1;
      op.src_off = shift, op.dst_off = shift;
      const auto diff =
          CompareGather(src, std::span<const GatherOp>(&op, 1), DType::kF32, n * 4 + shift + 5, RealGatherBody);
      ASSERT_FALSE(diff.has_value()) << DTypeName(sd) << " shift " << shift << ": first differing byte " << *diff;
    }
  }
}

// float32 narrowed to bf16 and f16: for every upper part a narrowing keeps
// (each bf16 pattern; sign, exponent and 10 mantissa bits for f16), the low
// bits it drops at the rounding decisions (exact, just below, at and just
// above half an ulp, all ones), at an aligned and an unaligned offset.
TEST(KernelEmulationTest, EveryNarrowingRoundingCase) {
  struct C {
    DType out;
    uint32_t top_bits;
    std::vector<uint32_t> low;
  };
  for (const C& c : {C{DType::kBF16, 16, {0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF}},
                     C{DType::kF16, 19, {0, 0x0FFF, 0x1000, 0x1001, 0x1FFF}}}) {
    const uint32_t drop = 32 - c.top_bits;
    const uint64_t n = (1ull << c.top_bits) * c.low.size();
    for (uint64_t shift : {0, 3}) {
      std::vector<char> src(n * 4 + shift);
      uint64_t i = 0;
      for (uint64_t top = 0; top < (1ull << c.top_bits); ++top) {
        for (uint32_t low : c.low)
          StoreLE<uint32_t>(src.data() + shift + 4 * i++, static_cast<uint32_t>(top << drop) | low);
      }
      GatherOp op;
      op.sdtype = DType::kF32, op.rank = 1, op.len[0] = static_cast<int64_t>(n), op.sstr[0] = 1, op.dstr[0] = 1;
      op.src_off = shift, op.dst_off = shift;
      const auto diff = CompareGather(src, std::span<const GatherOp>(&op, 1), c.out, n * 2 + shift + 5, RealGatherBody);
      ASSERT_FALSE(diff.has_value()) << DTypeName(c.out) << " shift " << shift << ": first differing byte " << *diff;
    }
  }
}

// An off-by-one in the thread's element index (it skips element 0 of the
// grid) must be caught; so must a body that writes nothing.
TEST(KernelEmulationTest, AWrongGatherBodyIsCaught) {
  GatherBody off_by_one = [](uint32_t b, uint32_t bd, uint32_t t, uint32_t gd, const unsigned char* src,
                             unsigned char* dst, const DevOp* ops, int nops, uint64_t total) {
    const uint64_t stride = static_cast<uint64_t>(gd) * bd;
    for (uint64_t e = static_cast<uint64_t>(b) * bd + t + 1; e < total; e += stride) {
      kernels::GatherElement(src, dst, ops, nops, e, HostFp8{});
    }
  };
  GatherBody nothing = [](uint32_t, uint32_t, uint32_t, uint32_t, const unsigned char*, unsigned char*, const DevOp*,
                          int, uint64_t) {};
  std::mt19937_64 rng(5);
  int caught = 0, plans = 0;
  for (int it = 0; it < 50; ++it) {
    RandomPlan p = MakeRandomPlan(rng, {DType::kBF16, DType::kF32}, DType::kF32, 3);
    if (ExtentOf(p.ops, DType::kF32).elements == 0) continue;
    ++plans;
    if (CompareGather(p.src, p.ops, DType::kF32, p.dst_len, off_by_one).has_value()) ++caught;
    EXPECT_TRUE(CompareGather(p.src, p.ops, DType::kF32, p.dst_len, nothing).has_value()) << "plan " << it;
    EXPECT_FALSE(CompareGather(p.src, p.ops, DType::kF32, p.dst_len, RealGatherBody).has_value()) << "plan " << it;
  }
  // Element 0 can equal the prior byte pattern by chance only rarely.
  EXPECT_GT(plans, 20);
  EXPECT_GE(caught, plans - 2);
}

// --- Mean of replicas.

using MeanBody = std::function<void(uint32_t, uint32_t, uint32_t, uint32_t, const unsigned char*, uint64_t, uint32_t,
                                    DType, uint64_t, unsigned char*)>;

void RealMeanBody(uint32_t b, uint32_t bd, uint32_t t, uint32_t gd, const unsigned char* src, uint64_t copy_bytes,
                  uint32_t copies, DType dt, uint64_t numel, unsigned char* dst) {
  kernels::MeanThread(b, bd, t, gd, src, copy_bytes, copies, dt, numel, dst);
}

// CudaBackend::Mean's launch over one piece, emulated; the CPU backend's
// bytes against it.
std::optional<uint64_t> CompareMean(const std::vector<char>& src, uint32_t copies, uint64_t numel, DType dt,
                                    const MeanBody& body, std::optional<Launch> grid = std::nullopt) {
  const uint64_t esz = DTypeSize(dt);
  std::vector<char> want(numel * esz, 'w');
  EXPECT_TRUE(CpuTransforms().Mean(src.data(), copies, numel, dt, want.data()).ok());
  DeviceBuffer dsrc(src.size()), ddst(numel * esz);
  std::memcpy(dsrc.data(), src.data(), src.size());
  const Launch l = grid ? *grid : kernels::MeanLaunch(numel);
  for (uint32_t b = 0; b < l.blocks; ++b) {
    for (uint32_t t = 0; t < l.threads; ++t)
      body(b, l.threads, t, l.blocks, dsrc.data(), numel * esz, copies, dt, numel, ddst.data());
  }
  std::vector<char> got(reinterpret_cast<char*>(ddst.data()), reinterpret_cast<char*>(ddst.data()) + numel * esz);
  return FirstDifference(want, got);
}

// Replicas of random bit patterns (NaNs, infinities, subnormals, -0 included)
// or of random normal values (the rounding of sums that matter).
std::vector<char> MeanSource(std::mt19937_64& rng, DType dt, uint32_t copies, uint64_t numel, bool bits) {
  const uint64_t esz = DTypeSize(dt);
  std::vector<char> src(copies * numel * esz);
  std::normal_distribution<double> nd(0.0, 3.0);
  for (uint64_t k = 0; k < copies * numel; ++k) {
    char* p = src.data() + k * esz;
    if (bits) {
      for (uint64_t b = 0; b < esz; ++b) p[b] = static_cast<char>(rng());
      continue;
    }
    const double v = nd(rng);
    const uint32_t f = kernels::FloatToBits(static_cast<float>(v));
    if (dt == DType::kF64)
      std::memcpy(p, &v, 8);
    else if (dt == DType::kF32)
      std::memcpy(p, &f, 4);
    else
      StoreLE<uint16_t>(p, dt == DType::kBF16 ? FloatBitsToBFloat16Bits(f) : FloatBitsToHalfBits(f));
  }
  return src;
}

TEST(KernelEmulationTest, MeanOfReplicasEqualsTheCpu) {
  std::mt19937_64 rng(202);
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    for (uint32_t copies : {1u, 2u, 3u, 5u, 8u}) {
      for (uint64_t numel : {uint64_t{1}, uint64_t{7}, uint64_t{255}, uint64_t{257}, 1000 + rng() % 5000}) {
        for (bool bits : {false, true}) {
          const auto src = MeanSource(rng, dt, copies, numel, bits);
          const auto diff = CompareMean(src, copies, numel, dt, RealMeanBody);
          ASSERT_FALSE(diff.has_value()) << DTypeName(dt) << " x" << copies << " numel " << numel
                                         << ": first differing byte " << *diff;
          const auto diff2 = CompareMean(src, copies, numel, dt, RealMeanBody, Launch{2, 33});
          ASSERT_FALSE(diff2.has_value()) << DTypeName(dt) << " x" << copies << " numel " << numel << " (small grid)";
        }
      }
    }
  }
}

// NaNs in a mean come out as x86 (torch on the CPU) gives them, on the host
// and the device alike: the first NaN operand quieted, inf - inf the default
// NaN with its sign set; f16 keeps that sign, bf16 is always 0x7FC0.
TEST(KernelEmulationTest, MeanNanRulesAreX86s) {
  auto mean32 = [](std::vector<uint32_t> v) {
    std::vector<char> src(v.size() * 4), dst(4);
    for (size_t k = 0; k < v.size(); ++k) StoreLE<uint32_t>(src.data() + 4 * k, v[k]);
    EXPECT_TRUE(CpuTransforms().Mean(src.data(), static_cast<uint32_t>(v.size()), 1, DType::kF32, dst.data()).ok());
    return LoadLE<uint32_t>(dst.data());
  };
  EXPECT_EQ(mean32({0x7F800001u, 0x3F800000u}), 0x7FC00001u);  // a signalling NaN, quieted, payload kept
  EXPECT_EQ(mean32({0x3F800000u, 0xFFC00123u}), 0xFFC00123u);
  EXPECT_EQ(mean32({0x7FC00005u, 0xFFC00009u}), 0x7FC00005u);  // both NaN: the accumulator's
  EXPECT_EQ(mean32({0x7F800000u, 0xFF800000u}), 0xFFC00000u);  // inf - inf
  std::vector<char> h(2), out(2);
  StoreLE<uint16_t>(h.data(), 0xFC01);  // a negative f16 NaN
  ASSERT_TRUE(CpuTransforms().Mean(h.data(), 1, 1, DType::kF16, out.data()).ok());
  EXPECT_EQ(LoadLE<uint16_t>(out.data()), 0xFE00);
  StoreLE<uint16_t>(h.data(), 0xFF81);  // a negative bf16 NaN
  ASSERT_TRUE(CpuTransforms().Mean(h.data(), 1, 1, DType::kBF16, out.data()).ok());
  EXPECT_EQ(LoadLE<uint16_t>(out.data()), 0x7FC0);
#if defined(__x86_64__)
  // Where one operand at most is a NaN, AddF32 is this CPU's own addition.
  std::mt19937_64 rng(17);
  const uint32_t specials[] = {0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC00000u, 0x00000001u, 0x80000000u, 0u};
  for (int i = 0; i < 200000; ++i) {
    uint32_t a = static_cast<uint32_t>(rng()), b = static_cast<uint32_t>(rng());
    if (i % 3 == 0) a = specials[rng() % std::size(specials)];
    if (i % 5 == 0) b = specials[rng() % std::size(specials)];
    if (kernels::IsNanBits32(a) && kernels::IsNanBits32(b)) continue;
    volatile float fa = kernels::BitsToFloat(a), fb = kernels::BitsToFloat(b);
    const float sum = fa + fb;
    ASSERT_EQ(kernels::AddF32(a, b), kernels::FloatToBits(sum)) << std::hex << a << " + " << b;
    volatile double da = kernels::BitsToDouble(uint64_t{a} << 32 | b),
                    db = kernels::BitsToDouble(uint64_t{b} << 32 | a);
    const double dsum = da + db;
    const uint64_t ba = uint64_t{a} << 32 | b, bb = uint64_t{b} << 32 | a;
    if (kernels::IsNanBits64(ba) && kernels::IsNanBits64(bb)) continue;
    ASSERT_EQ(kernels::AddF64(ba, bb), kernels::DoubleToBits(dsum)) << std::hex << ba << " + " << bb;
  }
#endif
}

// A mean that accumulates bf16 in float and rounds once (what a "faster"
// kernel might do) differs from Python's per-step rounding and must be
// caught; so must an index that is off by one.
TEST(KernelEmulationTest, AWrongMeanBodyIsCaught) {
  MeanBody round_once = [](uint32_t b, uint32_t bd, uint32_t t, uint32_t gd, const unsigned char* src,
                           uint64_t copy_bytes, uint32_t copies, DType, uint64_t numel, unsigned char* dst) {
    for (uint64_t i = static_cast<uint64_t>(b) * bd + t; i < numel; i += static_cast<uint64_t>(gd) * bd) {
      float acc = 0.0f;
      for (uint32_t k = 0; k < copies; ++k) {
        acc += kernels::BitsToFloat(BFloat16BitsToFloatBits(kernels::LoadLE16(src + k * copy_bytes + i * 2)));
      }
      kernels::StoreLE16(FloatBitsToBFloat16Bits(kernels::FloatToBits(acc / static_cast<float>(copies))), dst + i * 2);
    }
  };
  MeanBody off_by_one = [](uint32_t b, uint32_t bd, uint32_t t, uint32_t gd, const unsigned char* src,
                           uint64_t copy_bytes, uint32_t copies, DType dt, uint64_t numel, unsigned char* dst) {
    for (uint64_t i = static_cast<uint64_t>(b) * bd + t; i + 1 < numel; i += static_cast<uint64_t>(gd) * bd) {
      kernels::MeanElement(src, copy_bytes, copies, dt, i, dst);
    }
  };
  std::mt19937_64 rng(3);
  const auto src = MeanSource(rng, DType::kBF16, 8, 4000, false);
  EXPECT_FALSE(CompareMean(src, 8, 4000, DType::kBF16, RealMeanBody).has_value());
  EXPECT_TRUE(CompareMean(src, 8, 4000, DType::kBF16, round_once).has_value());
  const auto d2 = CompareMean(src, 8, 4000, DType::kBF16, off_by_one);
  ASSERT_TRUE(d2.has_value());
  EXPECT_GE(*d2, 3999u * 2);  // the last element's bytes
}

// --- CRC-32C chunks.

using CrcBody = std::function<void(uint32_t, uint32_t, uint32_t, const uint32_t*, const unsigned char*, uint64_t,
                                   uint64_t, uint32_t*, uint64_t)>;

void RealCrcBody(uint32_t b, uint32_t bd, uint32_t t, const uint32_t* table, const unsigned char* data, uint64_t len,
                 uint64_t chunk, uint32_t* out, uint64_t nchunks) {
  kernels::Crc32cChunkThread(b, bd, t, table, data, len, chunk, out, nchunks);
}

// CudaBackend::Crc32c emulated: pieces of kCrcPiece, each piece's chunk
// kernel run block by block (every thread fills its share of the block's
// shared table, the barrier, then every thread hashes its chunk), and the
// host's fold.
uint32_t EmulateCrc(const char* data, uint64_t len, const CrcBody& body) {
  using kernels::kCrcChunk;
  const uint32_t full = Crc32cShiftOp(kCrcChunk);
  uint32_t crc = 0;
  for (uint64_t off = 0; off < len; off += kernels::kCrcPiece) {
    const uint64_t n = std::min(kernels::kCrcPiece, len - off), nchunks = (n + kCrcChunk - 1) / kCrcChunk;
    DeviceBuffer dsrc(n), dout(nchunks * 4);
    std::memcpy(dsrc.data(), data + off, n);
    auto* out = reinterpret_cast<uint32_t*>(dout.data());
    const Launch l = kernels::Crc32cLaunch(nchunks);
    for (uint32_t b = 0; b < l.blocks; ++b) {
      uint32_t table[256];
      std::memset(table, 0xAB, sizeof(table));  // shared memory starts undefined
      for (uint32_t t = 0; t < l.threads; ++t) kernels::Crc32cFillTable(t, l.threads, table);
      for (uint32_t t = 0; t < l.threads; ++t) body(b, l.threads, t, table, dsrc.data(), n, kCrcChunk, out, nchunks);
    }
    crc = kernels::Crc32cFoldChunks(crc, out, n, full);
  }
  return crc;
}

TEST(KernelEmulationTest, Crc32cChunksEqualTheCpu) {
  using kernels::kCrcChunk;
  EXPECT_EQ(EmulateCrc("123456789", 9, RealCrcBody), 0xE3069283u);  // the catalogue check value
  std::mt19937_64 rng(303);
  // More than one device piece, so the fold across pieces runs too.
  const auto data = RandomBytes(kernels::kCrcPiece + 2 * kCrcChunk + 5, rng);
  std::vector<ByteRange> ranges{{0, 0},
                                {1, 1},
                                {3, kCrcChunk - 1},
                                {5, kCrcChunk},
                                {7, kCrcChunk + 1},
                                {0, 128 * kCrcChunk},
                                {11, 128 * kCrcChunk + 3},
                                {13, 300 * kCrcChunk + 77},
                                {0, data.size()}};
  for (int i = 0; i < 12; ++i) {
    const uint64_t a = rng() % data.size(), n = rng() % std::min<uint64_t>(data.size() - a, 3 << 20);
    ranges.push_back({a, n});
  }
  std::vector<uint32_t> want(ranges.size());
  ASSERT_TRUE(CpuTransforms().Crc32c(data.data(), data.size(), ranges, want.data()).ok());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(EmulateCrc(data.data() + ranges[i].offset, ranges[i].length, RealCrcBody), want[i])
        << "range " << i << " [" << ranges[i].offset << ", +" << ranges[i].length << ")";
  }
}

// A chunk hashed one byte short, and a chunk index off by one, are caught.
TEST(KernelEmulationTest, AWrongCrcBodyIsCaught) {
  CrcBody short_chunk = [](uint32_t b, uint32_t bd, uint32_t t, const uint32_t* table, const unsigned char* data,
                           uint64_t len, uint64_t chunk, uint32_t* out, uint64_t nchunks) {
    const uint64_t i = static_cast<uint64_t>(b) * bd + t;
    if (i >= nchunks) return;
    const uint64_t s = i * chunk, n = std::min(chunk, len - s) - 1;
    uint32_t c = ~0u;
    for (uint64_t k = 0; k < n; ++k) c = (c >> 8) ^ table[(c ^ data[s + k]) & 0xFF];
    out[i] = ~c;
  };
  CrcBody shifted = [](uint32_t b, uint32_t bd, uint32_t t, const uint32_t* table, const unsigned char* data,
                       uint64_t len, uint64_t chunk, uint32_t* out, uint64_t nchunks) {
    kernels::Crc32cChunkThread(b, bd, t, table, data + 1, len - 1, chunk, out, nchunks);  // chunks start a byte late
  };
  std::mt19937_64 rng(9);
  const auto data = RandomBytes(5 * kernels::kCrcChunk + 3, rng);
  uint32_t want = 0;
  ByteRange r{0, data.size()};
  ASSERT_TRUE(CpuTransforms().Crc32c(data.data(), data.size(), std::span<const ByteRange>(&r, 1), &want).ok());
  EXPECT_EQ(EmulateCrc(data.data(), data.size(), RealCrcBody), want);
  EXPECT_NE(EmulateCrc(data.data(), data.size(), short_chunk), want);
  EXPECT_NE(EmulateCrc(data.data(), data.size(), shifted), want);
}

// The launch configurations are the .cu's: 256-thread gather blocks capped at
// 65535 * 8 (then grid-stride), 256-thread mean blocks capped at 65535,
// 128 CRC chunks a block.
TEST(KernelEmulationTest, LaunchConfigurations) {
  EXPECT_EQ(kernels::GatherLaunch(0).blocks, 1u);
  EXPECT_EQ(kernels::GatherLaunch(257).blocks, 2u);
  EXPECT_EQ(kernels::GatherLaunch(257).threads, 256u);
  EXPECT_EQ(kernels::GatherLaunch(1ull << 40).blocks, 65535u * 8);
  EXPECT_EQ(kernels::MeanLaunch(1).blocks, 1u);
  EXPECT_EQ(kernels::MeanLaunch(1ull << 40).blocks, 65535u);
  EXPECT_EQ(kernels::Crc32cLaunch(129).blocks, 2u);
  EXPECT_EQ(kernels::Crc32cLaunch(129).threads, 128u);
}

}  // namespace
}  // namespace ckptfs
