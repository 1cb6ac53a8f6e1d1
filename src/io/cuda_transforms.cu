// The CUDA transforms: the same ops as the CPU backend, the same bytes.
//
// One kernel covers a whole pipeline chunk: every thread walks a grid-stride
// range of the chunk's flat element index, finds its op by binary search over
// the ops' element prefix sums, decomposes the op-local index (32-bit
// arithmetic when the op has fewer than 2^32 elements) and converts one
// element with the functions the CPU uses (common/float_bits.h, the fp8 tables
// of convert.cc copied to constant memory). Consecutive threads take
// consecutive elements, so contiguous runs load and store coalesced. What a
// thread does is written once, in io/kernels.h, as host-and-device functions
// the kernels here only call: the unit tests run those same functions on the
// CPU through an emulated launch grid against the CPU backend.
//
// Resources live in lanes (a stream, events, pinned staging and device
// buffers per slot); a reader takes a lane for one read and gives it back. A
// reaper thread frees every lane once nothing used it for `idle_ms`, and in
// the mount (CudaOptions::reset_when_idle) resets the device too, so an idle
// mount holds no GPU memory, not even a context.
//
// Device-resident output (BeginDevice): the same kernels write into the
// caller's device buffer; only the staged source spans and the ops go up,
// nothing comes down. The caller's stream is waited on before the first
// upload, so a buffer torch has just allocated (or reused) is not written
// before the work queued before it.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "ckptfs/transforms.h"
#include "io/kernels.h"
#include "io/transform_internal.h"

