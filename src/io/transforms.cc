// The CPU transforms (the reference the CUDA ones are held to), the backend
// policy and its calibration.
#include "ckptfs/transforms.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "ckptfs/io.h"
#include "common/json_text.h"
#include "io/kernels.h"
#include "io/transform_internal.h"

namespace ckptfs {

uint64_t GatherOp::Elements() const {
  uint64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= static_cast<uint64_t>(len[d]);
  return n;
}

uint64_t GatherOp::SrcSpan() const {
  if (Elements() == 0) return 0;
  uint64_t last = 0;
  for (int d = 0; d < rank; ++d) last += static_cast<uint64_t>(len[d] - 1) * static_cast<uint64_t>(sstr[d]);
  return (last + 1) * DTypeSize(sdtype);
}

uint64_t GatherOp::DstSpan(DType out) const {
  if (Elements() == 0) return 0;
  uint64_t last = 0;
  for (int d = 0; d < rank; ++d) last += static_cast<uint64_t>(len[d] - 1) * static_cast<uint64_t>(dstr[d]);
  return (last + 1) * DTypeSize(out);
}

uint64_t GatherOp::RunElements() const {
  if (rank == 0) return 1;
  return sstr[rank - 1] == 1 && dstr[rank - 1] == 1 ? static_cast<uint64_t>(len[rank - 1]) : 1;
}

const char* TransformKindName(TransformKind k) {
  switch (k) {
    case TransformKind::kCopy:
      return "copy";
    case TransformKind::kTinyRuns:
      return "tiny-run gather";
    case TransformKind::kWiden:
      return "widen";
    case TransformKind::kCrc32c:
      return "crc32c";
  }
  return "?";
}

TransformKind ClassifyPlan(std::span<const GatherOp> ops, DType out) {
  uint64_t elements = 0, runs = 0;
  for (const GatherOp& op : ops) {
    if (op.sdtype != out) return TransformKind::kWiden;
    const uint64_t n = op.Elements();
    elements += n;
    if (n > 0) runs += n / op.RunElements();
  }
  if (runs == 0) return TransformKind::kCopy;
  return elements * DTypeSize(out) / runs < 256 ? TransformKind::kTinyRuns : TransformKind::kCopy;
}

Status ValidateOps(uint64_t src_len, std::span<const GatherOp> ops, DType out, uint64_t dst_len) {
  for (size_t i = 0; i < ops.size(); ++i) {
    const GatherOp& op = ops[i];
    auto bad = [&](const std::string& why) {
      return Internal("cannot run gather op " + std::to_string(i) + " of " + std::to_string(ops.size()) + ": " + why);
    };
    if (op.rank > kMaxGatherDims)
      return bad("rank " + std::to_string(op.rank) + " over " + std::to_string(kMaxGatherDims));
    if (!CanConvert(op.sdtype, out)) {
      return bad("no conversion from " + std::string(DTypeName(op.sdtype)) + " to " + std::string(DTypeName(out)));
    }
    for (int d = 0; d < op.rank; ++d) {
      if (op.len[d] < 0 || op.sstr[d] < 0 || op.dstr[d] < 0) return bad("negative length or stride");
    }
    if (op.Elements() == 0) continue;
    if (op.src_off > src_len || op.SrcSpan() > src_len - op.src_off) {
      return bad("source bytes [" + std::to_string(op.src_off) + ", +" + std::to_string(op.SrcSpan()) +
                 ") outside the " + std::to_string(src_len) + "-byte buffer");
    }
    if (op.dst_off > dst_len || op.DstSpan(out) > dst_len - op.dst_off) {
      return bad("output bytes [" + std::to_string(op.dst_off) + ", +" + std::to_string(op.DstSpan(out)) +
                 ") outside the " + std::to_string(dst_len) + "-byte buffer");
    }
  }
  return Status::Ok();
}

PlanExtent ExtentOf(std::span<const GatherOp> ops, DType out) {
  PlanExtent e;
  bool first = true;
  for (const GatherOp& op : ops) {
    const uint64_t n = op.Elements();
    if (n == 0) continue;
    const uint64_t s1 = op.src_off + op.SrcSpan(), d1 = op.dst_off + op.DstSpan(out);
    if (first) {
      e.src_lo = op.src_off, e.src_hi = s1, e.dst_lo = op.dst_off, e.dst_hi = d1;
      first = false;
    } else {
      e.src_lo = std::min(e.src_lo, op.src_off), e.src_hi = std::max(e.src_hi, s1);
      e.dst_lo = std::min(e.dst_lo, op.dst_off), e.dst_hi = std::max(e.dst_hi, d1);
    }
    e.elements += n;
    e.dst_bytes += n * DTypeSize(out);
  }
  return e;
}

uint32_t Crc32cConcat(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) { return Crc32cCombine(crc_a, crc_b, len_b); }

// --- The CPU backend.
namespace {

Status GatherRunCpu(const char* src, DType sd, int64_t sstride, char* dst, DType dd, int64_t dstride, uint64_t n) {
  if (dstride == 1) return ConvertRun(src, sd, sstride, dst, dd, n);
  const int64_t ss = static_cast<int64_t>(DTypeSize(sd)), ds = static_cast<int64_t>(DTypeSize(dd));
  for (uint64_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(ConvertRun(src + static_cast<int64_t>(i) * sstride * ss, sd, 1,
                               dst + static_cast<int64_t>(i) * dstride * ds, dd, 1));
  }
  return Status::Ok();
}

// `rows` rows of `n` bytes; fixed sizes compile to single moves (tiny-run
// gathers: a TP=8 merge of narrow shards is 16-byte rows).
template <size_t N>
void CopyRowsN(const char* s, int64_t sstep, char* d, int64_t dstep, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * dstep, s + r * sstep, N);
}

void CopyRows(const char* s, int64_t sstep, char* d, int64_t dstep, int64_t rows, size_t n) {
  switch (n) {
    case 2:
      return CopyRowsN<2>(s, sstep, d, dstep, rows);
    case 4:
      return CopyRowsN<4>(s, sstep, d, dstep, rows);
    case 8:
      return CopyRowsN<8>(s, sstep, d, dstep, rows);
    case 16:
      return CopyRowsN<16>(s, sstep, d, dstep, rows);
    case 32:
      return CopyRowsN<32>(s, sstep, d, dstep, rows);
    case 64:
      return CopyRowsN<64>(s, sstep, d, dstep, rows);
    default:
      for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * dstep, s + r * sstep, n);
  }
}

