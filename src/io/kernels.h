// The bodies of the CUDA transform kernels, as host-and-device functions.
//
// Design note. Every kernel in cuda_transforms.cu is a thin wrapper: it reads
// (blockIdx, blockDim, threadIdx, gridDim) and calls one *Thread function
// below with them; everything a thread computes (which op an element belongs
// to, the op-local index decomposition, the element's conversion, a mean's
// accumulation and rounding, a CRC chunk) lives here. Compiled by g++ the
// same functions run on the CPU, so the unit tests execute the kernels'
// exact code through an emulated launch grid (every block, every thread, the
// same launch configuration the .cu uses) and compare the bytes with the CPU
// backend's, bit for bit, on a machine without a GPU
// (tests/unit/io/kernel_emulation_test.cc). The host-side plan building the
// kernels consume (BuildKernelOps) and the CRC chunk fold are here too, for
// the same reason.
//
// Portability rules, so host and device results cannot differ:
//  * bit casts go through BitsToFloat & co.: the CUDA intrinsics on the
//    device (__CUDA_ARCH__), memcpy on the host;
//  * typed (aligned) loads and stores are used on the device only; the host
//    copies bytes (its buffers carry no alignment promise), which yields the
//    same little-endian values;
//  * the fp8 decode tables are reached through a functor argument: constant
//    memory on the device, Fp8DecodeTable on the host (the same floats).
#ifndef CKPTFS_IO_KERNELS_H_
#define CKPTFS_IO_KERNELS_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "ckptfs/transforms.h"
#include "common/float_bits.h"  // CKPTFS_HD
#include "io/transform_internal.h"

namespace ckptfs {
namespace kernels {

// --- Portable bit casts.
CKPTFS_HD inline float BitsToFloat(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
#endif
}
CKPTFS_HD inline uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
#endif
}
CKPTFS_HD inline double BitsToDouble(uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  double d;
  std::memcpy(&d, &b, sizeof(d));
  return d;
#endif
}
CKPTFS_HD inline uint64_t DoubleToBits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t b;
  std::memcpy(&b, &d, sizeof(b));
  return b;
#endif
}

// Little-endian loads and stores of any alignment.
CKPTFS_HD inline uint16_t LoadLE16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}
CKPTFS_HD inline uint32_t LoadLE32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}
CKPTFS_HD inline uint64_t LoadLE64(const unsigned char* p) {
  uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = (v << 8) | p[b];
  return v;
}
CKPTFS_HD inline void StoreLE16(uint16_t v, unsigned char* p) {
  p[0] = static_cast<unsigned char>(v & 0xFF);
  p[1] = static_cast<unsigned char>(v >> 8);
}
CKPTFS_HD inline void StoreLE32(uint32_t v, unsigned char* p) {
  for (int k = 0; k < 4; ++k) p[k] = static_cast<unsigned char>(v >> (8 * k));
}
CKPTFS_HD inline void StoreLE64(uint64_t v, unsigned char* p) {
  for (int k = 0; k < 8; ++k) p[k] = static_cast<unsigned char>(v >> (8 * k));
}

// --- Gather.

constexpr int kFp8Kinds = 4;
// The fp8 dtypes in the order of DevOp::conv 3.. and of the device tables.
inline constexpr DType kFp8Dtypes[kFp8Kinds] = {DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ,
                                                DType::kF8E5M2FNUZ};

// The op as the kernel sees it; offsets are relative to the chunk's device
// buffers (16-byte aligned bases).
struct DevOp {
  uint64_t first = 0;  // flat element index of the op's first element in the chunk
  uint64_t src_off = 0, dst_off = 0;
  int64_t len[kMaxGatherDims], sstr[kMaxGatherDims], dstr[kMaxGatherDims];
  uint32_t ssize = 0, dsize = 0;
  int32_t conv = 0;  // 0 copy; widen to f32: 1 bf16, 2 f16, 3..6 fp8 table index + 3; narrow f32: 7 bf16, 8 f16
  int32_t rank = 0;
  int32_t aligned = 0;  // typed loads and stores are safe
  int32_t small = 0;    // fewer than 2^32 elements: 32-bit index math
};

// DevOp::conv of the narrowing conversions (float32 -> bf16 / f16, round to
// nearest even, float_bits.h).
constexpr int32_t kNarrowBF16 = 7, kNarrowF16 = 8;

