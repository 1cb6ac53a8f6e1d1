// Means of copies (a tensor whose TP replicas are averaged, replicas > 1):
// ReadMean reads each copy as its source dtype in bounded steps and averages
// them with Transforms::Mean (falling back to the CPU when the GPU fails);
// MeanToDevice does the same into device memory through a two-slot pipeline.
// No locks of their own.
#include <algorithm>

#include "ckptfs/io.h"

namespace ckptfs {

namespace {

// The fragments of each copy of a mean-of-copies tensor (Fragment::replica).
Result<std::vector<std::vector<Fragment>>> CopiesOf(const TensorRecord& t, const std::vector<Fragment>& frags) {
  std::vector<std::vector<Fragment>> copies(t.replicas);
  for (const Fragment& f : frags) {
    if (f.replica >= t.replicas) {
      return Invalid("cannot read '" + t.key + "': fragment of copy " + std::to_string(f.replica) + " of " +
                     std::to_string(t.replicas) + " (index corrupt?)");
    }
    copies[f.replica].push_back(f);
  }
  return copies;
}

}  // namespace

Status TensorReader::ReadMean(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                              uint64_t e0, uint64_t e1, char* base) {
  const uint32_t n = t.replicas;
  ASSIGN_OR_RETURN(std::vector<std::vector<Fragment>> copies, CopiesOf(t, frags));
  const uint64_t ssz = DTypeSize(t.dtype), osz = DTypeSize(out);
  // Bounded scratch: n copies of at most 4 MiB of source elements each.
  const uint64_t step = std::max<uint64_t>(1, (4ull << 20) / ssz);
  std::vector<char> scratch, mean;
  Transforms* tf = &CpuTransforms();
  if (policy_ != nullptr && policy_->gpu() != nullptr) tf = &policy_->For(TransformKind::kCopy, (e1 - e0) * osz * n);
  for (uint64_t c0 = e0; c0 < e1; c0 += step) {
    const uint64_t c1 = std::min(e1, c0 + step), m = c1 - c0;
    scratch.resize(m * ssz * n);
    for (uint32_t r = 0; r < n; ++r) {
      bool unused = false;
      char* at = scratch.data() + r * m * ssz;
      RETURN_IF_ERROR(RunChunks(t, copies[r], view, t.dtype, c0, c1, m, CpuTransforms(), at, nullptr, &unused));
    }
    char* dst = base + (c0 - e0) * osz;
    char* target = out == t.dtype ? dst : (mean.resize(m * ssz), mean.data());
    Status s = tf->Mean(scratch.data(), n, m, t.dtype, target);
    if (!s.ok() && tf != &CpuTransforms()) {
      gpu_fallbacks_.fetch_add(1);
      LogWarn("cannot average '" + t.key + "' on " + tf->name() + ", computed on the CPU: " + s.message());
      tf = &CpuTransforms();
      s = tf->Mean(scratch.data(), n, m, t.dtype, target);
    }
    if (!s.ok()) return s.Annotate("cannot read '" + t.key + "'");
    if (target != dst) RETURN_IF_ERROR(ConvertRun(target, t.dtype, 1, dst, out, m));
  }
  return Status::Ok();
}

Status TensorReader::MeanToDevice(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                                  uint64_t numel, const DeviceTarget& target, char* dst, bool* gpu_failed) {
  const uint32_t n = t.replicas;
  ASSIGN_OR_RETURN(std::vector<std::vector<Fragment>> copies, CopiesOf(t, frags));
  auto dev = [&](const Status& s) {
    *gpu_failed = true;
    return s;
  };
  gpu_plans_.fetch_add(1);
  const uint64_t ssz = DTypeSize(t.dtype), osz = DTypeSize(out);
  // As ReadMean: n copies of at most 4 MiB of source elements per step, read
  // into the slot's pinned staging on the host (each copy may itself be a
  // merge), averaged and rendered on the device; two slots overlap the next
  // step's reads with this one's upload and kernels.
  const uint64_t step = std::max<uint64_t>(1, (4ull << 20) / ssz);
  ASSIGN_OR_RETURN(auto pipe, [&]() -> Result<std::unique_ptr<Transforms::Pipeline>> {
    auto p = target.backend->BeginDevice(target.after);
    if (!p.ok()) return dev(p.status());
    return p;
  }());
  bool pending[2] = {false, false};
  int slot = 0;
  for (uint64_t c0 = 0; c0 < numel; c0 += step, slot ^= 1) {
    const uint64_t c1 = std::min(numel, c0 + step), m = c1 - c0;
    if (pending[slot]) {
      pending[slot] = false;
      if (Status w = pipe->Wait(slot); !w.ok()) return dev(w);
    }
    auto staging = pipe->Staging(slot, m * ssz * n);
    if (!staging.ok()) return dev(staging.status());
    for (uint32_t r = 0; r < n; ++r) {
      bool unused = false;
      RETURN_IF_ERROR(
          RunChunks(t, copies[r], view, t.dtype, c0, c1, m, CpuTransforms(), *staging + r * m * ssz, nullptr, &unused));
    }
    if (Status sub = pipe->SubmitMean(slot, n, m, t.dtype, out, dst + c0 * osz); !sub.ok()) return dev(sub);
    pending[slot] = true;
  }
  for (int k = 0; k < 2; ++k) {
    if (!pending[k]) continue;
    if (Status w = pipe->Wait(k); !w.ok()) return dev(w);
  }
  return Status::Ok();
}

}  // namespace ckptfs