// One op. Same-dtype ops with contiguous rows copy the last two dims as rows;
// others convert the innermost dim as one run. The dims above walk as an
// odometer.
Status RunOpCpu(const char* src, const GatherOp& op, DType out, char* dst) {
  if (op.Elements() == 0) return Status::Ok();
  const int64_t ss = static_cast<int64_t>(DTypeSize(op.sdtype)), ds = static_cast<int64_t>(DTypeSize(out));
  const char* s0 = src + op.src_off;
  char* d0 = dst + op.dst_off;
  const int k = op.rank;
  if (k == 0) return ConvertRun(s0, op.sdtype, 1, d0, out, 1);
  const bool rows = op.sdtype == out && k >= 2 && op.sstr[k - 1] == 1 && op.dstr[k - 1] == 1;
  const int outer = rows ? k - 2 : k - 1;
  std::array<int64_t, kMaxGatherDims> idx{};
  while (true) {
    int64_t so = 0, dof = 0;
    for (int d = 0; d < outer; ++d) {
      so += idx[d] * op.sstr[d];
      dof += idx[d] * op.dstr[d];
    }
    if (rows) {
      CopyRows(s0 + so * ss, op.sstr[k - 2] * ss, d0 + dof * ds, op.dstr[k - 2] * ds, op.len[k - 2],
               static_cast<size_t>(op.len[k - 1] * ss));
    } else {
      RETURN_IF_ERROR(GatherRunCpu(s0 + so * ss, op.sdtype, op.sstr[k - 1], d0 + dof * ds, out, op.dstr[k - 1],
                                   static_cast<uint64_t>(op.len[k - 1])));
    }
    int d = outer;
    while (true) {
      if (d == 0) return Status::Ok();
      --d;
      if (++idx[d] < op.len[d]) break;
      idx[d] = 0;
    }
  }
}

class CpuBackend final : public Transforms {
 public:
  const char* name() const override { return "cpu"; }