namespace ckptfs {
namespace {

#define CKPTFS_CUDA(call)                                                                                      \
  do {                                                                                                         \
    const cudaError_t err_ = (call);                                                                           \
    if (err_ != cudaSuccess) return Internal(std::string("cuda: ") + #call + ": " + cudaGetErrorString(err_)); \
  } while (0)

using kernels::DevOp;
using kernels::kFp8Kinds;

__constant__ float c_fp8[kFp8Kinds][256];

// The fp8 tables in constant memory, as kernels::ConvertElement reads them.
struct ConstantFp8 {
  __device__ uint32_t operator()(int table, unsigned char b) const { return __float_as_uint(c_fp8[table][b]); }
};

// The kernels are wrappers: the launch coordinates in, the shared body
// (kernels.h, which the unit tests run on the CPU through an emulated grid)
// does the rest.
__global__ void GatherKernel(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                             const DevOp* __restrict__ ops, int nops, uint64_t total) {
  kernels::GatherThread(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, src, dst, ops, nops, total, ConstantFp8{});
}

__global__ void MeanKernel(const unsigned char* __restrict__ src, uint64_t copy_bytes, uint32_t copies, DType dt,
                           uint64_t numel, unsigned char* __restrict__ dst) {
  kernels::MeanThread(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, src, copy_bytes, copies, dt, numel, dst);
}

// Standard CRC-32C of each `chunk`-byte piece (the last may be shorter).
__global__ void Crc32cChunksKernel(const unsigned char* __restrict__ data, uint64_t len, uint64_t chunk,
                                   uint32_t* __restrict__ out, uint64_t nchunks) {
  __shared__ uint32_t table[256];
  kernels::Crc32cFillTable(threadIdx.x, blockDim.x, table);
  __syncthreads();
  kernels::Crc32cChunkThread(blockIdx.x, blockDim.x, threadIdx.x, table, data, len, chunk, out, nchunks);
}

struct Slot {
  char* pinned = nullptr;  // staging the I/O reads into
  uint64_t pinned_cap = 0;
  char* pinned_out = nullptr;  // D2H lands here; Wait copies it to the caller
  uint64_t out_cap = 0;
  DevOp* pinned_ops = nullptr;
  uint64_t ops_cap = 0;
  unsigned char* dsrc = nullptr;
  uint64_t dsrc_cap = 0;
  unsigned char* ddst = nullptr;
  uint64_t ddst_cap = 0;
  DevOp* dops = nullptr;
  uint64_t dops_cap = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  bool pending = false;
  char* host_dst = nullptr;  // where Wait copies the output
  uint64_t out_bytes = 0;
};

// Backends alive in this process, per device: a device reset (the idle
// release's last step) destroys every allocation of the process on that
// device, so a backend resets only while it is the device's sole one (a
// benchmark or a test holding two would otherwise pull pinned memory from
// under the other; first seen on a real H200).
std::mutex g_live_mu;
std::vector<int> g_live;  // ordinal -> live backends

void CountLive(int device, int delta) {
  std::lock_guard<std::mutex> l(g_live_mu);
  if (static_cast<size_t>(device) >= g_live.size()) g_live.resize(device + 1, 0);
  g_live[device] += delta;
}
bool SoleLive(int device) {
  std::lock_guard<std::mutex> l(g_live_mu);
  return static_cast<size_t>(device) < g_live.size() && g_live[device] == 1;
}

struct Lane {
  Slot slots[2];
  uint64_t counted = 0;  // bytes of this lane in CudaBackend::held_
};

Status GrowPinned(char** p, uint64_t* cap, uint64_t need) {
  if (*cap >= need) return Status::Ok();
  if (*p != nullptr) CKPTFS_CUDA(cudaFreeHost(*p));
  *p = nullptr;
  *cap = 0;
  const uint64_t n = std::max<uint64_t>(need, 1ull << 20);
  CKPTFS_CUDA(cudaHostAlloc(reinterpret_cast<void**>(p), n, cudaHostAllocDefault));
  *cap = n;
  return Status::Ok();
}

template <typename T>
Status GrowDevice(T** p, uint64_t* cap, uint64_t need) {
  if (*cap >= need) return Status::Ok();
  if (*p != nullptr) CKPTFS_CUDA(cudaFree(*p));
  *p = nullptr;
  *cap = 0;
  const uint64_t n = std::max<uint64_t>(need, 1ull << 20);
  CKPTFS_CUDA(cudaMalloc(reinterpret_cast<void**>(p), n));
  *cap = n;
  return Status::Ok();
}

void FreeSlot(Slot& s) {
  // Errors here mean the context is already gone; nothing is left to free.
  if (s.stream != nullptr) (void)cudaStreamSynchronize(s.stream);
  if (s.pinned) (void)cudaFreeHost(s.pinned);
  if (s.pinned_out) (void)cudaFreeHost(s.pinned_out);
  if (s.pinned_ops) (void)cudaFreeHost(s.pinned_ops);
  if (s.dsrc) (void)cudaFree(s.dsrc);
  if (s.ddst) (void)cudaFree(s.ddst);
  if (s.dops) (void)cudaFree(s.dops);
  if (s.done) (void)cudaEventDestroy(s.done);
  if (s.stream) (void)cudaStreamDestroy(s.stream);
  s = Slot{};
}

class CudaBackend final : public Transforms {
 public:
  CudaBackend(const CudaOptions& o, std::string name) : opts_(o), name_(std::move(name)) {
    CountLive(opts_.device, 1);
    reaper_ = std::thread([this] { Reap(); });
  }
  int device() const override { return opts_.device; }
  ~CudaBackend() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    reaper_.join();
    std::lock_guard<std::mutex> l(mu_);
    ReleaseLocked();
    CountLive(opts_.device, -1);
  }

  const char* name() const override { return name_.c_str(); }

  Status Gather(const char* src, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                uint64_t dst_len) override {
    RETURN_IF_ERROR(ValidateOps(src_len, ops, out, dst_len));
    const PlanExtent ext = ExtentOf(ops, out);
    if (ext.elements == 0) return Status::Ok();
    ASSIGN_OR_RETURN(auto pipe, Begin());
    // Stage only the bytes the ops read, keeping their 16-byte alignment.
    const uint64_t base = ext.src_lo & ~15ull;
    ASSIGN_OR_RETURN(char* stage, pipe->Staging(0, ext.src_hi - base));
    std::memcpy(stage, src + base, ext.src_hi - base);
    std::vector<GatherOp> shifted(ops.begin(), ops.end());
    for (GatherOp& op : shifted) op.src_off -= base;
    RETURN_IF_ERROR(pipe->Submit(0, ext.src_hi - base, shifted, out, dst, dst_len));
    return pipe->Wait(0);
  }

  Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) override;
  Status Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) override;

