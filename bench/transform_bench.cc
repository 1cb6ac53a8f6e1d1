// Transforms benchmark: per transform and plan size, one CPU core against the
// GPU with its transfers, and what `--gpu=auto` picks.
//
// Plans (output bytes 1 MiB .. 256 MiB):
//   copy         two float32 shards merged along dim 1, 16 KiB rows (a TP=2 merge)
//   tiny-runs    eight float32 shards merged along dim 1, 16-byte rows (TP=8, narrow)
//   widen        contiguous bf16 -> float32 (1 MiB output rows; the pipeline cuts by rows)
//   widen+merge  four bf16 shards merged along dim 1 (row-parallel), -> float32
//   zero-strip   bf16 params cut out of 8 padded ZeRO partitions, -> float32
//   crc32c       CRC-32C of the bytes
// copy, tiny-runs and widen are the plans calibration times (MakeMergePlan).
// Columns: cpu = CpuTransforms().Gather (one core); gpu = Gather from pageable
// memory (H2D + kernel + D2H + copy out); pipe = the read engine's two-slot
// pipeline (source already in pinned staging, as the io_uring reads leave it;
// H2D, kernel, D2H and the copy to the caller's buffer included, chunks of
// 16 MiB of output); dev = the same pipeline writing into device memory
// (BeginDevice: the Python package's device= reads; H2D and kernel, no D2H);
// auto = the backend the calibrated policy picks, and its
// time over cpu's (target: at most 1.05). Every GPU output is compared with
// the CPU's bytes. Best of 3 runs. Writes the table to stdout and JSON to
// argv[1] when given.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "ckptfs/transforms.h"

using namespace ckptfs;