  Status Gather(const char* src, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                uint64_t dst_len) override {
    RETURN_IF_ERROR(ValidateOps(src_len, ops, out, dst_len));
    for (const GatherOp& op : ops) RETURN_IF_ERROR(RunOpCpu(src, op, out, dst));
    return Status::Ok();
  }

  Status Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) override {
    RETURN_IF_ERROR(CheckMean(copies, dt));
    const uint64_t copy_bytes = numel * DTypeSize(dt);
    const auto* s = reinterpret_cast<const unsigned char*>(src);
    auto* d = reinterpret_cast<unsigned char*>(dst);
    for (uint64_t i = 0; i < numel; ++i) kernels::MeanElement(s, copy_bytes, copies, dt, i, d);
    return Status::Ok();
  }

  Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) override {
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].offset > len || ranges[i].length > len - ranges[i].offset) {
        return Internal("cannot hash range " + std::to_string(i) + ": outside the " + std::to_string(len) +
                        "-byte buffer");
      }
      out[i] = Crc32cUpdate(0, data + ranges[i].offset, ranges[i].length);
    }
    return Status::Ok();
  }

  // Synchronous: Submit runs the ops. Staging is per thread and per slot,
  // trimmed back after large reads so an idle thread keeps little.
  class CpuPipeline final : public Pipeline {
   public:
    explicit CpuPipeline(CpuBackend& b) : b_(b) {}
    ~CpuPipeline() override {
      for (auto& s : Slots()) {
        if (s.size() > kKeep) std::vector<char>().swap(s);
      }
    }
    Result<char*> Staging(int slot, uint64_t bytes) override {
      auto& s = Slots()[slot & 1];
      if (s.size() < bytes) s.resize(bytes);
      return s.data();
    }
    Status Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                  uint64_t dst_len) override {
      return b_.Gather(Slots()[slot & 1].data(), src_len, ops, out, dst, dst_len);
    }
    Status Wait(int) override { return Status::Ok(); }

   private:
    static constexpr uint64_t kKeep = 16ull << 20;
    static std::array<std::vector<char>, 2>& Slots() {
      thread_local std::array<std::vector<char>, 2> slots;
      return slots;
    }
    CpuBackend& b_;
  };

  Result<std::unique_ptr<Pipeline>> Begin() override { return std::unique_ptr<Pipeline>(new CpuPipeline(*this)); }
};

}  // namespace

Status CheckMean(uint32_t copies, DType dt) {
  if (copies == 0) return Internal("a mean of no copies");
  if (!MeanSupported(dt)) {
    return Unsupported(std::string("a mean of ") + std::string(DTypeName(dt)) + " copies (f32, f64, bf16, f16 only)");
  }
  return Status::Ok();
}

Transforms& CpuTransforms() {
  static CpuBackend cpu;
  return cpu;
}

Result<GpuMode> ParseGpuMode(std::string_view s) {
  if (s == "auto") return GpuMode::kAuto;
  if (s == "on") return GpuMode::kOn;
  if (s == "off") return GpuMode::kOff;
  return Invalid("unknown --gpu " + std::string(s) + " (auto, on, off)");
}

SyntheticPlan MakeMergePlan(DType sd, int64_t run, int64_t parts, uint64_t out_bytes) {
  SyntheticPlan p;
  const uint64_t ss = DTypeSize(sd);
  run = std::max<int64_t>(1, run);
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(out_bytes / 4) / (run * parts));
  p.src.resize(static_cast<size_t>(rows * run * parts) * ss);
  std::mt19937_64 rng(42);
  for (size_t i = 0; i < p.src.size(); i += 7) p.src[i] = static_cast<char>(rng());
  for (int64_t s = 0; s < parts; ++s) {
    GatherOp op;
    op.sdtype = sd;
    op.rank = 2;
    op.src_off = static_cast<uint64_t>(s * rows * run) * ss;
    op.dst_off = static_cast<uint64_t>(s * run) * 4;
    op.len[0] = rows, op.len[1] = run;
    op.sstr[0] = run, op.sstr[1] = 1;
    op.dstr[0] = run * parts, op.dstr[1] = 1;
    p.ops.push_back(op);
  }
  p.out_bytes = static_cast<uint64_t>(rows * run * parts) * 4;
  return p;
}