// -1 when the kernel has no conversion from `s` to `d` (ValidateOps rejects
// such plans first).
inline int ConvCode(DType s, DType d) {
  if (s == d) return 0;
  if (s == DType::kF32) return d == DType::kBF16 ? kNarrowBF16 : d == DType::kF16 ? kNarrowF16 : -1;
  if (d != DType::kF32) return -1;
  switch (s) {
    case DType::kBF16:
      return 1;
    case DType::kF16:
      return 2;
    case DType::kF8E4M3FN:
      return 3;
    case DType::kF8E5M2:
      return 4;
    case DType::kF8E4M3FNUZ:
      return 5;
    case DType::kF8E5M2FNUZ:
      return 6;
    default:
      return -1;
  }
}

// The kernel's view of a validated plan: its non-empty ops rebased to
// `sbase` / `dbase` (16-byte aligned) with their flat element prefix.
struct KernelOps {
  std::vector<DevOp> ops;
  uint64_t total = 0;  // elements of all ops
};
inline KernelOps BuildKernelOps(std::span<const GatherOp> ops, DType out, uint64_t sbase, uint64_t dbase) {
  KernelOps k;
  k.ops.reserve(ops.size());
  const uint64_t dsize = DTypeSize(out);
  for (const GatherOp& op : ops) {
    const uint64_t n = op.Elements();
    if (n == 0) continue;
    DevOp d;
    d.first = k.total;
    d.src_off = op.src_off - sbase;
    d.dst_off = op.dst_off - dbase;
    for (int i = 0; i < kMaxGatherDims; ++i) d.len[i] = op.len[i], d.sstr[i] = op.sstr[i], d.dstr[i] = op.dstr[i];
    d.ssize = static_cast<uint32_t>(DTypeSize(op.sdtype));
    d.dsize = static_cast<uint32_t>(dsize);
    d.conv = ConvCode(op.sdtype, out);
    d.rank = op.rank;
    auto pow2 = [](uint64_t v) { return v != 0 && (v & (v - 1)) == 0 && v <= 8; };
    d.aligned = pow2(d.ssize) && pow2(d.dsize) && op.src_off % d.ssize == 0 && op.dst_off % d.dsize == 0;
    d.small = n < (1ull << 32);
    k.ops.push_back(d);
    k.total += n;
  }
  return k;
}

// The ops of a device-output chunk (Transforms::BeginDevice): the output is
// the caller's device buffer itself, at address `dst_addr` (offsets from it,
// no rebasing, nothing staged or copied back). Typed stores need the
// element alignment the ops assume of a 16-byte aligned base; a buffer that
// is not so aligned (a view into a tensor) takes the byte path, the same bytes.
inline KernelOps BuildDeviceOutputOps(std::span<const GatherOp> ops, DType out, uint64_t sbase, uint64_t dst_addr) {
  KernelOps k = BuildKernelOps(ops, out, sbase, 0);
  if (dst_addr % 16 != 0) {
    for (DevOp& d : k.ops) d.aligned = 0;
  }
  return k;
}

// The one op that renders `numel` contiguous elements of `from` as `to` (a
// mean of replicas computed in its source dtype, then widened on the device).
inline GatherOp ContiguousOp(uint64_t numel, DType from) {
  GatherOp op;
  op.sdtype = from;
  op.rank = 1;
  op.len[0] = static_cast<int64_t>(numel);
  op.sstr[0] = 1;
  op.dstr[0] = 1;
  return op;
}

// Where a chunk's bytes sit on the device: the source from `sbase` and the
// output from `dbase` (both 16-byte aligned, so an op's `aligned` holds on
// 256-byte aligned device buffers); only the output bytes [dst_lo, dst_hi)
// (`head` into the device output, `obytes` long) go back, and when the ops do
// not write all of them (`prefill`) the caller's bytes go to the device first.
struct ChunkLayout {
  uint64_t sbase = 0, sbytes = 0, dbase = 0, dbytes = 0, head = 0, obytes = 0;
  bool prefill = false;
};
inline ChunkLayout LayoutChunk(const PlanExtent& ext) {
  ChunkLayout c;
  c.sbase = ext.src_lo & ~15ull, c.dbase = ext.dst_lo & ~15ull;
  c.sbytes = ext.src_hi - c.sbase, c.dbytes = ext.dst_hi - c.dbase;
  c.head = ext.dst_lo - c.dbase, c.obytes = ext.dst_hi - ext.dst_lo;
  c.prefill = ext.dst_bytes != c.obytes;
  return c;
}