  class CudaPipeline final : public Pipeline {
   public:
    // `restore_device`: the calling thread's device before this pipeline
    // (a device pipeline runs in the caller's thread, whose current device
    // torch also keeps), set again when it ends; -1: left as it is.
    CudaPipeline(CudaBackend& b, std::unique_ptr<Lane> lane, bool device_out, int restore_device = -1)
        : b_(b), lane_(std::move(lane)), device_out_(device_out), restore_device_(restore_device) {}
    ~CudaPipeline() override {
      for (int s = 0; s < 2; ++s) {
        if (lane_->slots[s].pending) (void)Wait(s);  // an error was already reported by the caller's path
      }
      b_.Return(std::move(lane_));
      if (restore_device_ >= 0) (void)cudaSetDevice(restore_device_);
    }
    Result<char*> Staging(int slot, uint64_t bytes) override {
      Slot& s = lane_->slots[slot & 1];
      RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, bytes));
      return s.pinned;
    }
    Status Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                  uint64_t dst_len) override;
    Status Wait(int slot) override;
    Status SubmitMean(int slot, uint32_t copies, uint64_t numel, DType dt, DType out, char* dst) override;
    Lane* lane() { return lane_.get(); }
    // Both slots' streams wait for the work queued on `after` so far (null:
    // the legacy default stream, torch's default).
    Status After(cudaStream_t after) {
      Slot& s0 = lane_->slots[0];
      CKPTFS_CUDA(cudaEventRecord(s0.done, after));
      for (Slot& s : lane_->slots) CKPTFS_CUDA(cudaStreamWaitEvent(s.stream, s0.done, 0));
      return Status::Ok();
    }

   private:
    // The device-output gather: ops already on the device at s.dops.
    Status LaunchInto(Slot& s, const kernels::KernelOps& kops, char* dst);

    CudaBackend& b_;
    std::unique_ptr<Lane> lane_;
    bool device_out_ = false;
    int restore_device_ = -1;
  };

  uint64_t HeldBytes() const override {
    std::lock_guard<std::mutex> l(mu_);
    return held_;
  }

  Result<std::unique_ptr<Pipeline>> Begin() override {
    ASSIGN_OR_RETURN(auto lane, Take());
    return std::unique_ptr<Pipeline>(new CudaPipeline(*this, std::move(lane), false));
  }

  Result<std::unique_ptr<Pipeline>> BeginDevice(void* after) override {
    ASSIGN_OR_RETURN(auto pipe, DevicePipeline());
    RETURN_IF_ERROR(pipe->After(static_cast<cudaStream_t>(after)));
    return std::unique_ptr<Pipeline>(std::move(pipe));
  }

  Status Upload(const char* host, uint64_t n, char* dst, void* after) override {
    if (n == 0) return Status::Ok();
    ASSIGN_OR_RETURN(auto pipe, DevicePipeline());
    RETURN_IF_ERROR(pipe->After(static_cast<cudaStream_t>(after)));
    Slot& s = pipe->lane()->slots[0];
    // Through pinned memory in pieces: an async copy from pageable memory
    // would be staged by the driver anyway, and this bounds what is pinned.
    constexpr uint64_t kPiece = 16ull << 20;
    RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, std::min(n, kPiece)));
    for (uint64_t off = 0; off < n; off += kPiece) {
      const uint64_t m = std::min(kPiece, n - off);
      std::memcpy(s.pinned, host + off, m);
      CKPTFS_CUDA(cudaMemcpyAsync(dst + off, s.pinned, m, cudaMemcpyHostToDevice, s.stream));
      CKPTFS_CUDA(cudaStreamSynchronize(s.stream));
    }
    return Status::Ok();
  }

 private:
  // A device-output pipeline in the calling thread, which gets its current
  // device back when the pipeline ends (or here, when none can be made).
  Result<std::unique_ptr<CudaPipeline>> DevicePipeline() {
    int prev = 0;
    CKPTFS_CUDA(cudaGetDevice(&prev));
    auto lane = Take();
    if (!lane.ok()) {
      (void)cudaSetDevice(prev);
      return lane.status();
    }
    return std::make_unique<CudaPipeline>(*this, std::move(*lane), true, prev);
  }

  // A lane for this thread; (re)creates the context and constants when the
  // reaper released them.
  Result<std::unique_ptr<Lane>> Take() {
    std::unique_lock<std::mutex> l(mu_);
    CKPTFS_CUDA(cudaSetDevice(opts_.device));
    if (!constants_) {
      float tables[kFp8Kinds][256];
      for (int k = 0; k < kFp8Kinds; ++k)
        std::memcpy(tables[k], Fp8DecodeTable(kernels::kFp8Dtypes[k]), sizeof(tables[k]));
      CKPTFS_CUDA(cudaMemcpyToSymbol(c_fp8, tables, sizeof(tables)));
      constants_ = true;
    }
    ++in_use_;
    if (!free_.empty()) {
      std::unique_ptr<Lane> lane = std::move(free_.back());
      free_.pop_back();
      return Result<std::unique_ptr<Lane>>(std::move(lane));
    }
    auto lane = std::make_unique<Lane>();
    for (Slot& s : lane->slots) {
      Status st = [&]() -> Status {
        CKPTFS_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
        CKPTFS_CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
        return Status::Ok();
      }();
      if (!st.ok()) {
        --in_use_;
        for (Slot& t : lane->slots) FreeSlot(t);
        return st;
      }
    }
    return Result<std::unique_ptr<Lane>>(std::move(lane));
  }

  void Return(std::unique_ptr<Lane> lane) {
    std::lock_guard<std::mutex> l(mu_);
    uint64_t total = 0;  // capacities only grow while a lane lives
    for (const Slot& s : lane->slots)
      total += s.pinned_cap + s.out_cap + s.ops_cap + s.dsrc_cap + s.ddst_cap + s.dops_cap;
    held_ += total - lane->counted;
    lane->counted = total;
    free_.push_back(std::move(lane));
    --in_use_;
    last_use_ = std::chrono::steady_clock::now();
  }

  void ReleaseLocked() {
    const bool reset = constants_ && opts_.reset_when_idle && SoleLive(opts_.device);
    if (free_.empty() && !reset) return;
    for (auto& lane : free_) {
      for (Slot& s : lane->slots) FreeSlot(s);
    }
    free_.clear();
    held_ = 0;
    if (reset) {
      (void)cudaSetDevice(opts_.device);
      (void)cudaDeviceReset();  // drops the primary context and all it holds
      constants_ = false;
    }
  }

  void Reap() {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      cv_.wait_for(l, std::chrono::milliseconds(std::max<uint64_t>(opts_.idle_ms / 4, 10)));
      if (stop_) break;
      const auto idle = std::chrono::steady_clock::now() - last_use_;
      if (in_use_ == 0 && idle >= std::chrono::milliseconds(opts_.idle_ms)) ReleaseLocked();
    }
  }

  CudaOptions opts_;
  std::string name_;
  // Lock order: mu_ is a leaf; CUDA calls under it only create or free.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t held_ = 0;  // capacities of every lane's buffers (in use or free)
  std::vector<std::unique_ptr<Lane>> free_;
  int in_use_ = 0;
  bool constants_ = false;
  bool stop_ = false;
  std::chrono::steady_clock::time_point last_use_ = std::chrono::steady_clock::now();
  std::thread reaper_;
};

