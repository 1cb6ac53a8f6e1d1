// io layer: element transforms of a read plan, on the CPU or the GPU.
//
// Design note. A read plan (see io.h) is a set of source byte spans read into
// a staging buffer plus a list of GatherOps, each a strided N-d copy from the
// staging buffer into the output with an optional widening cast. Everything
// the views need is expressed as ops: TP merges along any dim, row-parallel
// interleave and SwiGLU regrouping are N-d boxes; a ZeRO flat partition with
// its alignment padding is a set of 1-d runs that skip the padding, across
// partition boundaries. Two backends run the same ops and must produce the
// same bytes (tests/unit/io/transforms_conformance_test.cc holds them to it):
//  * CPU (always): the reference, single-threaded per request.
//  * CUDA (built when nvcc is found; used when a device is present): pinned
//    staging, one kernel launch per pipeline chunk (>= 4 MiB of plan when the
//    read is that large), H2D of chunk i+1's staging overlaps the kernel and
//    D2H of chunk i, and the I/O of chunk i+2 overlaps both (two slots).
//    Device buffers and the CUDA context are released after `idle_ms` without
//    use, so an idle mount holds no GPU memory.
// The policy (`--gpu=auto|on|off`) picks a backend per read: `auto` uses the
// GPU only for plans at least as large as the crossover that a calibration
// measured for the plan's kind (cached per device), `on` for every plan that
// has transform work, `off` never. The GPU is trusted only after it has
// matched the CPU: before its first plan (`auto` and `on`) the policy runs
// both backends on check plans of every kind and compares the bytes, and
// calibration compares every output it times; on any difference the GPU is
// disabled for the mount, with an error log line naming the plan's kind and
// the first differing byte.
#ifndef CKPTFS_TRANSFORMS_H_
#define CKPTFS_TRANSFORMS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs {

// Dims of one op after coalescing; plans with more stay on the CPU.
constexpr int kMaxGatherDims = 8;

// dst[dst_off + sum(i_d * dstr_d) * out_size] =
//   convert(src[src_off + sum(i_d * sstr_d) * src_size]) for every index i.
// Strides are in elements and non-negative; rank 0 is one element.
struct GatherOp {
  uint64_t src_off = 0;
  uint64_t dst_off = 0;
  DType sdtype = DType::kInvalid;
  uint8_t rank = 0;
  std::array<int64_t, kMaxGatherDims> len{}, sstr{}, dstr{};

  uint64_t Elements() const;
  // Bytes from src_off to one past the last element read / written.
  uint64_t SrcSpan() const;
  uint64_t DstSpan(DType out) const;
  // Elements per contiguous output run (the innermost dim when both strides
  // are 1, else 1): what separates a memcpy-like plan from a tiny-run gather.
  uint64_t RunElements() const;
};

struct ByteRange {
  uint64_t offset = 0, length = 0;
};

// What a plan mostly does; calibration measures each kind separately. kWiden
// is any element conversion (widening, or narrowing float32 to bf16 / f16).
enum class TransformKind : uint8_t { kCopy = 0, kTinyRuns = 1, kWiden = 2, kCrc32c = 3 };
constexpr int kTransformKinds = 4;
const char* TransformKindName(TransformKind k);
// The kind of a plan of `ops` rendering `out`: widen if any op converts,
// tiny runs if the mean output run is under 256 bytes, else copy.
TransformKind ClassifyPlan(std::span<const GatherOp> ops, DType out);

class Transforms {
 public:
  virtual ~Transforms() = default;
  virtual const char* name() const = 0;