// --- Calibration: synthetic plans of each kind, timed on both backends with
// the transfers the GPU path really does (pageable source and output).
namespace {

// The plan calibration times for kind `k`: copy = TP=2 merge with 16 KiB
// rows; tiny runs = TP=8 merge with 16-byte rows; widen (and crc32c's bytes)
// = contiguous bf16 in 1 MiB output rows.
SyntheticPlan CalibrationPlan(TransformKind k, uint64_t out_bytes) {
  switch (k) {
    case TransformKind::kCopy:
      return MakeMergePlan(DType::kF32, 4096, 2, out_bytes);
    case TransformKind::kTinyRuns:
      return MakeMergePlan(DType::kF32, 4, 8, out_bytes);
    default:
      return MakeMergePlan(DType::kBF16, 1 << 18, 1, out_bytes);  // 1 MiB output rows
  }
}

double TimeGather(Transforms& t, const SyntheticPlan& s, std::vector<char>& dst, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    Status st = t.Gather(s.src.data(), s.src.size(), s.ops, DType::kF32, dst.data(), dst.size());
    auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) return 1e30;
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

double TimeCrc(Transforms& t, const SyntheticPlan& s, int reps, uint32_t* c) {
  double best = 1e30;
  ByteRange r{0, s.src.size()};
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    Status st = t.Crc32c(s.src.data(), s.src.size(), std::span<const ByteRange>(&r, 1), c);
    auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) return 1e30;
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// --- Comparing the GPU's bytes with the CPU's.

std::string HexByte(unsigned char c) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02x", c);
  return buf;
}

// Ok when `n` bytes of `cpu` and `gpu` are equal; else the difference, for
// the plan that `plan` describes.
Status SameBytes(const Transforms& gpu, const std::string& plan, const char* cpu, const char* got, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (cpu[i] != got[i]) {
      return Internal(std::string(gpu.name()) + " output differs from the cpu's on a " + plan +
                      ": first differing byte at offset " + std::to_string(i) + " (cpu " +
                      HexByte(static_cast<unsigned char>(cpu[i])) + ", gpu " +
                      HexByte(static_cast<unsigned char>(got[i])) + ")");
    }
  }
  return Status::Ok();
}

std::string DescribeGather(std::span<const GatherOp> ops, DType out, uint64_t out_bytes) {
  std::string from;
  for (const GatherOp& op : ops) {
    const std::string n(DTypeName(op.sdtype));
    if (from.find(n) == std::string::npos) from += (from.empty() ? "" : "+") + n;
  }
  return std::string(TransformKindName(ClassifyPlan(ops, out))) + " plan (" + from + " -> " +
         std::string(DTypeName(out)) + ", " + std::to_string(ops.size()) + " ops, " + std::to_string(out_bytes) +
         " bytes out)";
}

std::string DescribeCrc(uint64_t bytes) {
  return std::string(TransformKindName(TransformKind::kCrc32c)) + " plan (" + std::to_string(bytes) + " bytes)";
}

// Both backends render `ops` into equal prior contents; their bytes compared.
Status CompareGather(Transforms& gpu, const std::vector<char>& src, std::span<const GatherOp> ops, DType out,
                     uint64_t dst_len) {
  std::vector<char> cpu(dst_len), got(dst_len);
  for (uint64_t i = 0; i < dst_len; ++i) cpu[i] = got[i] = static_cast<char>(i * 131 + 7);
  RETURN_IF_ERROR(CpuTransforms().Gather(src.data(), src.size(), ops, out, cpu.data(), cpu.size()));
  const std::string plan = DescribeGather(ops, out, dst_len);
  Status s = gpu.Gather(src.data(), src.size(), ops, out, got.data(), got.size());
  if (!s.ok()) return s.Annotate(std::string("cannot run ") + gpu.name() + " on a " + plan);
  return SameBytes(gpu, plan, cpu.data(), got.data(), dst_len);
}

uint64_t Mix(uint64_t& x) {  // splitmix64: the check plans' bytes
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<char> MixedBytes(uint64_t n, uint64_t seed) {
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(Mix(seed));
  return v;
}

}  // namespace