Status CudaBackend::CudaPipeline::Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out,
                                         char* dst, uint64_t dst_len) {
  Slot& s = lane_->slots[slot & 1];
  if (s.pending) return Internal("cuda: submit on a slot that was not waited for");
  if (s.pinned_cap < src_len) return Internal("cuda: submit of more bytes than were staged");
  RETURN_IF_ERROR(ValidateOps(src_len, ops, out, dst_len));
  const PlanExtent ext = ExtentOf(ops, out);
  if (ext.elements == 0) return Status::Ok();
  if (device_out_) {
    // Only the staged bytes the ops read go up (16-byte aligned start).
    const uint64_t sbase = ext.src_lo & ~15ull, sbytes = ext.src_hi - sbase;
    const kernels::KernelOps kops = kernels::BuildDeviceOutputOps(ops, out, sbase, reinterpret_cast<uintptr_t>(dst));
    RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, sbytes));
    CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned + sbase, sbytes, cudaMemcpyHostToDevice, s.stream));
    return LaunchInto(s, kops, dst);
  }
  const kernels::ChunkLayout lay = kernels::LayoutChunk(ext);
  const uint64_t sbase = lay.sbase, dbase = lay.dbase, sbytes = lay.sbytes, dbytes = lay.dbytes;

  // Ops, rebased and with their flat element prefix, into pinned memory (an
  // async H2D from pageable memory would serialize the stream).
  const kernels::KernelOps kops = kernels::BuildKernelOps(ops, out, sbase, dbase);
  const std::vector<DevOp>& dev = kops.ops;
  const uint64_t ops_bytes = dev.size() * sizeof(DevOp);
  RETURN_IF_ERROR(GrowPinned(reinterpret_cast<char**>(&s.pinned_ops), &s.ops_cap, ops_bytes));
  std::memcpy(s.pinned_ops, dev.data(), ops_bytes);
  RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, sbytes));
  RETURN_IF_ERROR(GrowDevice(&s.ddst, &s.ddst_cap, dbytes));
  RETURN_IF_ERROR(GrowDevice(&s.dops, &s.dops_cap, ops_bytes));
  RETURN_IF_ERROR(GrowPinned(&s.pinned_out, &s.out_cap, ext.dst_hi - ext.dst_lo));

  // The device output starts at a 16-byte boundary (aligned typed stores);
  // only [dst_lo, dst_hi) goes back, so chunks in flight never touch each
  // other's bytes. Bytes inside that no op writes keep the caller's values.
  const uint64_t head = lay.head, obytes = lay.obytes;
  if (lay.prefill) {
    std::memcpy(s.pinned_out, dst + ext.dst_lo, obytes);
    CKPTFS_CUDA(cudaMemcpyAsync(s.ddst + head, s.pinned_out, obytes, cudaMemcpyHostToDevice, s.stream));
  }
  CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned + sbase, sbytes, cudaMemcpyHostToDevice, s.stream));
  CKPTFS_CUDA(cudaMemcpyAsync(s.dops, s.pinned_ops, ops_bytes, cudaMemcpyHostToDevice, s.stream));
  const kernels::Launch launch = kernels::GatherLaunch(kops.total);
  GatherKernel<<<launch.blocks, launch.threads, 0, s.stream>>>(s.dsrc, s.ddst, s.dops, static_cast<int>(dev.size()),
                                                               kops.total);
  CKPTFS_CUDA(cudaGetLastError());
  CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst + head, obytes, cudaMemcpyDeviceToHost, s.stream));
  CKPTFS_CUDA(cudaEventRecord(s.done, s.stream));
  s.pending = true;
  s.host_dst = dst + ext.dst_lo;
  s.out_bytes = obytes;
  return Status::Ok();
}