  // Runs every op. Ops must not overlap in the output; bytes of `dst` no op
  // writes are left as they were. Every op is bounds-checked against src_len
  // and dst_len first (an error, nothing written).
  virtual Status Gather(const char* src, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                        uint64_t dst_len) = 0;
  // dst[i] = mean over the `copies` arrays of `numel` elements of `dt` laid
  // out back to back in `src` (copy k at k * numel * size), computed as
  // Python's sum(copies) / n on torch tensors: ((0 + c_0) + c_1) + ... then
  // / n, rounded to `dt` after every step. f32, f64, bf16 and f16; another
  // dtype is an error. (DeepSpeed's parameter_to_average_patterns.)
  virtual Status Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) = 0;
  // CRC-32C (Castagnoli, as iSCSI, ext4, GCS and S3 use) of each range.
  virtual Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) = 0;

  // A two-slot pipeline for one reader thread. The I/O reads into
  // Staging(slot); Submit starts the slot's ops (it may return before they
  // finish) and Wait(slot) finishes them: only then is the output in `dst` and
  // the slot's staging free for the next chunk. The destructor waits.
  class Pipeline {
   public:
    virtual ~Pipeline() = default;
    virtual Result<char*> Staging(int slot, uint64_t bytes) = 0;
    virtual Status Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                          uint64_t dst_len) = 0;
    virtual Status Wait(int slot) = 0;
    // Device pipelines only (BeginDevice): dst[i] = the mean of the `copies`
    // staged arrays of `numel` elements of `dt` (copy k at k * numel * size
    // in the slot's staging; Mean's arithmetic), rendered as `out` into the
    // device memory `dst`. Wait(slot) finishes it.
    virtual Status SubmitMean(int slot, uint32_t copies, uint64_t numel, DType dt, DType out, char* dst) {
      (void)slot, (void)copies, (void)numel, (void)dt, (void)out, (void)dst;
      return Unsupported("a mean into device memory needs a device pipeline");
    }
  };
  virtual Result<std::unique_ptr<Pipeline>> Begin() = 0;

  // Device-resident output (the Python package's device= reads). A pipeline
  // whose Submit's `dst` is memory of this backend's device (a CUDA pointer):
  // the source spans staged on the host go up once, the kernels write the
  // ops' output straight into `dst`, and nothing comes back to the host;
  // bytes of `dst` no op writes keep their values. `after` is the caller's
  // cudaStream_t (null: the legacy default stream, torch's default): the
  // first upload waits for the work queued on it (whatever last used the
  // memory of `dst`), and Wait returns once the bytes are in place. The
  // pipeline runs in the calling thread and gives it back its current device
  // when it ends. Unsupported on the CPU.
  virtual Result<std::unique_ptr<Pipeline>> BeginDevice(void* after) {
    (void)after;
    return Unsupported(std::string(name()) + " has no device memory");
  }
  // `n` host bytes into device memory at `dst` after the work queued on the
  // caller's stream `after` (as BeginDevice): the host-path fallback of a
  // device read; synchronous.
  virtual Status Upload(const char* host, uint64_t n, char* dst, void* after) {
    (void)host, (void)n, (void)dst, (void)after;
    return Unsupported(std::string(name()) + " has no device memory");
  }
  // The device's ordinal; -1 for the CPU.
  virtual int device() const { return -1; }

  // Device and pinned host bytes held right now (0 for the CPU, and for the
  // GPU once it has been idle for CudaOptions::idle_ms).
  virtual uint64_t HeldBytes() const { return 0; }
};

// `n` float32 values x (little-endian, at `f32`) as x * scale + add in
// `out` (float32, bfloat16 or float16): each computed in double, rounded once
// to `out`, to nearest even. hf/'s scaled tensors (MaxText's query kernels,
// Gemma's embedding and norms).
Status ScaleFloats(const char* f32, uint64_t n, double scale, double add, DType out, char* dst);