Result<Calibration> Calibrate(Transforms& gpu) {
  Calibration c;
  c.device = gpu.name();
  const uint64_t sizes[] = {1ull << 20, 4ull << 20, 16ull << 20, 64ull << 20};
  for (int k = 0; k < kTransformKinds; ++k) {
    const auto kind = static_cast<TransformKind>(k);
    // Walk from the largest size down: the crossover is the smallest size
    // from which on the GPU stays at least 5% faster.
    uint64_t crossover = Calibration::kNever;
    for (int i = 3; i >= 0; --i) {
      SyntheticPlan s = CalibrationPlan(kind, sizes[i]);
      double tc, tg;
      Status same;
      if (kind == TransformKind::kCrc32c) {
        uint32_t cc = 0, cg = ~0u;
        tc = TimeCrc(CpuTransforms(), s, 3, &cc);
        tg = TimeCrc(gpu, s, 3, &cg);
        same = SameBytes(gpu, DescribeCrc(s.src.size()), reinterpret_cast<const char*>(&cc),
                         reinterpret_cast<const char*>(&cg), sizeof(cc));
      } else {
        std::vector<char> dc(s.out_bytes, 0), dg(s.out_bytes, 0);
        tc = TimeGather(CpuTransforms(), s, dc, 3);
        tg = TimeGather(gpu, s, dg, 3);
        same = SameBytes(gpu, DescribeGather(s.ops, DType::kF32, s.out_bytes), dc.data(), dg.data(), s.out_bytes);
      }
      if (tg < 1e30 && !same.ok()) {  // (a GPU error is a slow GPU, not a wrong one)
        c.mismatch = same.message();
        c.crossover.fill(Calibration::kNever);
        return c;
      }
      if (i == 3) {
        const double bytes =
            kind == TransformKind::kCrc32c ? static_cast<double>(s.src.size()) : static_cast<double>(s.out_bytes);
        c.cpu_gbps[k] = bytes / tc / 1e9;
        c.gpu_gbps[k] = bytes / tg / 1e9;
      }
      if (tg > 0.95 * tc) break;
      crossover = sizes[i];
    }
    c.crossover[k] = crossover;
  }
  return c;
}