// The gather launch: 256 threads a block, one thread per element up to
// 65535 * 8 blocks, grid-stride beyond.
struct Launch {
  uint32_t blocks = 1, threads = 1;
};
inline Launch GatherLaunch(uint64_t total) {
  constexpr uint64_t kThreads = 256;
  uint64_t want = (total + kThreads - 1) / kThreads;
  if (want < 1) want = 1;
  if (want > 65535ull * 8) want = 65535ull * 8;
  return {static_cast<uint32_t>(want), static_cast<uint32_t>(kThreads)};
}

CKPTFS_HD inline void CopyElement(const unsigned char* s, unsigned char* d, uint32_t size, bool aligned) {
#if defined(__CUDA_ARCH__)
  if (aligned) {
    switch (size) {
      case 1:
        *d = *s;
        return;
      case 2:
        *reinterpret_cast<uint16_t*>(d) = *reinterpret_cast<const uint16_t*>(s);
        return;
      case 4:
        *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(s);
        return;
      case 8:
        *reinterpret_cast<uint64_t*>(d) = *reinterpret_cast<const uint64_t*>(s);
        return;
      default:
        break;
    }
  }
#else
  (void)aligned;
#endif
  for (uint32_t i = 0; i < size; ++i) d[i] = s[i];
}

// One element of `op` from `s` to `d`. `fp8(table, byte)` returns the float32
// bits fp8 table `table` (kFp8Dtypes order) decodes `byte` to.
template <typename Fp8>
CKPTFS_HD inline void ConvertElement(const DevOp& op, const unsigned char* s, unsigned char* d, const Fp8& fp8) {
  if (op.conv == 0) {
    CopyElement(s, d, op.ssize, op.aligned != 0);
    return;
  }
  if (op.conv >= kNarrowBF16) {
    uint32_t f;
#if defined(__CUDA_ARCH__)
    f = op.aligned ? *reinterpret_cast<const uint32_t*>(s) : LoadLE32(s);
#else
    f = LoadLE32(s);
#endif
    const uint16_t h = op.conv == kNarrowBF16 ? FloatBitsToBFloat16Bits(f) : FloatBitsToHalfBits(f);
#if defined(__CUDA_ARCH__)
    if (op.aligned) {
      *reinterpret_cast<uint16_t*>(d) = h;
      return;
    }
#endif
    StoreLE16(h, d);
    return;
  }
  uint32_t bits;
  if (op.conv <= 2) {
    uint16_t h;
#if defined(__CUDA_ARCH__)
    h = op.aligned ? *reinterpret_cast<const uint16_t*>(s) : LoadLE16(s);  // little-endian host and device
#else
    h = LoadLE16(s);
#endif
    bits = op.conv == 1 ? BFloat16BitsToFloatBits(h) : HalfBitsToFloatBits(h);
  } else {
    bits = fp8(op.conv - 3, s[0]);
  }
#if defined(__CUDA_ARCH__)
  if (op.aligned) {
    *reinterpret_cast<uint32_t*>(d) = bits;
    return;
  }
#endif
  StoreLE32(bits, d);
}

// Element offsets (in elements) of op-local flat index `local` in the source
// and the output: the row-major decomposition over op.len, innermost first.
template <typename I>
CKPTFS_HD inline void Offsets(const DevOp& op, I local, uint64_t* so, uint64_t* dof) {
  uint64_t s = 0, t = 0;
  for (int d = op.rank - 1; d >= 0; --d) {
    const I l = static_cast<I>(op.len[d]);
    const I i = local % l;
    local /= l;
    s += static_cast<uint64_t>(i) * static_cast<uint64_t>(op.sstr[d]);
    t += static_cast<uint64_t>(i) * static_cast<uint64_t>(op.dstr[d]);
  }
  *so = s;
  *dof = t;
}

// The op holding flat element `e`: the last with first <= e.
CKPTFS_HD inline int FindOp(const DevOp* ops, int nops, uint64_t e) {
  int lo = 0, hi = nops - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ops[mid].first <= e)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Flat element `e` of the plan.
template <typename Fp8>
CKPTFS_HD inline void GatherElement(const unsigned char* src, unsigned char* dst, const DevOp* ops, int nops,
                                    uint64_t e, const Fp8& fp8) {
  const DevOp& op = ops[FindOp(ops, nops, e)];
  const uint64_t local = e - op.first;
  uint64_t so, dof;
  if (op.small)
    Offsets<uint32_t>(op, static_cast<uint32_t>(local), &so, &dof);
  else
    Offsets<uint64_t>(op, local, &so, &dof);
  ConvertElement(op, src + op.src_off + so * op.ssize, dst + op.dst_off + dof * op.dsize, fp8);
}