// CRC-32C of A||B from the CRC-32Cs of A and B and B's length.
uint32_t Crc32cConcat(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Always available; stateless apart from per-thread staging.
Transforms& CpuTransforms();

struct CudaOptions {
  int device = 0;                     // CUDA device ordinal (0)
  uint64_t idle_ms = 2000;            // buffers and context released after this long unused (2000)
  uint64_t slot_bytes = 64ull << 20;  // pinned staging per slot; a chunk's source spans fit in it (64 MiB)
  // After idle_ms, also reset the device (cudaDeviceReset: the context goes
  // too). Only for a process whose sole CUDA user is ckptfs (the mount); the
  // Python package shares its process's primary context with torch, whose
  // tensors a reset would destroy, so there only the buffers are freed (true).
  bool reset_when_idle = true;
};
// Unsupported when built without CUDA, or when no device can be used (the
// reason from the CUDA runtime is in the message).
Result<std::unique_ptr<Transforms>> MakeCudaTransforms(const CudaOptions& opts = {});
// True when this build has the CUDA backend compiled in.
bool CudaCompiledIn();
// Device memory of CUDA device `device` (cudaMalloc; freed with the last
// reference) and its bytes copied back: what the tests and benches of
// device-resident output compare. Unsupported without CUDA or a device.
Result<std::shared_ptr<char>> AllocDeviceBytes(int device, uint64_t n);
Status DownloadDeviceBytes(int device, const char* src, uint64_t n, char* host);

enum class GpuMode : uint8_t { kAuto, kOn, kOff };
Result<GpuMode> ParseGpuMode(std::string_view s);

// Per kind, the smallest plan (output bytes) at which the GPU was measured
// faster than one CPU core, transfers included; kNever where it never was.
struct Calibration {
  static constexpr uint64_t kNever = ~0ull;
  std::string device;  // the device it was measured on
  std::array<uint64_t, kTransformKinds> crossover{kNever, kNever, kNever, kNever};
  std::array<double, kTransformKinds> cpu_gbps{}, gpu_gbps{};  // at the largest size measured
  // Empty when every output the GPU produced equalled the CPU's bytes; else
  // the first difference (kind, plan, byte offset, both bytes), every
  // crossover is kNever and the GPU must not be used.
  std::string mismatch;
};
// A synthetic plan for calibration and bench/transform_bench: `parts` shards
// of `run` elements per row (dtype `sd`, pseudo-random bytes) merged along
// dim 1 into float32, about `out_bytes` of output. parts = 2, run = 4096 f32
// is a TP=2 merge with long rows; parts = 8, run = 4 a tiny-run merge;
// parts = 1 with bf16 a plain widen (rows then only cut it into pieces).
struct SyntheticPlan {
  std::vector<char> src;
  std::vector<GatherOp> ops;
  uint64_t out_bytes = 0;  // output is float32
};
SyntheticPlan MakeMergePlan(DType sd, int64_t run, int64_t parts, uint64_t out_bytes);

// Times `gpu` against the CPU backend on synthetic plans of each kind (1 to
// 64 MiB) and returns the crossovers (a few hundred ms). Every output `gpu`
// produces is compared with the CPU's; the first difference stops the
// calibration and is reported in `mismatch`.
Result<Calibration> Calibrate(Transforms& gpu);

// Runs `gpu` and the CPU backend on small check plans of every kind (each
// supported conversion, odd sizes, unaligned offsets, tiny runs, holes in the
// output, a mean of replicas of each dtype, CRC-32C of odd ranges) and
// compares the outputs byte for byte. Ok when all are equal; else an error
// naming the first difference: "<backend> output differs from the cpu's on a
// <kind> plan (...): first differing byte at offset N (cpu 0x.., gpu 0x..)".
// A few milliseconds, plus the device's start.
Status CheckAgainstCpu(Transforms& gpu);

// Chooses a backend per plan. `auto` calibrates on the first plan that could
// use the GPU, or loads the result cached at `cache_path` for this device.
class TransformPolicy {
 public:
  // `on` without a usable device is an error naming the reason.
  static Result<std::unique_ptr<TransformPolicy>> Make(GpuMode mode, const std::string& cache_path,
                                                       const CudaOptions& cuda = {});
  // The same with `gpu` as the GPU backend (tests: a fake one); kOff ignores it.
  static std::unique_ptr<TransformPolicy> MakeWith(GpuMode mode, std::unique_ptr<Transforms> gpu,
                                                   const std::string& cache_path);
  // The backend for a plan of `out_bytes` output bytes of kind `k`. The first
  // call that could pick the GPU checks it against the CPU (CheckAgainstCpu)
  // and, under `auto`, calibrates; a GPU that differed is never picked.
  Transforms& For(TransformKind k, uint64_t out_bytes);
  GpuMode mode() const { return mode_; }
  std::string Describe() const;
  Transforms* gpu() const { return gpu_.get(); }
  // True once the GPU's output differed from the CPU's: every plan runs on
  // the CPU for the rest of the mount. `disabled_reason` says what differed.
  bool gpu_disabled() const { return disabled_.load(std::memory_order_acquire); }
  std::string disabled_reason() const { return gpu_disabled() ? disabled_reason_ : std::string(); }

 private:
  TransformPolicy() = default;
  void EnsureChecked();
  void Disable(const std::string& why);

  GpuMode mode_ = GpuMode::kOff;
  std::string cache_path_;
  std::unique_ptr<Transforms> gpu_;
  std::once_flag checked_;
  Calibration cal_;
  std::string disabled_reason_;  // written once, before disabled_ is set
  std::atomic<bool> disabled_{false};
};

}  // namespace ckptfs

#endif  // CKPTFS_TRANSFORMS_H_
