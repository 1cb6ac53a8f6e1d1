// TensorReader's orchestration: open, the per-thread engines, the fragment
// cache, ReadBox / ReadToDevice (a read's checks, then its chunks through a
// transforms pipeline, RunChunks), and the hashes of whole tensors. The
// concerns it calls into live beside it (io/tensor_reader_internal.h).
// Locking: frag_mu_ and hash_mu_ guard their caches only; no mutex is held
// while calling out (io.h's lock order: every mutex is a leaf).
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "ckptfs/io.h"
#include "common/crc32.h"
#include "formats/zstd.h"  // ~TensorReader destroys the zstd cursors
#include "io/tensor_reader_internal.h"

namespace ckptfs {
namespace {

constexpr size_t kFragCacheTensors = 4096;
constexpr uint64_t kHashChunk = 8ull << 20;
// A CRC over mapped spans: at most this many spans planned for one item, summed
// kCrcPiece bytes at a time (at most half a mapping window, TensorReader::kMapStep).
constexpr size_t kCrcMaxSpans = 65536;
constexpr uint64_t kCrcPiece = 16ull << 20;

// Output bytes per pipeline chunk: one plan, one staging fill, one transform
// submission (one kernel launch on the GPU). FUSE reads fit in one chunk.
constexpr uint64_t kChunkBytes = 16ull << 20;

}  // namespace

// The box a read renders: `box`, or the whole tensor (built in `whole`),
// checked to lie in the tensor.
Result<const Box*> ViewOf(const TensorRecord& t, const Box* box, Box* whole) {
  const size_t rank = t.shape.size();
  if (box == nullptr) {
    *whole = Box{std::vector<int64_t>(rank, 0), t.shape};
    return whole;
  }
  if (box->offsets.size() != rank || box->lengths.size() != rank)
    return Internal("box rank mismatch for '" + t.key + "'");
  for (size_t d = 0; d < rank; ++d) {
    if (box->offsets[d] < 0 || box->lengths[d] < 0 || box->offsets[d] + box->lengths[d] > t.shape[d]) {
      return Internal("box " + BoxString(*box) + " is outside '" + t.key + "'");
    }
  }
  return box;
}

TensorReader::~TensorReader() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

TensorReader::TensorReader(const Index& index, EngineKind kind, std::unique_ptr<TransformPolicy> policy)
    : index_(index), kind_(kind), policy_(std::move(policy)) {}

Result<std::unique_ptr<TensorReader>> TensorReader::Open(const Index& index, EngineKind kind,
                                                         std::unique_ptr<TransformPolicy> policy) {
  std::unique_ptr<TensorReader> r(new TensorReader(index, kind, std::move(policy)));
  for (const auto& f : index.files()) {
    std::string path = index.src_dir() + "/" + f.rel_path;
    auto fd = f.mtime_ns == -1 ? Result<int>(IoError("cannot open " + path + ": missing at indexing time"))
                               : OpenSourceFile(index.src_dir(), f.rel_path);
    r->fds_.push_back(fd.ok() ? *fd : -1);
    r->open_errors_.push_back(fd.ok() ? "" : fd.status().message());
  }
  if (kind == EngineKind::kUring && MakeUringEngine(4) == nullptr) {
    return Unsupported("io_uring is not available on this system (use --engine=pread)");
  }
  r->path_checked_ns_ = std::make_unique<std::atomic<int64_t>[]>(index.files().size());
  for (size_t i = 0; i < index.files().size(); ++i) r->path_checked_ns_[i] = INT64_MIN / 2;
  return r;
}

ReadEngine& TensorReader::Engine() {
  struct PerThread {
    std::unique_ptr<ReadEngine> uring, pread;
    bool uring_tried = false;
  };
  thread_local PerThread e;
  if (kind_ != EngineKind::kPread) {
    if (!e.uring_tried) {
      e.uring_tried = true;
      e.uring = MakeUringEngine();
      if (e.uring == nullptr) LogWarn("io_uring unavailable on this thread; using pread");
    }
    if (e.uring) return *e.uring;
  }
  if (!e.pread) e.pread = MakePreadEngine();
  return *e.pread;
}

Status TensorReader::ReadSource(std::span<IoRequest> reqs) {
  Status s = Engine().ReadBatch(reqs);
  if (s.ok()) {
    uint64_t n = 0;
    for (const IoRequest& r : reqs) n += r.length;
    source_bytes_.fetch_add(n, std::memory_order_relaxed);
    source_reads_.fetch_add(1, std::memory_order_relaxed);
  }
  return s;
}

const char* TensorReader::engine_name() const { return kind_ == EngineKind::kPread ? "pread" : "io_uring"; }

Result<std::shared_ptr<const std::vector<Fragment>>> TensorReader::FragmentsOf(TensorId id) {
  {
    std::lock_guard<std::mutex> lock(frag_mu_);
    auto it = frag_cache_.find(id.v);
    if (it != frag_cache_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::vector<Fragment> v, index_.Fragments(id));
  auto p = std::make_shared<const std::vector<Fragment>>(std::move(v));
  std::lock_guard<std::mutex> lock(frag_mu_);
  if (frag_cache_.size() >= kFragCacheTensors) frag_cache_.clear();
  frag_cache_[id.v] = p;
  return p;
}

Result<std::shared_ptr<const std::vector<Fragment>>> TensorReader::ReadableFragments(TensorId id) {
  ASSIGN_OR_RETURN(auto frags, FragmentsOf(id));
  if (verify_on_read_ || any_bad_range_.load(std::memory_order_relaxed)) RETURN_IF_ERROR(CheckRanges(*frags));
  return frags;
}

std::shared_ptr<const std::vector<Fragment>> TensorReader::SpanFragments(TensorId id) {
  auto frags_or = ReadableFragments(id);
  return frags_or.ok() ? *std::move(frags_or) : nullptr;
}

Status TensorReader::ReadBox(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, char* dst) {
  if (id.v >= index_.tensors().size()) return Internal("tensor id out of range");
  const TensorRecord& t = index_.tensors()[id.v];
  auto fail = [&](const Status& s) { return s.Annotate("cannot read '" + t.key + "'"); };
  if (!t.error.empty()) return Invalid("cannot read '" + t.key + "': " + t.error);
  if (len == 0) return Status::Ok();
  auto frags_or = ReadableFragments(id);
  if (!frags_or.ok()) return fail(frags_or.status());
  const std::vector<Fragment>& frags = **frags_or;

  if (t.encoding == Encoding::kBytes) {
    if (frags.size() != 1) return Invalid("cannot read '" + t.key + "': bytes entry without its item");
    const Fragment& f = frags[0];
    if (offset + len > f.data_length) return Invalid("cannot read '" + t.key + "': range past the entry");
    if (f.compression != Compression::kNone) {
      auto span = ItemSpan(f, f.data_offset + offset, len);
      if (!span.ok()) return fail(span.status());
      std::memcpy(dst, span->first->data() + span->second, len);
      return Status::Ok();
    }
    Status fresh = CheckFd(f.file);
    if (!fresh.ok()) return fail(fresh);
    IoRequest req{fds_[f.file.v], f.data_offset + offset, len, dst};
    Status s = ReadSource(std::span<IoRequest>(&req, 1));
    return s.ok() ? s : fail(s.Annotate(index_.files()[f.file.v].rel_path));
  }

  const uint64_t osz = DTypeSize(out);
  if (osz == 0 || !CanConvert(t.dtype, out))
    return Internal("cannot render '" + t.key + "' as " + std::string(DTypeName(out)));
  // The output is the C-order rendering of `view` (the whole tensor by default).
  Box whole;
  ASSIGN_OR_RETURN(const Box* view_ptr, ViewOf(t, box, &whole));
  const Box& view = *view_ptr;
  const uint64_t numel = static_cast<uint64_t>(NumelOf(view.lengths));
  if (offset + len > numel * osz) return Invalid("cannot read '" + t.key + "': range past the tensor");
  const uint64_t e0 = offset / osz, e1 = (offset + len + osz - 1) / osz;
  std::string unaligned;
  char* base = dst;
  if (offset % osz != 0 || len % osz != 0) {
    unaligned.resize((e1 - e0) * osz);
    base = unaligned.data();
  }

  if (!t.derived.empty() && out != t.dtype) {
    // Derived values are the record dtype's (a ZeRO-3 weight: the fp32
    // master rounded as the engine casts it): render those, then widen.
    const uint64_t tsz = DTypeSize(t.dtype);
    std::string narrow((e1 - e0) * tsz, '\0');
    RETURN_IF_ERROR(ReadBox(id, t.dtype, box, e0 * tsz, (e1 - e0) * tsz, narrow.data()));
    RETURN_IF_ERROR(ConvertRun(narrow.data(), t.dtype, 1, base, out, e1 - e0));
    if (base != dst) std::memcpy(dst, base + (offset - e0 * osz), len);
    return Status::Ok();
  }
  if (t.replicas > 1) {
    Status ms = ReadMean(t, frags, view, out, e0, e1, base);
    if (!ms.ok()) return ms;
    if (base != dst) std::memcpy(dst, base + (offset - e0 * osz), len);
    return Status::Ok();
  }

  // Transform work happens only where the first chunk has ops (a contiguous
  // same-dtype read goes straight from the I/O into the caller's buffer).
  const uint64_t chunk = std::max<uint64_t>(1, kChunkBytes / osz);
  Chunk first;
  RETURN_IF_ERROR(PlanChunk(t, frags, view, out, e0, e0, std::min(e1, e0 + chunk), true, base, &first));
  Transforms* tf = &CpuTransforms();
  if (policy_ != nullptr && policy_->gpu() != nullptr && !first.ops.empty()) {
    tf = &policy_->For(ClassifyPlan(first.ops, out), (e1 - e0) * osz);
  }
  bool gpu_failed = false;
  const bool gpu = tf != &CpuTransforms();
  Status s = RunChunks(t, frags, view, out, e0, e1, chunk, *tf, base, gpu ? nullptr : &first, &gpu_failed);
  if (gpu_failed) {
    gpu_fallbacks_.fetch_add(1);
    LogWarn("cannot transform '" + t.key + "' on " + tf->name() + ", read again on the CPU: " + s.message());
    s = RunChunks(t, frags, view, out, e0, e1, chunk, CpuTransforms(), base, &first, &gpu_failed);
  }
  if (!s.ok()) return s;
  if (base != dst) std::memcpy(dst, base + (offset - e0 * osz), len);
  return Status::Ok();
}

Status TensorReader::ReadToDevice(TensorId id, DType out, const Box* box, const DeviceTarget& target, char* dst,
                                  uint64_t len) {
  if (id.v >= index_.tensors().size()) return Internal("tensor id out of range");
  if (target.backend == nullptr) return Internal("a device read without a device backend");
  const TensorRecord& t = index_.tensors()[id.v];
  auto fail = [&](const Status& s) { return s.Annotate("cannot read '" + t.key + "'"); };
  if (!t.error.empty()) return Invalid("cannot read '" + t.key + "': " + t.error);
  if (t.encoding != Encoding::kTensor) return Invalid("cannot read '" + t.key + "' into device memory: not a tensor");
  const uint64_t osz = DTypeSize(out);
  if (osz == 0 || !CanConvert(t.dtype, out))
    return Internal("cannot render '" + t.key + "' as " + std::string(DTypeName(out)));
  Box whole;
  ASSIGN_OR_RETURN(const Box* view_ptr, ViewOf(t, box, &whole));
  const Box& view = *view_ptr;
  const uint64_t numel = static_cast<uint64_t>(NumelOf(view.lengths));
  if (len != numel * osz)
    return Invalid("cannot read '" + t.key + "': a device buffer of " + std::to_string(len) + " bytes for " +
                   std::to_string(numel * osz));
  if (len == 0) return Status::Ok();
  auto frags_or = ReadableFragments(id);
  if (!frags_or.ok()) return fail(frags_or.status());
  const std::vector<Fragment>& frags = **frags_or;
  Transforms& dev = *target.backend;
  if (target.kernels_trusted && (t.derived.empty() || out == t.dtype)) {
    bool gpu_failed = false;
    Status s = t.replicas > 1 ? MeanToDevice(t, frags, view, out, numel, target, dst, &gpu_failed)
                              : RunChunks(t, frags, view, out, 0, numel, std::max<uint64_t>(1, kChunkBytes / osz), dev,
                                          dst, nullptr, &gpu_failed, &target);
    if (!gpu_failed) return s;
    // The device failed (not the checkpoint): render on the host in bounded
    // pieces and upload them; an upload that fails too is the answer.
    gpu_fallbacks_.fetch_add(1);
    LogWarn("cannot read '" + t.key + "' into " + dev.name() +
            " memory, read on the host and uploaded: " + s.message());
  }
  std::vector<char> piece;
  const uint64_t step = std::max<uint64_t>(osz, kChunkBytes / osz * osz);
  for (uint64_t off = 0; off < len; off += step) {
    const uint64_t n = std::min(step, len - off);
    piece.resize(n);
    RETURN_IF_ERROR(ReadBox(id, out, box, off, n, piece.data()));
    RETURN_IF_ERROR(dev.Upload(piece.data(), n, dst + off, target.after));
  }
  return Status::Ok();
}

// The chunks of [e0, e1) through `tf`'s two-slot pipeline: the I/O of chunk
// i+1 runs while the transform of chunk i is in flight. `first`, when given,
// is chunk 0 already planned for the CPU (direct reads); other chunks, and
// every chunk of a GPU run (no direct reads), are planned here.
// *gpu_failed: the failure came from the GPU (the caller retries on the CPU).
Status TensorReader::RunChunks(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                               uint64_t e0, uint64_t e1, uint64_t chunk, Transforms& tf, char* base, const Chunk* first,
                               bool* gpu_failed, const DeviceTarget* device) {
  const bool gpu = &tf != &CpuTransforms();
  (gpu ? gpu_plans_ : cpu_plans_).fetch_add(1);
  auto fail = [&](const Status& s) { return s.Annotate("cannot read '" + t.key + "'"); };
  auto dev = [&](const Status& s) {
    *gpu_failed = gpu;
    return s;
  };
  const uint64_t out_len = (e1 - e0) * DTypeSize(out);
  auto pipe_or = device != nullptr ? tf.BeginDevice(device->after) : tf.Begin();
  if (!pipe_or.ok()) return dev(pipe_or.status());
  auto& pipe = **pipe_or;
  bool pending[2] = {false, false};
  int slot = 0;
  for (uint64_t c0 = e0; c0 < e1; c0 += chunk, slot ^= 1) {
    const uint64_t c1 = std::min(e1, c0 + chunk);
    Chunk plan;
    if (c0 == e0 && first != nullptr) {
      plan = *first;
    } else {
      RETURN_IF_ERROR(PlanChunk(t, frags, view, out, e0, c0, c1, !gpu, base, &plan));
    }
    if (pending[slot]) {
      pending[slot] = false;
      Status w = pipe.Wait(slot);
      if (!w.ok()) return dev(w);
    }
    for (uint32_t fid : plan.files) {
      Status s = CheckFd(FileId{fid});
      if (!s.ok()) return fail(s);
    }
    auto staging = pipe.Staging(slot, plan.staging);
    if (!staging.ok()) return dev(staging.status());
    for (const Chunk::ItemCopy& c : plan.items)
      std::memcpy(*staging + c.staging_off, c.item->data() + c.offset, c.length);
    for (auto [ri, off] : plan.staged) plan.reqs[ri].dst = *staging + off;
    Status io = ReadSource(plan.reqs);
    if (!io.ok()) return fail(io);
    if (plan.ops.empty()) continue;
    Status sub = pipe.Submit(slot, plan.staging, plan.ops, out, base, out_len);
    if (!sub.ok()) return dev(sub);
    pending[slot] = true;
  }
  for (int s = 0; s < 2; ++s) {
    if (!pending[s]) continue;
    Status w = pipe.Wait(s);
    if (!w.ok()) return dev(w);
  }
  return Status::Ok();
}

Status TensorReader::Stream(TensorId id, DType out, const Box* box,
                            const std::function<void(const char*, size_t)>& fn) {
  const TensorRecord& t = index_.tensors()[id.v];
  const uint64_t numel = box != nullptr ? static_cast<uint64_t>(NumelOf(box->lengths)) : t.Numel();
  const uint64_t size = t.encoding == Encoding::kBytes ? t.byte_size : numel * DTypeSize(out);
  std::string buf;
  for (uint64_t off = 0; off < size; off += kHashChunk) {
    const uint64_t n = std::min(kHashChunk, size - off);
    buf.resize(n);
    RETURN_IF_ERROR(ReadBox(id, out, box, off, n, buf.data()));
    fn(buf.data(), n);
  }
  return Status::Ok();
}

Result<uint64_t> TensorReader::Xxh3Raw(TensorId id, const Box* box) {
  if (id.v >= index_.tensors().size()) return NotFound("no tensor " + std::to_string(id.v));
  const std::string key = std::to_string(id.v) + (box != nullptr ? BoxString(*box) : std::string());
  {
    std::lock_guard<std::mutex> lock(hash_mu_);
    auto it = hash_cache_.find(key);
    if (it != hash_cache_.end()) return it->second;
  }
  const TensorRecord& t = index_.tensors()[id.v];
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(st.get());
  RETURN_IF_ERROR(Stream(id, t.encoding == Encoding::kBytes ? DType::kU8 : t.dtype, box,
                         [&](const char* p, size_t n) { XXH3_64bits_update(st.get(), p, n); }));
  const uint64_t h = XXH3_64bits_digest(st.get());
  std::lock_guard<std::mutex> lock(hash_mu_);
  hash_cache_[key] = h;
  return h;
}

Result<uint32_t> TensorReader::Crc32(TensorId id, DType out, const std::vector<Box>& boxes) {
  if (id.v >= index_.tensors().size()) return NotFound("no tensor " + std::to_string(id.v));
  std::string key = std::to_string(id.v) + ":" + std::to_string(static_cast<int>(out));
  for (const Box& b : boxes) key += BoxString(b);
  {
    std::lock_guard<std::mutex> lock(hash_mu_);
    auto it = crc_cache_.find(key);
    if (it != crc_cache_.end()) return it->second;
  }
  uint32_t crc = 0;
  auto update = [&](const char* p, size_t n) { crc = Crc32Update(crc, p, n); };
  // A plain copy of source bytes is summed straight from the sources'
  // mappings (the bytes are then served from the same pages without a copy);
  // anything else is rendered in chunks.
  auto sum = [&](const Box* box) -> Status {
    const TensorRecord& t = index_.tensors()[id.v];
    const uint64_t numel = box != nullptr ? static_cast<uint64_t>(NumelOf(box->lengths)) : t.Numel();
    const uint64_t size = t.encoding == Encoding::kBytes ? t.byte_size : numel * DTypeSize(out);
    thread_local std::vector<SourceSpan> spans;
    if (!SigbusGuardInstalled() || !PlanCopy(id, out, box, 0, size, kCrcMaxSpans, &spans))
      return Stream(id, out, box, update);
    // The kernel is asked for all of it first (large reads, started at once:
    // a cold mapping read by faults alone waits on each read-around). Then
    // in groups of at most kCrcPiece bytes (a span longer than a mapping
    // window allows is cut), so a group pins a few windows.
    AskAhead(spans);
    thread_local std::vector<SourceSpan> group;
    group.clear();
    uint64_t bytes = 0;
    for (const SourceSpan& sp : spans) {
      for (uint64_t o = 0; o < sp.length; o += kCrcPiece) {
        group.push_back(SourceSpan{sp.file, sp.offset + o, std::min(kCrcPiece, sp.length - o)});
        bytes += group.back().length;
        if (bytes >= kCrcPiece || group.size() >= 4096) {
          RETURN_IF_ERROR(CrcMapped(group, &crc));
          group.clear();
          bytes = 0;
        }
      }
    }
    return group.empty() ? Status::Ok() : CrcMapped(group, &crc);
  };
  if (boxes.empty()) RETURN_IF_ERROR(sum(nullptr));
  for (const Box& b : boxes) RETURN_IF_ERROR(sum(&b));
  std::lock_guard<std::mutex> lock(hash_mu_);
  crc_cache_[key] = crc;
  return crc;
}

}  // namespace ckptfs
