// The CPU transforms (the reference the CUDA ones are held to), the backend
// policy and its calibration.
#include "ckptfs/transforms.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/io.h"
#include "io/transform_internal.h"
#include "common/json_text.h"

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
    case TransformKind::kCopy: return "copy";
    case TransformKind::kTinyRuns: return "tiny-run gather";
    case TransformKind::kWiden: return "widen";
    case TransformKind::kCrc32c: return "crc32c";
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
    if (op.rank > kMaxGatherDims) return bad("rank " + std::to_string(op.rank) + " over " + std::to_string(kMaxGatherDims));
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

// --- CRC-32C on the CPU: SSE4.2's crc32 instruction where the CPU has it,
// else slicing-by-8 tables.
namespace {

struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

uint32_t Crc32cSoftware(uint32_t c, const unsigned char* p, uint64_t n) {
  static const Crc32cTables tb;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = tb.t[7][w & 0xFF] ^ tb.t[6][(w >> 8) & 0xFF] ^ tb.t[5][(w >> 16) & 0xFF] ^ tb.t[4][(w >> 24) & 0xFF] ^
        tb.t[3][(w >> 32) & 0xFF] ^ tb.t[2][(w >> 40) & 0xFF] ^ tb.t[1][(w >> 48) & 0xFF] ^ tb.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tb.t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t c, const unsigned char* p, uint64_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace

uint32_t Crc32cUpdate(uint32_t crc, const char* p, uint64_t n) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return ~Crc32cHardware(~crc, u, n);
#endif
  return ~Crc32cSoftware(~crc, u, n);
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
    case 2: return CopyRowsN<2>(s, sstep, d, dstep, rows);
    case 4: return CopyRowsN<4>(s, sstep, d, dstep, rows);
    case 8: return CopyRowsN<8>(s, sstep, d, dstep, rows);
    case 16: return CopyRowsN<16>(s, sstep, d, dstep, rows);
    case 32: return CopyRowsN<32>(s, sstep, d, dstep, rows);
    case 64: return CopyRowsN<64>(s, sstep, d, dstep, rows);
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

// Bit casts for MeanElement on the host.
struct HostBits {
  template <typename To, typename From>
  static To Cast(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To t;
    std::memcpy(&t, &v, sizeof(t));
    return t;
  }
  static float F32(uint32_t b) { return Cast<float>(b); }
  static double F64(uint64_t b) { return Cast<double>(b); }
  static uint32_t Bits(float f) { return Cast<uint32_t>(f); }
  static uint64_t Bits64(double f) { return Cast<uint64_t>(f); }
  static void U32(uint32_t v, unsigned char* p) {
    for (int k = 0; k < 4; ++k) p[k] = static_cast<unsigned char>(v >> (8 * k));
  }
};

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
    for (uint64_t i = 0; i < numel; ++i) MeanElement<HostBits, HostBits>(s, copy_bytes, copies, dt, i, d);
    return Status::Ok();
  }

  Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) override {
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].offset > len || ranges[i].length > len - ranges[i].offset) {
        return Internal("cannot hash range " + std::to_string(i) + ": outside the " + std::to_string(len) + "-byte buffer");
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
    case TransformKind::kCopy: return MakeMergePlan(DType::kF32, 4096, 2, out_bytes);
    case TransformKind::kTinyRuns: return MakeMergePlan(DType::kF32, 4, 8, out_bytes);
    default: return MakeMergePlan(DType::kBF16, 1 << 18, 1, out_bytes);  // 1 MiB output rows
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

double TimeCrc(Transforms& t, const SyntheticPlan& s, int reps) {
  double best = 1e30;
  ByteRange r{0, s.src.size()};
  uint32_t c = 0;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    Status st = t.Crc32c(s.src.data(), s.src.size(), std::span<const ByteRange>(&r, 1), &c);
    auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) return 1e30;
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
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
      if (kind == TransformKind::kCrc32c) {
        tc = TimeCrc(CpuTransforms(), s, 3);
        tg = TimeCrc(gpu, s, 3);
      } else {
        std::vector<char> dst(s.out_bytes);
        tc = TimeGather(CpuTransforms(), s, dst, 3);
        tg = TimeGather(gpu, s, dst, 3);
      }
      if (i == 3) {
        const double bytes = kind == TransformKind::kCrc32c ? static_cast<double>(s.src.size()) : static_cast<double>(s.out_bytes);
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

// --- Policy.
Result<std::unique_ptr<TransformPolicy>> TransformPolicy::Make(GpuMode mode, const std::string& cache_path,
                                                               const CudaOptions& cuda) {
  std::unique_ptr<TransformPolicy> p(new TransformPolicy());
  p->mode_ = mode;
  p->cache_path_ = cache_path;
  if (mode == GpuMode::kOff) return p;
  auto g = MakeCudaTransforms(cuda);
  if (!g.ok()) {
    if (mode == GpuMode::kOn) return g.status().Annotate("--gpu=on");
    p->mode_ = GpuMode::kOff;  // auto without a device: the CPU (the mount log says "transforms cpu")
    return p;
  }
  p->gpu_ = std::move(*g);
  return p;
}

void TransformPolicy::EnsureCalibrated() {
  std::call_once(calibrated_, [this] {
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
    cal_ = *c;
    for (int k = 0; k < kTransformKinds; ++k) {
      LogInfo(std::string("gpu calibration: ") + TransformKindName(static_cast<TransformKind>(k)) + " cpu " +
              std::to_string(cal_.cpu_gbps[k]) + " GB/s, gpu " + std::to_string(cal_.gpu_gbps[k]) +
              " GB/s, crossover " + (cal_.crossover[k] == Calibration::kNever ? std::string("never")
                                                                              : std::to_string(cal_.crossover[k])));
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
  if (mode_ == GpuMode::kOn) return *gpu_;
  // Below 1 MiB no calibration size applies: the CPU, without calibrating.
  if (out_bytes < (1ull << 20)) return CpuTransforms();
  EnsureCalibrated();
  return out_bytes >= cal_.crossover[static_cast<int>(k)] ? *gpu_ : CpuTransforms();
}

std::string TransformPolicy::Describe() const {
  switch (mode_) {
    case GpuMode::kOff: return "cpu";
    case GpuMode::kOn: return std::string("gpu (") + gpu_->name() + ")";
    case GpuMode::kAuto: return std::string("auto (") + gpu_->name() + " where calibrated faster)";
  }
  return "?";
}

}  // namespace ckptfs
