// The CUDA transforms: the same ops as the CPU backend, the same bytes.
//
// One kernel covers a whole pipeline chunk: every thread walks a grid-stride
// range of the chunk's flat element index, finds its op by binary search over
// the ops' element prefix sums, decomposes the op-local index (32-bit
// arithmetic when the op has fewer than 2^32 elements) and converts one
// element with the functions the CPU uses (common/float_bits.h, the fp8 tables
// of convert.cc copied to constant memory). Consecutive threads take
// consecutive elements, so contiguous runs load and store coalesced.
//
// Resources live in lanes (a stream, events, pinned staging and device
// buffers per slot); a reader takes a lane for one read and gives it back. A
// reaper thread frees every lane and resets the device once nothing used it
// for `idle_ms`, so an idle mount holds no GPU memory, not even a context.
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
#include "io/transform_internal.h"

namespace ckptfs {
namespace {

#define CKPTFS_CUDA(call)                                                                              \
  do {                                                                                                 \
    const cudaError_t err_ = (call);                                                                   \
    if (err_ != cudaSuccess) return Internal(std::string("cuda: ") + #call + ": " + cudaGetErrorString(err_)); \
  } while (0)

constexpr int kFp8Kinds = 4;
__constant__ float c_fp8[kFp8Kinds][256];

// The op as the kernel sees it; offsets are relative to the chunk's device
// buffers.
struct DevOp {
  uint64_t first = 0;  // flat element index of the op's first element in the chunk
  uint64_t src_off = 0, dst_off = 0;
  int64_t len[kMaxGatherDims], sstr[kMaxGatherDims], dstr[kMaxGatherDims];
  uint32_t ssize = 0, dsize = 0;
  int32_t conv = 0;  // 0 copy, 1 bf16, 2 f16, 3.. fp8 table index + 3
  int32_t rank = 0;
  int32_t aligned = 0;  // typed loads and stores are safe
  int32_t small = 0;    // fewer than 2^32 elements: 32-bit index math
};

int ConvCode(DType s, DType d) {
  if (s == d) return 0;
  switch (s) {
    case DType::kBF16: return 1;
    case DType::kF16: return 2;
    case DType::kF8E4M3FN: return 3;
    case DType::kF8E5M2: return 4;
    case DType::kF8E4M3FNUZ: return 5;
    case DType::kF8E5M2FNUZ: return 6;
    default: return -1;
  }
}

__device__ __forceinline__ void CopyElement(const unsigned char* s, unsigned char* d, uint32_t size, bool aligned) {
  if (aligned) {
    switch (size) {
      case 1: *d = *s; return;
      case 2: *reinterpret_cast<uint16_t*>(d) = *reinterpret_cast<const uint16_t*>(s); return;
      case 4: *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(s); return;
      case 8: *reinterpret_cast<uint64_t*>(d) = *reinterpret_cast<const uint64_t*>(s); return;
      default: break;
    }
  }
  for (uint32_t i = 0; i < size; ++i) d[i] = s[i];
}

__device__ __forceinline__ void ConvertElement(const DevOp& op, const unsigned char* s, unsigned char* d) {
  if (op.conv == 0) {
    CopyElement(s, d, op.ssize, op.aligned != 0);
    return;
  }
  uint32_t bits;
  if (op.conv <= 2) {
    const uint16_t h = op.aligned ? *reinterpret_cast<const uint16_t*>(s)  // little-endian host and device
                                  : static_cast<uint16_t>(s[0] | (static_cast<uint16_t>(s[1]) << 8));
    bits = op.conv == 1 ? BFloat16BitsToFloatBits(h) : HalfBitsToFloatBits(h);
  } else {
    bits = __float_as_uint(c_fp8[op.conv - 3][s[0]]);
  }
  if (op.aligned) {
    *reinterpret_cast<uint32_t*>(d) = bits;
  } else {
    d[0] = bits & 0xFF, d[1] = (bits >> 8) & 0xFF, d[2] = (bits >> 16) & 0xFF, d[3] = bits >> 24;
  }
}

template <typename I>
__device__ __forceinline__ void Offsets(const DevOp& op, I local, uint64_t* so, uint64_t* dof) {
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

__global__ void GatherKernel(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                             const DevOp* __restrict__ ops, int nops, uint64_t total) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    int lo = 0, hi = nops - 1;  // last op with first <= e
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (ops[mid].first <= e) lo = mid;
      else hi = mid - 1;
    }
    const DevOp& op = ops[lo];
    const uint64_t local = e - op.first;
    uint64_t so, dof;
    if (op.small) Offsets<uint32_t>(op, static_cast<uint32_t>(local), &so, &dof);
    else Offsets<uint64_t>(op, local, &so, &dof);
    ConvertElement(op, src + op.src_off + so * op.ssize, dst + op.dst_off + dof * op.dsize);
  }
}

// Standard CRC-32C of each `chunk`-byte piece (the last may be shorter).
// Bit casts for MeanElement on the device.
struct DevBits {
  __device__ static float F32(uint32_t b) { return __uint_as_float(b); }
  __device__ static double F64(uint64_t b) { return __longlong_as_double(static_cast<long long>(b)); }
  __device__ static uint32_t Bits(float f) { return __float_as_uint(f); }
  __device__ static uint64_t Bits64(double f) { return static_cast<uint64_t>(__double_as_longlong(f)); }
  __device__ static void U32(uint32_t v, unsigned char* p) {
    for (int k = 0; k < 4; ++k) p[k] = static_cast<unsigned char>(v >> (8 * k));
  }
};

// One thread per output element, grid-stride.
__global__ void MeanKernel(const unsigned char* __restrict__ src, uint64_t copy_bytes, uint32_t copies, DType dt,
                           uint64_t numel, unsigned char* __restrict__ dst) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    MeanElement<DevBits, DevBits>(src, copy_bytes, copies, dt, i, dst);
  }
}