Status CudaBackend::CudaPipeline::LaunchInto(Slot& s, const kernels::KernelOps& kops, char* dst) {
  const std::vector<DevOp>& dev = kops.ops;
  const uint64_t ops_bytes = dev.size() * sizeof(DevOp);
  RETURN_IF_ERROR(GrowPinned(reinterpret_cast<char**>(&s.pinned_ops), &s.ops_cap, ops_bytes));
  RETURN_IF_ERROR(GrowDevice(&s.dops, &s.dops_cap, ops_bytes));
  std::memcpy(s.pinned_ops, dev.data(), ops_bytes);
  CKPTFS_CUDA(cudaMemcpyAsync(s.dops, s.pinned_ops, ops_bytes, cudaMemcpyHostToDevice, s.stream));
  const kernels::Launch launch = kernels::GatherLaunch(kops.total);
  GatherKernel<<<launch.blocks, launch.threads, 0, s.stream>>>(s.dsrc, reinterpret_cast<unsigned char*>(dst), s.dops,
                                                               static_cast<int>(dev.size()), kops.total);
  CKPTFS_CUDA(cudaGetLastError());
  CKPTFS_CUDA(cudaEventRecord(s.done, s.stream));
  s.pending = true;
  s.host_dst = nullptr;
  s.out_bytes = 0;
  return Status::Ok();
}