Status CheckAgainstCpu(Transforms& gpu) {
  uint64_t seed = 0x636b707466730001ull;
  // Each calibration kind's plan, small.
  for (TransformKind k : {TransformKind::kCopy, TransformKind::kTinyRuns, TransformKind::kWiden}) {
    SyntheticPlan s = CalibrationPlan(k, (256ull << 10) + 4 * 37);
    RETURN_IF_ERROR(CompareGather(gpu, s.src, s.ops, DType::kF32, s.out_bytes));
  }
  // Every conversion the transforms support: a transposed 2-d box with odd
  // sides, a rank-0 element and a 1-d run, at unaligned offsets with holes
  // between them in the output.
  const DType sources[] = {DType::kBool,     DType::kU8,     DType::kI8,         DType::kI16,       DType::kU16,
                           DType::kI32,      DType::kU32,    DType::kI64,        DType::kU64,       DType::kF16,
                           DType::kBF16,     DType::kF32,    DType::kF64,        DType::kC64,       DType::kC128,
                           DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ};
  for (DType sd : sources) {
    std::vector<DType> outs = {sd};
    for (DType o : {DType::kF32, DType::kBF16, DType::kF16}) {
      if (o != sd && CanConvert(sd, o)) outs.push_back(o);
    }
    for (DType out : outs) {
      const int64_t ss = static_cast<int64_t>(DTypeSize(sd)), os = static_cast<int64_t>(DTypeSize(out));
      const int64_t rows = 37, cols = 13, run = 1001;
      std::vector<GatherOp> ops(3);
      ops[0].sdtype = sd, ops[0].rank = 2, ops[0].len[0] = rows, ops[0].len[1] = cols;
      ops[0].sstr[0] = 1, ops[0].sstr[1] = rows, ops[0].dstr[0] = cols, ops[0].dstr[1] = 1;  // column-major source
      ops[0].src_off = 3, ops[0].dst_off = 5;
      ops[1].sdtype = sd, ops[1].rank = 0;
      ops[1].src_off = static_cast<uint64_t>(3 + rows * cols * ss + 1);
      ops[1].dst_off = static_cast<uint64_t>(5 + (rows * cols + 3) * os);
      ops[2].sdtype = sd, ops[2].rank = 1, ops[2].len[0] = run, ops[2].sstr[0] = 1, ops[2].dstr[0] = 1;
      ops[2].src_off = ops[1].src_off + static_cast<uint64_t>(ss) + 7;
      ops[2].dst_off = ops[1].dst_off + static_cast<uint64_t>(os) + 1;
      const auto src = MixedBytes(ops[2].src_off + static_cast<uint64_t>(run * ss) + 5, Mix(seed));
      RETURN_IF_ERROR(CompareGather(gpu, src, ops, out, ops[2].dst_off + static_cast<uint64_t>(run * os) + 3));
    }
  }
  // A mean of replicas of each dtype, of arbitrary bit patterns (NaNs,
  // infinities, subnormals) and of ordinary values.
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    const uint32_t copies = 3;
    const uint64_t numel = 1001, esz = DTypeSize(dt);
    auto src = MixedBytes(copies * numel * esz, Mix(seed));
    for (uint64_t e = 0; e < copies * numel; e += 2) {  // every other element an ordinary value
      const float v = static_cast<float>(static_cast<int64_t>(Mix(seed) % 20001) - 10000) / 977.0f;
      const uint32_t fb = kernels::FloatToBits(v);
      if (dt == DType::kF32) {
        StoreLE<uint32_t>(src.data() + e * 4, fb);
      } else if (dt == DType::kF64) {
        StoreLE<uint64_t>(src.data() + e * 8, kernels::DoubleToBits(v));
      } else {
        StoreLE<uint16_t>(src.data() + e * 2,
                          dt == DType::kBF16 ? FloatBitsToBFloat16Bits(fb) : FloatBitsToHalfBits(fb));
      }
    }
    std::vector<char> cpu(numel * esz, 0), got(numel * esz, 0);
    RETURN_IF_ERROR(CpuTransforms().Mean(src.data(), copies, numel, dt, cpu.data()));
    const std::string plan = "mean plan (" + std::string(DTypeName(dt)) + ", " + std::to_string(copies) +
                             " copies of " + std::to_string(numel) + ")";
    Status s = gpu.Mean(src.data(), copies, numel, dt, got.data());
    if (!s.ok()) return s.Annotate(std::string("cannot run ") + gpu.name() + " on a " + plan);
    RETURN_IF_ERROR(SameBytes(gpu, plan, cpu.data(), got.data(), cpu.size()));
  }
  // CRC-32C of ranges around the device's 16 KiB chunks.
  const auto data = MixedBytes((200ull << 10) + 11, Mix(seed));
  const std::vector<ByteRange> ranges{{0, 0},          {1, 9}, {3, (16 << 10) - 1}, {5, 16 << 10}, {7, (16 << 10) + 1},
                                      {0, data.size()}};
  std::vector<uint32_t> cpu(ranges.size()), got(ranges.size(), 0);
  RETURN_IF_ERROR(CpuTransforms().Crc32c(data.data(), data.size(), ranges, cpu.data()));
  Status s = gpu.Crc32c(data.data(), data.size(), ranges, got.data());
  if (!s.ok()) return s.Annotate(std::string("cannot run ") + gpu.name() + " on a " + DescribeCrc(data.size()));
  for (size_t i = 0; i < ranges.size(); ++i) {
    RETURN_IF_ERROR(SameBytes(gpu, DescribeCrc(ranges[i].length), reinterpret_cast<const char*>(&cpu[i]),
                              reinterpret_cast<const char*>(&got[i]), 4));
  }
  return Status::Ok();
}

// --- Policy.
Result<std::unique_ptr<TransformPolicy>> TransformPolicy::Make(GpuMode mode, const std::string& cache_path,
                                                               const CudaOptions& cuda) {
  if (mode == GpuMode::kOff) return MakeWith(mode, nullptr, cache_path);
  auto g = MakeCudaTransforms(cuda);
  if (!g.ok()) {
    if (mode == GpuMode::kOn) return g.status().Annotate("--gpu=on");
    // auto without a device: the CPU (the mount log says "transforms cpu")
    return MakeWith(GpuMode::kOff, nullptr, cache_path);
  }
  return MakeWith(mode, std::move(*g), cache_path);
}