__global__ void Crc32cChunksKernel(const unsigned char* __restrict__ data, uint64_t len, uint64_t chunk,
                                   uint32_t* __restrict__ out, uint64_t nchunks) {
  __shared__ uint32_t table[256];
  for (uint32_t i = threadIdx.x; i < 256; i += blockDim.x) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
    table[i] = c;
  }
  __syncthreads();
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nchunks) return;
  const uint64_t b = i * chunk, n = min(chunk, len - b);
  uint32_t c = ~0u;
  const unsigned char* p = data + b;
  for (uint64_t k = 0; k < n; ++k) c = (c >> 8) ^ table[(c ^ p[k]) & 0xFF];
  out[i] = ~c;
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
    reaper_ = std::thread([this] { Reap(); });
  }
  ~CudaBackend() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    reaper_.join();
    std::lock_guard<std::mutex> l(mu_);
    ReleaseLocked();
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
    CudaPipeline(CudaBackend& b, std::unique_ptr<Lane> lane) : b_(b), lane_(std::move(lane)) {}
    ~CudaPipeline() override {
      for (int s = 0; s < 2; ++s) {
        if (lane_->slots[s].pending) (void)Wait(s);  // an error was already reported by the caller's path
      }
      b_.Return(std::move(lane_));
    }
    Result<char*> Staging(int slot, uint64_t bytes) override {
      Slot& s = lane_->slots[slot & 1];
      RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, bytes));
      return s.pinned;
    }
    Status Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                  uint64_t dst_len) override;
    Status Wait(int slot) override;
    Lane* lane() { return lane_.get(); }

   private:
    CudaBackend& b_;
    std::unique_ptr<Lane> lane_;
  };

  uint64_t HeldBytes() const override {
    std::lock_guard<std::mutex> l(mu_);
    return held_;
  }

  Result<std::unique_ptr<Pipeline>> Begin() override {
    ASSIGN_OR_RETURN(auto lane, Take());
    return std::unique_ptr<Pipeline>(new CudaPipeline(*this, std::move(lane)));
  }

 private:
  // A lane for this thread; (re)creates the context and constants when the
  // reaper released them.
  Result<std::unique_ptr<Lane>> Take() {
    std::unique_lock<std::mutex> l(mu_);
    CKPTFS_CUDA(cudaSetDevice(opts_.device));
    if (!constants_) {
      float tables[kFp8Kinds][256];
      const DType kinds[kFp8Kinds] = {DType::kF8E4M3FN, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ};
      for (int k = 0; k < kFp8Kinds; ++k) std::memcpy(tables[k], Fp8DecodeTable(kinds[k]), sizeof(tables[k]));
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
    for (const Slot& s : lane->slots) total += s.pinned_cap + s.out_cap + s.ops_cap + s.dsrc_cap + s.ddst_cap + s.dops_cap;
    held_ += total - lane->counted;
    lane->counted = total;
    free_.push_back(std::move(lane));
    --in_use_;
    last_use_ = std::chrono::steady_clock::now();
  }

  void ReleaseLocked() {
    if (free_.empty() && !constants_) return;
    for (auto& lane : free_) {
      for (Slot& s : lane->slots) FreeSlot(s);
    }
    free_.clear();
    held_ = 0;
    if (constants_) {
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
  const uint64_t sbase = ext.src_lo & ~15ull, dbase = ext.dst_lo & ~15ull;
  const uint64_t sbytes = ext.src_hi - sbase, dbytes = ext.dst_hi - dbase;
  const uint64_t dsize = DTypeSize(out);

  // Ops, rebased and with their flat element prefix, into pinned memory (an
  // async H2D from pageable memory would serialize the stream).
  std::vector<DevOp> dev;
  dev.reserve(ops.size());
  uint64_t first = 0;
  for (const GatherOp& op : ops) {
    const uint64_t n = op.Elements();
    if (n == 0) continue;
    DevOp d;
    d.first = first;
    d.src_off = op.src_off - sbase;
    d.dst_off = op.dst_off - dbase;
    for (int k = 0; k < kMaxGatherDims; ++k) d.len[k] = op.len[k], d.sstr[k] = op.sstr[k], d.dstr[k] = op.dstr[k];
    d.ssize = static_cast<uint32_t>(DTypeSize(op.sdtype));
    d.dsize = static_cast<uint32_t>(dsize);
    d.conv = ConvCode(op.sdtype, out);
    d.rank = op.rank;
    auto pow2 = [](uint64_t v) { return v != 0 && (v & (v - 1)) == 0 && v <= 8; };
    d.aligned = pow2(d.ssize) && pow2(d.dsize) && op.src_off % d.ssize == 0 && op.dst_off % d.dsize == 0;
    d.small = n < (1ull << 32);
    dev.push_back(d);
    first += n;
  }
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
  const uint64_t head = ext.dst_lo - dbase, obytes = ext.dst_hi - ext.dst_lo;
  if (ext.dst_bytes != obytes) {
    std::memcpy(s.pinned_out, dst + ext.dst_lo, obytes);
    CKPTFS_CUDA(cudaMemcpyAsync(s.ddst + head, s.pinned_out, obytes, cudaMemcpyHostToDevice, s.stream));
  }
  CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned + sbase, sbytes, cudaMemcpyHostToDevice, s.stream));
  CKPTFS_CUDA(cudaMemcpyAsync(s.dops, s.pinned_ops, ops_bytes, cudaMemcpyHostToDevice, s.stream));
  const int threads = 256;
  const uint64_t want = (first + threads - 1) / threads;
  const int blocks = static_cast<int>(std::min<uint64_t>(std::max<uint64_t>(want, 1), 65535ull * 8));
  GatherKernel<<<blocks, threads, 0, s.stream>>>(s.dsrc, s.ddst, s.dops, static_cast<int>(dev.size()), first);
  CKPTFS_CUDA(cudaGetLastError());
  CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst + head, obytes, cudaMemcpyDeviceToHost, s.stream));
  CKPTFS_CUDA(cudaEventRecord(s.done, s.stream));
  s.pending = true;
  s.host_dst = dst + ext.dst_lo;
  s.out_bytes = obytes;
  return Status::Ok();
}