Status CudaBackend::CudaPipeline::SubmitMean(int slot, uint32_t copies, uint64_t numel, DType dt, DType out,
                                             char* dst) {
  if (!device_out_) return Unsupported("cuda: a mean into device memory needs a device pipeline");
  Slot& s = lane_->slots[slot & 1];
  if (s.pending) return Internal("cuda: submit on a slot that was not waited for");
  RETURN_IF_ERROR(CheckMean(copies, dt));
  if (!Renders(dt, out)) {
    return Internal("cuda: cannot render a mean of " + std::string(DTypeName(dt)) + " as " +
                    std::string(DTypeName(out)));
  }
  const uint64_t esz = DTypeSize(dt), in = numel * esz * copies;
  if (s.pinned_cap < in) return Internal("cuda: submit of more bytes than were staged");
  if (numel == 0) return Status::Ok();
  RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, in));
  CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned, in, cudaMemcpyHostToDevice, s.stream));
  unsigned char* mean = reinterpret_cast<unsigned char*>(dst);
  if (dt != out) {  // the mean in its own dtype first, then rendered as `out`
    RETURN_IF_ERROR(GrowDevice(&s.ddst, &s.ddst_cap, numel * esz));
    mean = s.ddst;
  }
  const kernels::Launch launch = kernels::MeanLaunch(numel);
  MeanKernel<<<launch.blocks, launch.threads, 0, s.stream>>>(s.dsrc, numel * esz, copies, dt, numel, mean);
  CKPTFS_CUDA(cudaGetLastError());
  if (dt == out) {
    CKPTFS_CUDA(cudaEventRecord(s.done, s.stream));
    s.pending = true;
    s.host_dst = nullptr;
    return Status::Ok();
  }
  // The widening gather reads the mean where it lies (ddst): swap it in as
  // the source for this launch.
  const GatherOp op = kernels::ContiguousOp(numel, dt);
  const kernels::KernelOps kops =
      kernels::BuildDeviceOutputOps(std::span<const GatherOp>(&op, 1), out, 0, reinterpret_cast<uintptr_t>(dst));
  std::swap(s.dsrc, s.ddst);
  std::swap(s.dsrc_cap, s.ddst_cap);
  return LaunchInto(s, kops, dst);
}

Status CudaBackend::CudaPipeline::Wait(int slot) {
  Slot& s = lane_->slots[slot & 1];
  if (!s.pending) return Status::Ok();
  s.pending = false;
  CKPTFS_CUDA(cudaEventSynchronize(s.done));
  if (s.host_dst != nullptr) std::memcpy(s.host_dst, s.pinned_out, s.out_bytes);
  return Status::Ok();
}

Status CudaBackend::Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) {
  using kernels::kCrcChunk;
  using kernels::kCrcPiece;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].offset > len || ranges[i].length > len - ranges[i].offset) {
      return Internal("cannot hash range " + std::to_string(i) + ": outside the " + std::to_string(len) +
                      "-byte buffer");
    }
  }
  ASSIGN_OR_RETURN(auto pipe, Begin());
  Slot& s = static_cast<CudaPipeline*>(pipe.get())->lane()->slots[0];
  const uint32_t full = Crc32cShiftOp(kCrcChunk);
  for (size_t i = 0; i < ranges.size(); ++i) {
    uint32_t crc = 0;  // CRC of the empty string
    for (uint64_t off = 0; off < ranges[i].length; off += kCrcPiece) {
      const uint64_t n = std::min(kCrcPiece, ranges[i].length - off), nchunks = (n + kCrcChunk - 1) / kCrcChunk;
      RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, n));
      RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, n));
      RETURN_IF_ERROR(GrowDevice(&s.ddst, &s.ddst_cap, nchunks * 4));
      RETURN_IF_ERROR(GrowPinned(&s.pinned_out, &s.out_cap, nchunks * 4));
      std::memcpy(s.pinned, data + ranges[i].offset + off, n);
      CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned, n, cudaMemcpyHostToDevice, s.stream));
      const kernels::Launch launch = kernels::Crc32cLaunch(nchunks);
      Crc32cChunksKernel<<<launch.blocks, launch.threads, 0, s.stream>>>(s.dsrc, n, kCrcChunk,
                                                                         reinterpret_cast<uint32_t*>(s.ddst), nchunks);
      CKPTFS_CUDA(cudaGetLastError());
      CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst, nchunks * 4, cudaMemcpyDeviceToHost, s.stream));
      CKPTFS_CUDA(cudaStreamSynchronize(s.stream));
      crc = kernels::Crc32cFoldChunks(crc, reinterpret_cast<const uint32_t*>(s.pinned_out), n, full);
    }
    out[i] = crc;
  }
  return Status::Ok();
}