std::unique_ptr<TransformPolicy> TransformPolicy::MakeWith(GpuMode mode, std::unique_ptr<Transforms> gpu,
                                                           const std::string& cache_path) {
  std::unique_ptr<TransformPolicy> p(new TransformPolicy());
  p->mode_ = gpu == nullptr ? GpuMode::kOff : mode;
  p->cache_path_ = cache_path;
  if (p->mode_ != GpuMode::kOff) p->gpu_ = std::move(gpu);
  return p;
}

void TransformPolicy::Disable(const std::string& why) {
  disabled_reason_ = why;
  disabled_.store(true, std::memory_order_release);
  LogError("gpu transforms DISABLED for this mount, every transform runs on the cpu: " + why);
}

// Once, before the GPU's first plan: its bytes against the CPU's on the check
// plans, then (auto) the calibration, cached or measured, whose outputs are
// compared too. A cached calibration never skips the check: the cache says
// how fast this device was, not that this build's kernels are right on it.
void TransformPolicy::EnsureChecked() {
  std::call_once(checked_, [this] {
    Status ok = CheckAgainstCpu(*gpu_);
    if (!ok.ok()) {
      Disable(ok.message());
      return;
    }
    if (mode_ != GpuMode::kAuto) return;
    const std::string dev = gpu_->name();
    if (!cache_path_.empty()) {
      std::ifstream in(cache_path_);
      auto j = nlohmann::json::parse(in, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.value("device", "") == dev && j.contains("crossover") &&
          j["crossover"].is_array() && j["crossover"].size() == kTransformKinds) {
        cal_.device = dev;
        for (int k = 0; k < kTransformKinds; ++k) cal_.crossover[k] = j["crossover"][k].get<uint64_t>();
        LogInfo("gpu calibration loaded from " + cache_path_);
        return;
      }
    }
    auto c = Calibrate(*gpu_);
    if (!c.ok()) {
      LogWarn("gpu calibration failed, transforms stay on the CPU: " + c.status().message());
      return;  // every crossover stays kNever
    }
    if (!c->mismatch.empty()) {
      Disable("calibration: " + c->mismatch);
      return;  // nothing cached: the next mount checks again
    }
    cal_ = *c;
    for (int k = 0; k < kTransformKinds; ++k) {
      LogInfo(std::string("gpu calibration: ") + TransformKindName(static_cast<TransformKind>(k)) + " cpu " +
              std::to_string(cal_.cpu_gbps[k]) + " GB/s, gpu " + std::to_string(cal_.gpu_gbps[k]) +
              " GB/s, crossover " +
              (cal_.crossover[k] == Calibration::kNever ? std::string("never") : std::to_string(cal_.crossover[k])));
    }
    if (!cache_path_.empty()) {
      nlohmann::json j;
      j["device"] = dev;
      j["crossover"] = cal_.crossover;
      j["cpu_gbps"] = cal_.cpu_gbps;
      j["gpu_gbps"] = cal_.gpu_gbps;
      std::ofstream out(cache_path_ + ".tmp");
      out << JsonText(j, 2) << "\n";
      out.close();
      if (!out || std::rename((cache_path_ + ".tmp").c_str(), cache_path_.c_str()) != 0) {
        LogWarn("cannot write gpu calibration cache " + cache_path_ + " (measured again next mount)");
      }
    }
  });
}

Transforms& TransformPolicy::For(TransformKind k, uint64_t out_bytes) {
  if (mode_ == GpuMode::kOff || gpu_ == nullptr) return CpuTransforms();
  // auto: below 1 MiB no calibration size applies: the CPU, without checking.
  if (mode_ == GpuMode::kAuto && out_bytes < (1ull << 20)) return CpuTransforms();
  EnsureChecked();
  if (gpu_disabled()) return CpuTransforms();
  if (mode_ == GpuMode::kOn) return *gpu_;
  return out_bytes >= cal_.crossover[static_cast<int>(k)] ? *gpu_ : CpuTransforms();
}

std::string TransformPolicy::Describe() const {
  if (gpu_disabled()) return std::string("cpu (") + gpu_->name() + " disabled: its output differed from the cpu's)";
  switch (mode_) {
    case GpuMode::kOff:
      return "cpu";
    case GpuMode::kOn:
      return std::string("gpu (") + gpu_->name() + ")";
    case GpuMode::kAuto:
      return std::string("auto (") + gpu_->name() + " where calibrated faster)";
  }
  return "?";
}

}  // namespace ckptfs