// GatherKernel's thread (block, thread) of a (grid_dim, block_dim) launch:
// a grid-stride walk of the plan's flat element index.
template <typename Fp8>
CKPTFS_HD inline void GatherThread(uint32_t block, uint32_t block_dim, uint32_t thread, uint32_t grid_dim,
                                   const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                   const DevOp* __restrict__ ops, int nops, uint64_t total, const Fp8& fp8) {
  const uint64_t stride = static_cast<uint64_t>(grid_dim) * block_dim;
  for (uint64_t e = static_cast<uint64_t>(block) * block_dim + thread; e < total; e += stride) {
    GatherElement(src, dst, ops, nops, e, fp8);
  }
}

// --- Mean of copies.

// Float arithmetic with the NaN results of x86 SSE/AVX (so of torch on the
// CPU), made explicit: IEEE leaves NaN payloads and signs open, and the GPU
// returns its canonical 0x7FFFFFFF where x86 propagates the operand's
// payload. A NaN operand propagates quieted, the first one when both are
// (torch computes acc + c_k); an invalid operation (inf - inf) gives x86's
// default NaN, sign set. Other results are IEEE round-to-nearest on host and
// device alike (no FMA, no flush to zero). Divisors here are positive counts.
CKPTFS_HD inline bool IsNanBits32(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
CKPTFS_HD inline bool IsNanBits64(uint64_t b) { return (b & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
CKPTFS_HD inline uint32_t AddF32(uint32_t a, uint32_t b) {
  if (IsNanBits32(a)) return a | 0x00400000u;
  if (IsNanBits32(b)) return b | 0x00400000u;
  const uint32_t r = FloatToBits(BitsToFloat(a) + BitsToFloat(b));
  return IsNanBits32(r) ? 0xFFC00000u : r;
}
CKPTFS_HD inline uint32_t DivF32(uint32_t a, float n) {
  if (IsNanBits32(a)) return a | 0x00400000u;
  return FloatToBits(BitsToFloat(a) / n);
}
CKPTFS_HD inline uint64_t AddF64(uint64_t a, uint64_t b) {
  if (IsNanBits64(a)) return a | 0x0008000000000000ull;
  if (IsNanBits64(b)) return b | 0x0008000000000000ull;
  const uint64_t r = DoubleToBits(BitsToDouble(a) + BitsToDouble(b));
  return IsNanBits64(r) ? 0xFFF8000000000000ull : r;
}
CKPTFS_HD inline uint64_t DivF64(uint64_t a, double n) {
  if (IsNanBits64(a)) return a | 0x0008000000000000ull;
  return DoubleToBits(BitsToDouble(a) / n);
}

// Element i of the mean of `copies` arrays laid out `copy_bytes` apart in
// `src`, as Python's sum(copies) / n computes it on torch tensors of dtype
// `dt`: ((0 + c_0) + c_1) + ... then / n, each step rounded to `dt` (for
// bf16/f16: computed in float32, rounded after every op), NaNs as x86 gives
// them (AddF32). The CPU backend and the CUDA kernel both call this, so their
// bytes cannot differ. Unaligned-safe.
CKPTFS_HD inline void MeanElement(const unsigned char* src, uint64_t copy_bytes, uint32_t copies, DType dt, uint64_t i,
                                  unsigned char* dst) {
  switch (dt) {
    case DType::kF32: {
      uint32_t acc = AddF32(0u, LoadLE32(src + i * 4));
      for (uint32_t k = 1; k < copies; ++k) acc = AddF32(acc, LoadLE32(src + k * copy_bytes + i * 4));
      StoreLE32(DivF32(acc, static_cast<float>(copies)), dst + i * 4);
      return;
    }
    case DType::kF64: {
      uint64_t acc = AddF64(0u, LoadLE64(src + i * 8));
      for (uint32_t k = 1; k < copies; ++k) acc = AddF64(acc, LoadLE64(src + k * copy_bytes + i * 8));
      StoreLE64(DivF64(acc, static_cast<double>(copies)), dst + i * 8);
      return;
    }
    case DType::kBF16:
    case DType::kF16: {
      const bool bf = dt == DType::kBF16;
      auto widen = [&](uint16_t h) { return bf ? BFloat16BitsToFloatBits(h) : HalfBitsToFloatBits(h); };
      auto round = [&](uint32_t f) { return bf ? FloatBitsToBFloat16Bits(f) : FloatBitsToHalfBits(f); };
      uint16_t acc = round(AddF32(0u, widen(LoadLE16(src + i * 2))));
      for (uint32_t k = 1; k < copies; ++k)
        acc = round(AddF32(widen(acc), widen(LoadLE16(src + k * copy_bytes + i * 2))));
      acc = round(DivF32(widen(acc), static_cast<float>(copies)));
      StoreLE16(acc, dst + i * 2);
      return;
    }
    default:
      return;  // callers check MeanSupported first
  }
}

// The mean launch: 256 threads a block, at most 65535 blocks, grid-stride.
inline Launch MeanLaunch(uint64_t numel) {
  uint64_t want = (numel + 255) / 256;
  if (want > 65535) want = 65535;
  return {static_cast<uint32_t>(want), 256};
}

// MeanKernel's thread: one output element at a time, grid-stride.
CKPTFS_HD inline void MeanThread(uint32_t block, uint32_t block_dim, uint32_t thread, uint32_t grid_dim,
                                 const unsigned char* __restrict__ src, uint64_t copy_bytes, uint32_t copies, DType dt,
                                 uint64_t numel, unsigned char* __restrict__ dst) {
  for (uint64_t i = static_cast<uint64_t>(block) * block_dim + thread; i < numel;
       i += static_cast<uint64_t>(grid_dim) * block_dim) {
    MeanElement(src, copy_bytes, copies, dt, i, dst);
  }
}

// --- CRC-32C in chunks.

// The device hashes a range in pieces of at most kCrcPiece bytes, each cut
// into kCrcChunk-byte chunks (the last may be shorter) hashed in parallel,
// one thread a chunk, and folds the chunk CRCs on the host in order.
constexpr uint64_t kCrcChunk = 16 << 10, kCrcPiece = 64ull << 20;

// Entry `i` of the byte-wise CRC-32C table.
CKPTFS_HD inline uint32_t Crc32cTableEntry(uint32_t i) {
  uint32_t c = i;
  for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
  return c;
}

inline Launch Crc32cLaunch(uint64_t nchunks) { return {static_cast<uint32_t>((nchunks + 127) / 128), 128}; }

// Phase 1 of Crc32cChunksKernel's thread: its share of the block's shared
// table (the kernel then synchronizes the block).
CKPTFS_HD inline void Crc32cFillTable(uint32_t thread, uint32_t block_dim, uint32_t* table) {
  for (uint32_t i = thread; i < 256; i += block_dim) table[i] = Crc32cTableEntry(i);
}

// Phase 2: the standard CRC-32C of chunk (block * block_dim + thread) of
// `data` into out[chunk]; threads past the last chunk do nothing.
CKPTFS_HD inline void Crc32cChunkThread(uint32_t block, uint32_t block_dim, uint32_t thread, const uint32_t* table,
                                        const unsigned char* data, uint64_t len, uint64_t chunk, uint32_t* out,
                                        uint64_t nchunks) {
  const uint64_t i = static_cast<uint64_t>(block) * block_dim + thread;
  if (i >= nchunks) return;
  const uint64_t b = i * chunk, rest = len - b, n = chunk < rest ? chunk : rest;
  uint32_t c = ~0u;
  const unsigned char* p = data + b;
  for (uint64_t k = 0; k < n; ++k) c = (c >> 8) ^ table[(c ^ p[k]) & 0xFF];
  out[i] = ~c;
}

// The CRC of (what `crc` covers) || (the `n` bytes whose kCrcChunk-byte
// chunks have the CRCs `chunks`): the host's fold after each piece.
// `full_op` is Crc32cShiftOp(kCrcChunk).
CKPTFS_HD inline uint32_t Crc32cFoldChunks(uint32_t crc, const uint32_t* chunks, uint64_t n, uint32_t full_op) {
  const uint64_t nchunks = (n + kCrcChunk - 1) / kCrcChunk;
  for (uint64_t k = 0; k < nchunks; ++k) {
    const uint64_t clen = n - k * kCrcChunk < kCrcChunk ? n - k * kCrcChunk : kCrcChunk;
    crc = clen == kCrcChunk ? Crc32cMulModP(full_op, crc) ^ chunks[k] : Crc32cCombine(crc, chunks[k], clen);
  }
  return crc;
}

}  // namespace kernels
}  // namespace ckptfs

#endif  // CKPTFS_IO_KERNELS_H_