Status CudaBackend::CudaPipeline::Wait(int slot) {
  Slot& s = lane_->slots[slot & 1];
  if (!s.pending) return Status::Ok();
  s.pending = false;
  CKPTFS_CUDA(cudaEventSynchronize(s.done));
  std::memcpy(s.host_dst, s.pinned_out, s.out_bytes);
  return Status::Ok();
}

Status CudaBackend::Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) {
  constexpr uint64_t kChunk = 16 << 10, kPiece = 64ull << 20;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].offset > len || ranges[i].length > len - ranges[i].offset) {
      return Internal("cannot hash range " + std::to_string(i) + ": outside the " + std::to_string(len) + "-byte buffer");
    }
  }
  ASSIGN_OR_RETURN(auto pipe, Begin());
  Slot& s = static_cast<CudaPipeline*>(pipe.get())->lane()->slots[0];
  const uint32_t full = Crc32cShiftOp(kChunk);
  for (size_t i = 0; i < ranges.size(); ++i) {
    uint32_t crc = 0;  // CRC of the empty string
    for (uint64_t off = 0; off < ranges[i].length; off += kPiece) {
      const uint64_t n = std::min(kPiece, ranges[i].length - off), nchunks = (n + kChunk - 1) / kChunk;
      RETURN_IF_ERROR(GrowPinned(&s.pinned, &s.pinned_cap, n));
      RETURN_IF_ERROR(GrowDevice(&s.dsrc, &s.dsrc_cap, n));
      RETURN_IF_ERROR(GrowDevice(&s.ddst, &s.ddst_cap, nchunks * 4));
      RETURN_IF_ERROR(GrowPinned(&s.pinned_out, &s.out_cap, nchunks * 4));
      std::memcpy(s.pinned, data + ranges[i].offset + off, n);
      CKPTFS_CUDA(cudaMemcpyAsync(s.dsrc, s.pinned, n, cudaMemcpyHostToDevice, s.stream));
      Crc32cChunksKernel<<<static_cast<unsigned>((nchunks + 127) / 128), 128, 0, s.stream>>>(
          s.dsrc, n, kChunk, reinterpret_cast<uint32_t*>(s.ddst), nchunks);
      CKPTFS_CUDA(cudaGetLastError());
      CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst, nchunks * 4, cudaMemcpyDeviceToHost, s.stream));
      CKPTFS_CUDA(cudaStreamSynchronize(s.stream));
      const auto* c = reinterpret_cast<const uint32_t*>(s.pinned_out);
      for (uint64_t k = 0; k < nchunks; ++k) {
        const uint64_t clen = std::min(kChunk, n - k * kChunk);
        crc = clen == kChunk ? Crc32cMulModP(full, crc) ^ c[k] : Crc32cCombine(crc, c[k], clen);
      }
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
    const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + 255) / 256, 65535));
    MeanKernel<<<blocks, 256, 0, s.stream>>>(s.dsrc, n * esz, copies, dt, n, s.ddst);
    CKPTFS_CUDA(cudaGetLastError());
    CKPTFS_CUDA(cudaMemcpyAsync(s.pinned_out, s.ddst, outb, cudaMemcpyDeviceToHost, s.stream));
    CKPTFS_CUDA(cudaStreamSynchronize(s.stream));
    std::memcpy(dst + e0 * esz, s.pinned_out, outb);
  }
  return Status::Ok();
}

}  // namespace

bool CudaCompiledIn() { return true; }

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