namespace {

struct Plan {
  std::string name;
  TransformKind kind;
  std::vector<char> src;
  std::vector<GatherOp> ops;
  DType out = DType::kF32;
  uint64_t out_bytes = 0;
  bool crc = false;
};

Plan Merge(const std::string& name, TransformKind kind, DType sd, int64_t run, int64_t parts, uint64_t out_bytes) {
  SyntheticPlan sp = MakeMergePlan(sd, run, parts, out_bytes);
  return Plan{name, kind, std::move(sp.src), std::move(sp.ops), DType::kF32, sp.out_bytes, false};
}

// Parameters of random sizes flattened, padded, cut into 8 partitions stored
// 4 KiB apart; each parameter's runs skip the partition boundaries.
Plan ZeroStrip(uint64_t out_bytes, std::mt19937_64& rng) {
  Plan p{"zero-strip", TransformKind::kWiden, {}, {}, DType::kF32, 0, false};
  const uint64_t total = out_bytes / 4, dp = 8, part = (total + dp * 2 - 1) / (dp * 2) * 2 + 2;
  p.src.resize((part * 2 + 4096) * dp);
  uint64_t start = 0, dst = 0;
  while (start < total) {
    const uint64_t n = std::min<uint64_t>(total - start, 1 + rng() % (4ull << 20));
    for (uint64_t e = start; e < start + n;) {
      const uint64_t q = e / part, in = e % part, run = std::min(start + n - e, part - in);
      GatherOp op;
      op.sdtype = DType::kBF16;
      op.rank = 1;
      op.len[0] = static_cast<int64_t>(run), op.sstr[0] = 1, op.dstr[0] = 1;
      op.src_off = q * (part * 2 + 4096) + in * 2;
      op.dst_off = dst;
      p.ops.push_back(op);
      dst += run * 4;
      e += run;
    }
    start += n;
  }
  p.out_bytes = total * 4;
  return p;
}

double Best(const std::function<bool()>& f, int reps = 3) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    if (!f()) return -1;
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// The read engine's use: 16 MiB output chunks through two slots.
bool RunPipeline(Transforms& t, const Plan& p, char* dst, uint64_t dst_len, bool device) {
  auto pipe = device ? t.BeginDevice(nullptr) : t.Begin();
  if (!pipe.ok()) return false;
  // Chunks of 16 MiB of output, as the read engine plans them: each op cut
  // to the rows (rank 2) or elements (rank 1) whose output lies in the chunk.
  constexpr uint64_t kChunk = 16ull << 20;
  std::vector<std::vector<GatherOp>> chunks;
  for (uint64_t o0 = 0; o0 < p.out_bytes; o0 += kChunk) {
    const uint64_t o1 = std::min(p.out_bytes, o0 + kChunk);
    chunks.emplace_back();
    for (const GatherOp& op : p.ops) {
      const uint64_t ss = DTypeSize(op.sdtype);
      GatherOp sub = op;
      if (op.rank == 1) {
        const uint64_t a = std::max(o0, op.dst_off), b = std::min(o1, op.dst_off + op.Elements() * 4);
        if (a >= b) continue;
        sub.len[0] = static_cast<int64_t>((b - a) / 4);
        sub.src_off += (a - op.dst_off) / 4 * ss;
        sub.dst_off = a;
      } else {
        const uint64_t row = static_cast<uint64_t>(op.dstr[0]) * 4;
        const uint64_t r0 = (o0 + row - 1) / row,
                       r1 = std::min<uint64_t>(static_cast<uint64_t>(op.len[0]), (o1 + row - 1) / row);
        if (r0 >= r1) continue;
        sub.len[0] = static_cast<int64_t>(r1 - r0);
        sub.src_off += r0 * static_cast<uint64_t>(op.sstr[0]) * ss;
        sub.dst_off += r0 * row;
      }
      chunks.back().push_back(sub);
    }
  }
  bool pending[2] = {false, false};
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int slot = static_cast<int>(c & 1);
    if (pending[slot] && !(*pipe)->Wait(slot).ok()) return false;
    uint64_t lo = ~0ull, hi = 0;
    for (const GatherOp& op : chunks[c]) lo = std::min(lo, op.src_off), hi = std::max(hi, op.src_off + op.SrcSpan());
    auto st = (*pipe)->Staging(slot, hi - lo);
    if (!st.ok()) return false;
    std::vector<GatherOp> ops = chunks[c];
    for (GatherOp& op : ops) op.src_off -= lo;  // the staging holds [lo, hi), filled by the I/O in real reads
    if (!(*pipe)->Submit(slot, hi - lo, ops, p.out, dst, dst_len).ok()) return false;
    pending[slot] = true;
  }
  for (int s = 0; s < 2; ++s) {
    if (pending[s] && !(*pipe)->Wait(s).ok()) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937_64 rng(1);
  auto gpu_or = MakeCudaTransforms();
  Transforms* gpu = gpu_or.ok() ? gpu_or->get() : nullptr;
  std::printf("cpu: one core of this machine; gpu: %s\n", gpu ? gpu->name() : gpu_or.status().message().c_str());
  std::unique_ptr<TransformPolicy> policy;
  nlohmann::json out;
  out["gpu"] = gpu ? gpu->name() : "none: " + gpu_or.status().message();
  if (gpu) {
    auto cal = Calibrate(*gpu);
    if (cal.ok() && !cal->mismatch.empty()) {
      std::printf("GPU OUTPUT DIFFERS FROM THE CPU'S (auto would disable the GPU): %s\n", cal->mismatch.c_str());
      out["mismatch"] = cal->mismatch;
    }
    if (cal.ok()) {
      std::printf("calibration crossovers (output bytes from which auto uses the GPU):\n");
      for (int k = 0; k < kTransformKinds; ++k) {
        const uint64_t c = cal->crossover[k];
        std::printf("  %-16s %s\n", TransformKindName(static_cast<TransformKind>(k)),
                    c == Calibration::kNever ? "never" : (std::to_string(c >> 20) + " MiB").c_str());
        out["crossover"][TransformKindName(static_cast<TransformKind>(k))] = c;
      }
    }
    auto p = TransformPolicy::Make(GpuMode::kAuto, "");
    if (p.ok()) policy = std::move(*p);
  }
  std::printf("\n%-12s %9s %10s %10s %10s %10s %-6s %8s\n", "plan", "out MiB", "cpu GB/s", "gpu GB/s", "pipe GB/s",
              "dev GB/s", "auto", "auto/cpu");
  int bad = 0;
  for (uint64_t mib : {1, 4, 16, 64, 256}) {
    const uint64_t bytes = mib << 20;
    std::vector<Plan> plans;
    plans.push_back(Merge("copy", TransformKind::kCopy, DType::kF32, 4096, 2, bytes));
    plans.push_back(Merge("tiny-runs", TransformKind::kTinyRuns, DType::kF32, 4, 8, bytes));
    plans.push_back(Merge("widen", TransformKind::kWiden, DType::kBF16, 1 << 18, 1, bytes));
    plans.push_back(Merge("widen+merge", TransformKind::kWiden, DType::kBF16, 1024, 4, bytes));
    plans.push_back(ZeroStrip(bytes, rng));
    Plan crc{"crc32c", TransformKind::kCrc32c, std::vector<char>(bytes), {}, DType::kU8, bytes, true};
    plans.push_back(std::move(crc));
    for (Plan& p : plans) {
      for (size_t i = 0; i < p.src.size(); i += 7) p.src[i] = static_cast<char>(rng());
      std::vector<char> ref(p.out_bytes), got(p.out_bytes);
      const ByteRange whole{0, p.src.size()};
      uint32_t c0 = 0, c1 = 0;
      auto run = [&](Transforms& t, std::vector<char>& dst, uint32_t* crc) {
        if (p.crc) return t.Crc32c(p.src.data(), p.src.size(), std::span<const ByteRange>(&whole, 1), crc).ok();
        return t.Gather(p.src.data(), p.src.size(), p.ops, p.out, dst.data(), dst.size()).ok();
      };
      const double tc = Best([&] { return run(CpuTransforms(), ref, &c0); });
      double tg = -1, tp = -1, td = -1, ta = tc;
      std::string auto_name = "cpu";
      if (gpu) {
        tg = Best([&] { return run(*gpu, got, &c1); });
        if (p.crc ? c1 != c0 : got != ref) {
          std::printf("MISMATCH: %s %llu MiB on the GPU\n", p.name.c_str(), static_cast<unsigned long long>(mib));
          ++bad;
        }
        if (!p.crc) {
          std::fill(got.begin(), got.end(), 0);
          tp = Best([&] { return RunPipeline(*gpu, p, got.data(), got.size(), false); });
          if (got != ref) {
            std::printf("MISMATCH: %s %llu MiB through the pipeline\n", p.name.c_str(),
                        static_cast<unsigned long long>(mib));
            ++bad;
          }
          auto mem = AllocDeviceBytes(gpu->device(), p.out_bytes);
          if (mem.ok()) {
            td = Best([&] { return RunPipeline(*gpu, p, mem->get(), p.out_bytes, true); });
            std::fill(got.begin(), got.end(), 0);
            if (td < 0 || !DownloadDeviceBytes(gpu->device(), mem->get(), p.out_bytes, got.data()).ok() || got != ref) {
              std::printf("MISMATCH: %s %llu MiB into device memory\n", p.name.c_str(),
                          static_cast<unsigned long long>(mib));
              ++bad;
            }
          }
        }
        if (policy) {
          Transforms& t = policy->For(p.kind, p.out_bytes);
          auto_name = &t == &CpuTransforms() ? "cpu" : "gpu";
          ta = Best([&] { return run(t, got, &c1); });
        }
      }
      auto gbps = [&](double t) { return t > 0 ? static_cast<double>(p.out_bytes) / t / 1e9 : 0.0; };
      auto col = [&](double t) { return t > 0 ? std::to_string(gbps(t)).substr(0, 6) : std::string("-"); };
      std::printf("%-12s %9llu %10.2f %10s %10s %10s %-6s %8.2f\n", p.name.c_str(),
                  static_cast<unsigned long long>(mib), gbps(tc), col(tg).c_str(), col(tp).c_str(), col(td).c_str(),
                  auto_name.c_str(), ta / tc);
      out["rows"].push_back({{"plan", p.name},
                             {"out_mib", mib},
                             {"cpu_gbps", gbps(tc)},
                             {"gpu_gbps", gbps(tg)},
                             {"pipeline_gbps", gbps(tp)},
                             {"device_out_gbps", gbps(td)},
                             {"auto", auto_name},
                             {"auto_over_cpu", ta / tc}});
    }
  }
  if (!gpu) std::printf("\nGPU figures pending: no CUDA device on this machine.\n");
  if (argc > 1) std::ofstream(argv[1]) << out.dump(2) << "\n";
  return bad ? 1 : 0;
}