// Synchronous, in pieces of at most 64 MiB of source.
Status CudaBackend::Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) {
  RETURN_IF_ERROR(CheckMean(copies, dt));
  const uint64_t esz = DTypeSize(dt), copy_bytes = numel * esz;
  const uint64_t per_piece = std::max<uint64_t>(1, (64ull << 20) / (esz * copies));
  ASSIGN_OR_RETURN(auto pipe, Begin());
  Slot& s = static_cast<CudaPipeline*>(pipe.get())->lane()->slots[0];
  for (uint64_t e0 = 0; e0 < numel; e0 += per_piece) {
    const uint64_t n = std::min(per_piece, numel - e0), in = n * esz * copies, outb = n * esz;
    RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, in));
    RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, in));
    RETURN_IF_ERROR(GrowDevice(&s.ddst, &s.ddst_cap, outb));
    RETURN_IF_ERROR(GrowPinned(&s.pinned_out, &s.out_cap, outb));
    for (uint32_t k = 0; k < copies; ++k) std::memcpy(s.pinned + k * n * esz, src + k * copy_bytes + e0 * esz, n * esz);
    CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned, in, cudaMemcpyHostToDevice, s.stream));
    const kernels::Launch launch = kernels::MeanLaunch(n);
    MeanKernel<<<launch.blocks, launch.threads, 0, s.stream>>>(s.dsrc, n * esz, copies, dt, n, s.ddst);
    CKPTFS_CUDA(cudaGetLastError());
    CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst, outb, cudaMemcpyDeviceToHost, s.stream));
    CKPTFS_CUDA(cudaStreamSynchronize(s.stream));
    std::memcpy(dst + e0 * esz, s.pinned_out, outb);
  }
  return Status::Ok();
}

}  // namespace

bool CudaCompiledIn() { return true; }

Result<std::shared_ptr<char>> AllocDeviceBytes(int device, uint64_t n) {
  int prev = 0;
  CKPTFS_CUDA(cudaGetDevice(&prev));
  CKPTFS_CUDA(cudaSetDevice(device));
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<uint64_t>(n, 1));
  (void)cudaSetDevice(prev);
  if (err != cudaSuccess) return Unsupported(std::string("cuda: cudaMalloc: ") + cudaGetErrorString(err));
  return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { (void)cudaFree(q); });
}

Status DownloadDeviceBytes(int device, const char* src, uint64_t n, char* host) {
  int prev = 0;
  CKPTFS_CUDA(cudaGetDevice(&prev));
  CKPTFS_CUDA(cudaSetDevice(device));
  const cudaError_t err = cudaMemcpy(host, src, n, cudaMemcpyDeviceToHost);
  (void)cudaSetDevice(prev);
  if (err != cudaSuccess) return Internal(std::string("cuda: cudaMemcpy: ") + cudaGetErrorString(err));
  return Status::Ok();
}

Result<std::unique_ptr<Transforms>> MakeCudaTransforms(const CudaOptions& opts) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    return Unsupported(std::string("no usable CUDA device (no NVIDIA driver or GPU on this machine: ") +
                       cudaGetErrorString(err) + ")");
  }
  if (err != cudaSuccess) return Unsupported(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
  if (opts.device < 0 || opts.device >= n) {
    return Unsupported("no CUDA device " + std::to_string(opts.device) + " (" + std::to_string(n) + " present)");
  }
  cudaDeviceProp p{};
  CKPTFS_CUDA(cudaGetDeviceProperties(&p, opts.device));
  char bus[32];
  std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x", p.pciDomainID, p.pciBusID, p.pciDeviceID);
  const std::string name = std::string(p.name) + " sm_" + std::to_string(p.major) + std::to_string(p.minor) + " " + bus;
  return std::unique_ptr<Transforms>(new CudaBackend(opts, name));
}

}  // namespace ckptfs
