#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "ckptfs/io.h"
#include "formats/zstd.h"

namespace ckptfs {
namespace {

constexpr size_t kFragCacheTensors = 4096;
constexpr uint64_t kItemCacheBytes = 64ull << 20;
constexpr uint64_t kHashChunk = 8ull << 20;

// Output bytes per pipeline chunk: one plan, one staging fill, one transform
// submission (one kernel launch on the GPU). FUSE reads fit in one chunk.
constexpr uint64_t kChunkBytes = 16ull << 20;

// Appends `op`, split along its outer dims while its rank is over what a
// GatherOp holds (tensors of more than 8 dims that do not coalesce).
void PushOp(GatherOp op, const std::vector<int64_t>& len, const std::vector<int64_t>& sstr,
            const std::vector<int64_t>& dstr, size_t from, uint64_t ssz, uint64_t dsz, std::vector<GatherOp>& ops) {
  if (len.size() - from > static_cast<size_t>(kMaxGatherDims)) {
    for (int64_t i = 0; i < len[from]; ++i) {
      GatherOp sub = op;
      sub.src_off += static_cast<uint64_t>(i * sstr[from]) * ssz;
      sub.dst_off += static_cast<uint64_t>(i * dstr[from]) * dsz;
      PushOp(sub, len, sstr, dstr, from + 1, ssz, dsz, ops);
    }
    return;
  }
  op.rank = static_cast<uint8_t>(len.size() - from);
  for (size_t d = from; d < len.size(); ++d) {
    op.len[d - from] = len[d], op.sstr[d - from] = sstr[d], op.dstr[d - from] = dstr[d];
  }
  ops.push_back(op);
}

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

}  // namespace

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

Status TensorReader::CheckFd(FileId file) const {
  const SourceFile& sf = index_.files()[file.v];
  int fd = fds_[file.v];
  if (fd < 0) return IoError(open_errors_[file.v]);  // a missing shard: EIO on read, not ENOENT
  struct stat st {};
  const std::string path = index_.src_dir() + "/" + sf.rel_path;
  if (::fstat(fd, &st) != 0) return ErrnoStatus("stat", path, errno);
  Status s = CompareFingerprint(path, sf, &st);
  // The fd still names the inode that was indexed; a file replaced at the
  // path since (rename over it) is stale for every reader, including those
  // that opened their file before the replacement. The path lookup is a
  // metadata RPC on parallel filesystems: at most one per file per second.
  const int64_t now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  std::atomic<int64_t>& last = path_checked_ns_[file.v];
  if (s.ok() && now_ns - last.load(std::memory_order_relaxed) >= 1'000'000'000) {
    struct stat now {};
    if (::stat(path.c_str(), &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
      s = Stale(path + " was replaced or removed after indexing");
    } else {
      last.store(now_ns, std::memory_order_relaxed);
    }
  }
  return s.ok() ? s : Stale(s.message() + "; remount to rebuild the index");
}

Status TensorReader::CheckChecksum(const ChecksumRange& c, bool remember_good) {
  const std::pair<uint32_t, uint64_t> key(c.file.v, c.offset);
  {
    std::lock_guard<std::mutex> lock(range_mu_);
    if (good_ranges_.count(key)) return Status::Ok();
    if (auto it = failed_ranges_.find(key); it != failed_ranges_.end()) return Invalid(it->second.why);
  }
  if (c.file.v >= index_.files().size()) return Internal("checksum range names an unknown file");
  RETURN_IF_ERROR(CheckFd(c.file));
  const std::string& rel = index_.files()[c.file.v].rel_path;
  constexpr uint64_t kPiece = 4 << 20;
  std::string buf(static_cast<size_t>(std::min(kPiece, c.length)), '\0');
  uLong crc = crc32_z(0, Z_NULL, 0);
  for (uint64_t off = 0; off < c.length; off += kPiece) {
    const uint64_t n = std::min(kPiece, c.length - off);
    IoRequest req{fds_[c.file.v], c.offset + off, n, buf.data()};
    RETURN_IF_ERROR(ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel));
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<z_size_t>(n));
  }
  std::lock_guard<std::mutex> lock(range_mu_);
  if (static_cast<uint32_t>(crc) == c.crc32) {
    if (remember_good) good_ranges_.insert(key);
    return Status::Ok();
  }
  char why[160];
  std::snprintf(why, sizeof why,
                ": ZIP entry '%.60s' (bytes %llu..%llu) fails its CRC-32 (recorded %08x, computed %08x)",
                c.name.c_str(), static_cast<unsigned long long>(c.offset),
                static_cast<unsigned long long>(c.offset + c.length), c.crc32, static_cast<uint32_t>(crc));
  FailedRange& f = failed_ranges_[key];
  f.length = c.length;
  f.why = "cannot read " + rel + why;
  any_bad_range_ = true;
  return Invalid(f.why);
}

bool TensorReader::ChecksumFailed(const ChecksumRange& c) {
  std::lock_guard<std::mutex> lock(range_mu_);
  return failed_ranges_.count({c.file.v, c.offset}) > 0;
}

Status TensorReader::CheckRanges(const std::vector<Fragment>& frags) {
  for (const Fragment& f : frags) {
    if (f.compression != Compression::kNone) continue;
    const uint64_t lo = f.data_offset, hi = f.data_offset + f.data_length;
    if (verify_on_read_) {
      ASSIGN_OR_RETURN(std::vector<ChecksumRange> sums, index_.ChecksumsIn(f.file, lo, hi));
      for (const ChecksumRange& c : sums) RETURN_IF_ERROR(CheckChecksum(c));
      continue;
    }
    // Only the ranges found bad so far (by verify or an earlier check) matter.
    std::lock_guard<std::mutex> lock(range_mu_);
    auto it = failed_ranges_.lower_bound({f.file.v, lo});
    if (it != failed_ranges_.begin()) {
      auto prev = std::prev(it);
      if (prev->first.first == f.file.v && prev->first.second + prev->second.length > lo)
        return Invalid(prev->second.why);
    }
    if (it != failed_ranges_.end() && it->first.first == f.file.v && it->first.second < hi)
      return Invalid(it->second.why);
  }
  return Status::Ok();
}

Status TensorReader::CheckFresh(TensorId id) {
  if (id.v >= index_.tensors().size()) return Status::Ok();
  // A broken entry fails at open: its file may be 0 bytes long (a bytes
  // item whose size is unknown), and a read of 0 bytes never reaches us.
  if (const TensorRecord& t = index_.tensors()[id.v]; !t.error.empty()) {
    return Invalid("cannot read '" + t.key + "': " + t.error);
  }
  ASSIGN_OR_RETURN(auto frags, FragmentsOf(id));
  std::vector<SourceFile> files;
  std::set<uint32_t> seen;
  for (const auto& f : *frags) {
    if (seen.insert(f.file.v).second) files.push_back(index_.files()[f.file.v]);
  }
  Status s = CheckFingerprint(index_.src_dir(), files);
  if (!s.ok()) return Stale(s.message() + "; remount to rebuild the index");
  return Status::Ok();
}

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

Result<std::shared_ptr<const std::string>> TensorReader::Item(const Fragment& f) {
  std::string key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  {
    std::lock_guard<std::mutex> lock(item_mu_);
    for (auto it = item_cache_.begin(); it != item_cache_.end(); ++it) {
      if (it->first == key) {
        auto v = it->second;
        item_cache_.erase(it);
        item_cache_.emplace_back(key, v);
        return v;
      }
    }
  }
  const std::string& rel = index_.files()[f.file.v].rel_path;
  RETURN_IF_ERROR(CheckFd(f.file));
  std::string raw(f.item_length, '\0');
  IoRequest req{fds_[f.file.v], f.item_offset, f.item_length, raw.data()};
  RETURN_IF_ERROR(ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel));
  // The index says how many bytes the item holds; more is a bomb, refused
  // before allocating when the frame declares its size.
  uint64_t bound = 0;
  if (AddOverflow(f.data_offset, f.data_length, &bound) || AddOverflow(bound, uint64_t{1} << 20, &bound)) {
    return Invalid("cannot read " + rel + ": bad item bounds");
  }
  ASSIGN_OR_RETURN(std::string plain, formats::ZstdDecompress(raw, bound, rel + " @ " + std::to_string(f.item_offset)));
  auto v = std::make_shared<const std::string>(std::move(plain));
  std::lock_guard<std::mutex> lock(item_mu_);
  item_cache_.emplace_back(key, v);
  item_cache_bytes_ += v->size();
  while (item_cache_bytes_ > kItemCacheBytes && item_cache_.size() > 1) {
    item_cache_bytes_ -= item_cache_.front().second->size();
    item_cache_.erase(item_cache_.begin());
  }
  return v;
}

Result<std::pair<std::shared_ptr<const std::string>, uint64_t>> TensorReader::ItemSpan(const Fragment& f, uint64_t off,
                                                                                       uint64_t len) {
  const std::string& rel = index_.files()[f.file.v].rel_path;
  const std::string what = rel + " @ " + std::to_string(f.item_offset);
  uint64_t bound = 0, end = 0;
  if (AddOverflow(f.data_offset, f.data_length, &bound) || AddOverflow(off, len, &end) || end > bound) {
    return Invalid("cannot read " + what + ": range past the item");
  }
  if (bound <= stream_items_above_) {
    ASSIGN_OR_RETURN(auto item, Item(f));
    if (end > item->size()) {
      return Invalid("cannot read " + what + ": the item holds " + std::to_string(item->size()) +
                     " bytes, the metadata needs " + std::to_string(end));
    }
    return std::make_pair(std::move(item), off);
  }
  RETURN_IF_ERROR(CheckFd(f.file));
  const std::string key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  std::unique_ptr<formats::ZstdCursor> cur;
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    for (auto it = cursors_.begin(); it != cursors_.end(); ++it) {
      if (it->first == key && it->second->position() <= off) {
        cur = std::move(it->second);
        cursors_.erase(it);
        break;
      }
    }
  }
  if (cur == nullptr) {
    const int fd = fds_[f.file.v];
    const uint64_t base = f.item_offset;
    cur = std::make_unique<formats::ZstdCursor>(
        [this, fd, base, rel](uint64_t o, uint64_t n, char* dst) {
          IoRequest req{fd, base + o, n, dst};
          return ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel);
        },
        f.item_length, bound + (uint64_t{1} << 20), what);
  }
  auto bytes = cur->Read(off, len);
  if (!bytes.ok()) return bytes.status();
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    cursors_.emplace_back(key, std::move(cur));
    if (cursors_.size() > 8) cursors_.erase(cursors_.begin());
  }
  return std::make_pair(std::make_shared<const std::string>(std::move(bytes).value()), uint64_t{0});
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
    if (f.compression == Compression::kZstd) {
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

namespace {

// dst[j][c0 + i] = src[i][j] for an [h, w] C-order block of T elements,
// into rows of `stride` elements. In 64 x 64 tiles: a row-by-row walk writes
// each element to another cache line (rows of a transposed weight are
// kilobytes apart), which made the transpose, not the I/O, the cost of a read.
template <typename T>
void TransposeBlock(const char* src_bytes, uint64_t h, uint64_t w, char* dst_bytes, uint64_t stride, uint64_t c0) {
  constexpr uint64_t kTile = 64;
  const T* src = reinterpret_cast<const T*>(src_bytes);
  T* dst = reinterpret_cast<T*>(dst_bytes);
  for (uint64_t i0 = 0; i0 < h; i0 += kTile) {
    const uint64_t i1 = std::min(h, i0 + kTile);
    for (uint64_t j0 = 0; j0 < w; j0 += kTile) {
      const uint64_t j1 = std::min(w, j0 + kTile);
      for (uint64_t j = j0; j < j1; ++j) {
        T* d = dst + j * stride + c0;
        const T* s = src + j;
        for (uint64_t i = i0; i < i1; ++i) d[i] = s[i * w];
      }
    }
  }
}

}  // namespace

Result<std::shared_ptr<const TensorReader::TransposedSlab>> TensorReader::Slab(TensorId id, DType out,
                                                                               const std::vector<Box>& rows,
                                                                               uint64_t r0, uint64_t r1,
                                                                               uint64_t total) {
  auto same = [&](const TransposedSlab& s) {
    return s.id.v == id.v && s.out == out && s.r0 == r0 && s.r1 == r1 && s.rows == rows;
  };
  std::shared_ptr<const TransposedSlab> hit;
  {
    std::lock_guard<std::mutex> lock(slab_mu_);
    for (size_t i = 0; i < slabs_.size(); ++i) {
      if (!same(*slabs_[i])) continue;
      hit = slabs_[i];
      std::rotate(slabs_.begin(), slabs_.begin() + static_cast<std::ptrdiff_t>(i),
                  slabs_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      break;
    }
  }
  if (hit) {  // read before: its sources must still be the indexed ones
    ASSIGN_OR_RETURN(auto frags, FragmentsOf(id));
    std::set<uint32_t> seen;
    for (const Fragment& f : *frags) {
      if (seen.insert(f.file.v).second) RETURN_IF_ERROR(CheckFd(f.file));
    }
    return hit;
  }
  auto slab = std::make_shared<TransposedSlab>();
  {
    std::lock_guard<std::mutex> lock(slab_mu_);
    slab->bytes.swap(spare_slab_bytes_);  // an evicted slab's pages: no fresh page faults
  }
  slab->id = id;
  slab->out = out;
  slab->rows = rows;
  slab->r0 = r0;
  slab->r1 = r1;
  const uint64_t osz = DTypeSize(out), w = r1 - r0;
  slab->bytes.resize(w * total * osz);
  // A FUSE worker's scratch (at most one slab, ~4 MiB), kept between reads:
  // a fresh one costs its page faults on every slab.
  thread_local std::vector<char> block;
  uint64_t c0 = 0;
  for (const Box& b : rows) {
    const uint64_t h = static_cast<uint64_t>(b.lengths[0]);
    if (h == 0) continue;
    const Box sub{{b.offsets[0], static_cast<int64_t>(r0)}, {b.lengths[0], static_cast<int64_t>(w)}};
    block.resize(h * w * osz);
    RETURN_IF_ERROR(ReadBox(id, out, &sub, 0, block.size(), block.data()));
    char* dst = slab->bytes.data();
    switch (osz) {
      case 1:
        TransposeBlock<uint8_t>(block.data(), h, w, dst, total, c0);
        break;
      case 2:
        TransposeBlock<uint16_t>(block.data(), h, w, dst, total, c0);
        break;
      case 4:
        TransposeBlock<uint32_t>(block.data(), h, w, dst, total, c0);
        break;
      default:
        TransposeBlock<uint64_t>(block.data(), h, w, dst, total, c0);
        break;
    }
    c0 += h;
  }
  std::lock_guard<std::mutex> lock(slab_mu_);
  slabs_.insert(slabs_.begin(), slab);
  if (slabs_.size() > kTransposedSlabs) {
    if (slabs_.back().use_count() == 1) spare_slab_bytes_.swap(slabs_.back()->bytes);
    slabs_.pop_back();
  }
  return std::shared_ptr<const TransposedSlab>(slab);
}

Status TensorReader::ReadTransposedRows(TensorId id, DType out, const std::vector<Box>& rows, uint64_t offset,
                                        uint64_t len, char* dst) {
  if (id.v >= index_.tensors().size()) return Internal("tensor id out of range");
  const TensorRecord& t = index_.tensors()[id.v];
  const uint64_t osz = DTypeSize(out);
  if (t.shape.size() != 2 || rows.empty() || (osz != 1 && osz != 2 && osz != 4 && osz != 8)) {
    return Internal("cannot transpose '" + t.key + "': not rows of a 2-D tensor of a 1-, 2-, 4- or 8-byte type");
  }
  const int64_t cols = t.shape[1];
  uint64_t total = 0;  // rows of the concatenation: the transpose's row length
  for (const Box& b : rows) {
    if (b.offsets.size() != 2 || b.lengths.size() != 2 || b.offsets[1] != 0 || b.lengths[1] != cols ||
        b.lengths[0] < 0 || b.offsets[0] < 0 || b.offsets[0] + b.lengths[0] > t.shape[0]) {
      return Internal("box " + BoxString(b) + " is not whole rows of '" + t.key + "'");
    }
    total += static_cast<uint64_t>(b.lengths[0]);
  }
  if (len == 0) return Status::Ok();
  const uint64_t row_bytes = total * osz;
  if (row_bytes == 0 || offset + len > static_cast<uint64_t>(cols) * row_bytes) {
    return Invalid("cannot read '" + t.key + "': range past the transposed tensor");
  }
  // Output rows (source columns) in fixed slabs of about 4 MiB: slab k holds
  // rows [k * step, (k + 1) * step), so consecutive requests find theirs kept.
  const uint64_t step = std::max<uint64_t>(1, (4ull << 20) / row_bytes), end = offset + len;
  for (uint64_t k = offset / row_bytes / step; k * step * row_bytes < end; ++k) {
    const uint64_t r0 = k * step, r1 = std::min<uint64_t>(static_cast<uint64_t>(cols), r0 + step);
    ASSIGN_OR_RETURN(auto slab, Slab(id, out, rows, r0, r1, total));
    const uint64_t lo = std::max(offset, r0 * row_bytes), hi = std::min(end, r1 * row_bytes);
    std::memcpy(dst + (lo - offset), slab->bytes.data() + (lo - r0 * row_bytes), hi - lo);
  }
  return Status::Ok();
}

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
  if (target.kernels_trusted) {
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

namespace {

// One intersection of a fragment with a box of the view, dims of length 1
// dropped and dims that step over each other merged: `len` elements per
// dim, `sstr` / `dstr` their strides in the fragment's storage and in the
// output (elements), from source byte `src_byte` of the fragment (relative to
// its data_offset) and output element `dst_elem` (relative to element e0).
struct Piece {
  const Fragment* f = nullptr;
  uint64_t src_byte = 0, span_bytes = 0, dst_elem = 0;
  std::vector<int64_t> len, sstr, dstr;
};

// Calls fn(piece) for each intersection of the view's elements [c0, c1)
// with a fragment; checks each piece lies in its fragment's storage and that
// the fragments cover every element (a hole is an error, never zeros).
template <typename Fn>
Status VisitPieces(const Index& index, const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view,
                   uint64_t e0, uint64_t c0, uint64_t c1, Fn&& fn) {
  const size_t rank = t.shape.size();
  const std::vector<int64_t> gstr = ContiguousStrides(view.lengths);
  uint64_t covered = 0;
  Piece p;
  std::vector<int64_t> lo(rank), hi(rank);
  for (Box b : DecomposeRange(view.lengths, c0, c1)) {
    for (size_t d = 0; d < rank; ++d) b.offsets[d] += view.offsets[d];
    for (const Fragment& f : frags) {
      bool empty = false;
      uint64_t count = 1;
      for (size_t d = 0; d < rank; ++d) {
        lo[d] = std::max(b.offsets[d], f.offsets[d]);
        hi[d] = std::min(b.offsets[d] + b.lengths[d], f.offsets[d] + f.lengths[d]);
        if (lo[d] >= hi[d])
          empty = true;
        else
          count *= static_cast<uint64_t>(hi[d] - lo[d]);
      }
      if (empty) continue;
      covered += count;
      int64_t src_elem = 0, dst_elem = -static_cast<int64_t>(e0);
      p.len.clear();
      p.sstr.clear();
      p.dstr.clear();
      for (size_t d = 0; d < rank; ++d) {
        src_elem += (lo[d] - f.offsets[d]) * f.strides[d];
        dst_elem += (lo[d] - view.offsets[d]) * gstr[d];
        if (hi[d] - lo[d] == 1) continue;
        int64_t l = hi[d] - lo[d];
        // Merge into the previous dim when it steps exactly over this one.
        if (!p.len.empty() && p.sstr.back() == f.strides[d] * l && p.dstr.back() == gstr[d] * l) {
          p.len.back() *= l;
          p.sstr.back() = f.strides[d];
          p.dstr.back() = gstr[d];
        } else {
          p.len.push_back(l);
          p.sstr.push_back(f.strides[d]);
          p.dstr.push_back(gstr[d]);
        }
      }
      const uint64_t esz = DTypeSize(f.dtype);
      uint64_t span = 1;
      for (size_t d = 0; d < p.len.size(); ++d) span += static_cast<uint64_t>((p.len[d] - 1) * p.sstr[d]);
      p.f = &f;
      p.src_byte = static_cast<uint64_t>(src_elem) * esz;
      p.span_bytes = span * esz;
      p.dst_elem = static_cast<uint64_t>(dst_elem);
      if (p.src_byte + p.span_bytes > f.data_length) {
        return Invalid("cannot read '" + t.key + "': fragment in " + index.files()[f.file.v].rel_path +
                       " is shorter than its shape (index corrupt?)");
      }
      RETURN_IF_ERROR(fn(p));
    }
  }
  if (covered != c1 - c0) {
    return Invalid("cannot read '" + t.key + "': " + std::to_string(c1 - c0 - covered) +
                   " requested elements are in no fragment (a hole in the checkpoint)");
  }
  return Status::Ok();
}

}  // namespace

// Elements [c0, c1) of the view's C order (output offsets relative to
// element `e0`). `direct`: contiguous same-dtype pieces read straight into
// `base` instead of through staging and an op (the CPU's fast path; the GPU
// writes whole output ranges back and so stages everything).
Status TensorReader::PlanChunk(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                               uint64_t e0, uint64_t c0, uint64_t c1, bool direct, char* base, Chunk* plan) {
  const uint64_t osz = DTypeSize(out);
  return VisitPieces(index_, t, frags, view, e0, c0, c1, [&](const Piece& p) -> Status {
    const Fragment& f = *p.f;
    const uint64_t dst_off = p.dst_elem * osz;
    const bool contiguous = p.len.size() <= 1 && (p.len.empty() || (p.sstr[0] == 1 && p.dstr[0] == 1));
    if (direct && contiguous && f.dtype == out && f.compression == Compression::kNone) {
      plan->files.insert(f.file.v);
      plan->reqs.push_back(IoRequest{fds_[f.file.v], f.data_offset + p.src_byte, p.span_bytes, base + dst_off});
      return Status::Ok();
    }
    // Staged: 16-byte aligned, so the GPU can use typed loads.
    plan->staging = (plan->staging + 15) & ~15ull;
    GatherOp op;
    op.src_off = plan->staging;
    op.dst_off = dst_off;
    op.sdtype = f.dtype;
    PushOp(op, p.len, p.sstr, p.dstr, 0, DTypeSize(f.dtype), osz, plan->ops);
    if (f.compression == Compression::kZstd) {
      auto span = ItemSpan(f, f.data_offset + p.src_byte, p.span_bytes);
      if (!span.ok()) return span.status().Annotate("cannot read '" + t.key + "'");
      plan->items.push_back(Chunk::ItemCopy{span->first, span->second, p.span_bytes, plan->staging});
    } else {
      plan->files.insert(f.file.v);
      plan->staged.emplace_back(plan->reqs.size(), plan->staging);
      plan->reqs.push_back(IoRequest{fds_[f.file.v], f.data_offset + p.src_byte, p.span_bytes, nullptr});
    }
    plan->staging += p.span_bytes;
    return Status::Ok();
  });
}

// The rows of the elements that output bytes [offset, offset + len) of the
// view (`box`, null: the whole tensor) rendered at `osz` bytes each fall in,
// [*e0, e1), as (output element relative to *e0, source span), sorted by
// output element: false unless every piece is an uncompressed run of dtype
// `src`, contiguous in its innermost dimension, in at most `max_spans` rows,
// and the rows tile [*e0, e1) exactly (PlanCopy, PlanConvert).
bool TensorReader::CollectRuns(TensorId id, DType src, uint64_t osz, const Box* box, uint64_t offset, uint64_t len,
                               size_t max_spans, std::vector<std::pair<uint64_t, SourceSpan>>* runs, uint64_t* e0_out) {
  const TensorRecord& t = index_.tensors()[id.v];
  Box whole;
  auto view_or = ViewOf(t, box, &whole);
  if (osz == 0 || !view_or.ok()) return false;
  const Box& view = **view_or;
  if (offset + len > static_cast<uint64_t>(NumelOf(view.lengths)) * osz) return false;
  const auto frags_ptr = SpanFragments(id);
  if (frags_ptr == nullptr) return false;
  const std::vector<Fragment>& frags = *frags_ptr;
  const uint64_t e0 = offset / osz, e1 = (offset + len + osz - 1) / osz;
  *e0_out = e0;
  runs->clear();
  const uint64_t isz = DTypeSize(src);
  std::vector<int64_t> idx;
  Status s = VisitPieces(index_, t, frags, view, e0, e0, e1, [&](const Piece& p) -> Status {
    const Fragment& f = *p.f;
    const bool inner = p.len.empty() || (p.sstr.back() == 1 && p.dstr.back() == 1);
    if (f.dtype != src || f.compression != Compression::kNone || !inner)
      return Unsupported("not a run of source bytes");
    const size_t outer = p.len.empty() ? 0 : p.len.size() - 1;
    uint64_t rows = 1;
    for (size_t d = 0; d < outer; ++d) rows *= static_cast<uint64_t>(p.len[d]);
    if (runs->size() + rows > max_spans) return Unsupported("too many spans");
    const uint64_t run = p.len.empty() ? 1 : static_cast<uint64_t>(p.len.back());
    idx.assign(outer, 0);
    int64_t so = 0, dso = 0;  // element offsets of the current row
    for (uint64_t r = 0; r < rows; ++r) {
      runs->emplace_back(p.dst_elem + static_cast<uint64_t>(dso),
                         SourceSpan{f.file.v, f.data_offset + p.src_byte + static_cast<uint64_t>(so) * isz, run * isz});
      for (size_t d = outer; d-- > 0;) {  // next row: odometer over the outer dims
        so += p.sstr[d];
        dso += p.dstr[d];
        if (++idx[d] < p.len[d]) break;
        so -= p.sstr[d] * p.len[d];
        dso -= p.dstr[d] * p.len[d];
        idx[d] = 0;
      }
    }
    return Status::Ok();
  });
  if (!s.ok()) return false;
  std::sort(runs->begin(), runs->end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t at = 0;
  for (const auto& [dst, sp] : *runs) {
    if (dst != at) return false;  // overlapping fragments: not a plain tiling
    at += sp.length / isz;
  }
  return at == e1 - e0;
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

namespace {

// Appends `sp`, joined to the last span when it continues it in the same file.
void AppendSpan(std::vector<SourceSpan>* spans, const SourceSpan& sp) {
  if (!spans->empty() && spans->back().file == sp.file && spans->back().offset + spans->back().length == sp.offset) {
    spans->back().length += sp.length;
  } else {
    spans->push_back(sp);
  }
}

}  // namespace

bool TensorReader::PlanCopy(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                            std::vector<SourceSpan>* spans) {
  spans->clear();
  if (id.v >= index_.tensors().size()) return false;
  const TensorRecord& t = index_.tensors()[id.v];
  // What is never a copy is declined before the fragments are looked up:
  // widened and narrowed reads ask first on every request.
  const bool bytes = t.encoding == Encoding::kBytes;
  if (!t.error.empty() || t.replicas > 1 || (!bytes && out != t.dtype)) return false;
  if (len == 0) return true;
  if (bytes) {
    const auto frags = SpanFragments(id);
    if (frags == nullptr) return false;
    const Fragment& f = (*frags)[0];
    if (frags->size() != 1 || f.compression != Compression::kNone || offset + len > f.data_length || max_spans == 0) {
      return false;
    }
    spans->push_back(SourceSpan{f.file.v, f.data_offset + offset, len});
    return true;
  }
  const uint64_t osz = DTypeSize(out);
  thread_local std::vector<std::pair<uint64_t, SourceSpan>> runs;
  uint64_t e0 = 0;
  if (!CollectRuns(id, out, osz, box, offset, len, max_spans, &runs, &e0)) return false;
  // The runs tile [0, (e1 - e0) * osz); keep [offset - e0 * osz, + len).
  const uint64_t head = offset - e0 * osz, tail = head + len;
  for (const auto& [elem, sp] : runs) {
    const uint64_t dst = elem * osz;
    const uint64_t lo = std::max(dst, head), hi = std::min(dst + sp.length, tail);
    if (lo < hi) AppendSpan(spans, SourceSpan{sp.file, sp.offset + (lo - dst), hi - lo});
  }
  return true;
}

bool TensorReader::PlanConvert(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                               ConvertPlan* plan) {
  plan->spans.clear();
  if (id.v >= index_.tensors().size()) return false;
  const TensorRecord& t = index_.tensors()[id.v];
  if (!t.error.empty() || t.replicas > 1 || t.encoding == Encoding::kBytes || out == t.dtype ||
      !CanConvert(t.dtype, out) || len == 0 || DTypeSize(t.dtype) == 0) {
    return false;
  }
  const uint64_t osz = DTypeSize(out);
  thread_local std::vector<std::pair<uint64_t, SourceSpan>> runs;
  uint64_t e0 = 0;
  if (!CollectRuns(id, t.dtype, osz, box, offset, len, max_spans, &runs, &e0)) return false;
  for (const auto& [elem, sp] : runs) AppendSpan(&plan->spans, sp);
  plan->src = t.dtype;
  plan->out = out;
  plan->skip = offset - e0 * osz;
  plan->len = len;
  return true;
}

namespace {

// ConvertMapped's work, run under RunGuarded: nothing here locks or
// allocates, so a fault may leave it at any point.
struct MappedConversion {
  const std::vector<iovec>* pieces;
  DType src, out;
  uint64_t skip, len;
  char* dst;

  static void Run(void* self) { static_cast<MappedConversion*>(self)->Convert(); }

  // Elements in order across the pieces; the first `skip` output bytes and
  // everything past `len` are dropped (a request need not start or end on an
  // element).
  void Convert() {
    const uint64_t isz = DTypeSize(src), osz = DTypeSize(out);
    uint64_t skip_left = skip, left = len;
    char* at = dst;
    char one[16];
    for (const iovec& p : *pieces) {
      const char* s = static_cast<const char*>(p.iov_base);
      uint64_t n = p.iov_len / isz;
      while (n > 0 && left > 0) {
        if (skip_left > 0 || left < osz) {  // a partial element: through `one`
          (void)ConvertRun(s, src, 1, one, out, 1);
          const uint64_t take = std::min(osz - skip_left, left);
          std::memcpy(at, one + skip_left, take);
          at += take;
          left -= take;
          skip_left = 0;
          s += isz;
          --n;
          continue;
        }
        const uint64_t whole = std::min(n, left / osz);
        (void)ConvertRun(s, src, 1, at, out, whole);
        at += whole * osz;
        left -= whole * osz;
        s += whole * isz;
        n -= whole;
      }
    }
  }
};

}  // namespace

Status TensorReader::ConvertMapped(const ConvertPlan& plan, char* dst) {
  if (!SigbusGuardInstalled()) return Internal("mapped conversions need InstallSigbusGuard()");
  thread_local MappedBytes mapped;
  mapped.Clear();
  Status s = MapSpans(plan.spans, &mapped);
  if (!s.ok()) {
    mapped.Clear();
    return s;
  }
  MappedConversion c{&mapped.pieces, plan.src, plan.out, plan.skip, plan.len, dst};
  const bool done = RunGuarded(&MappedConversion::Run, &c);
  mapped.Clear();  // unpins the windows
  if (!done) {
    return Stale(index_.src_dir() +
                 ": a source file was cut short while its bytes were read from a mapping; remount to "
                 "rebuild the index");
  }
  return Status::Ok();
}

TensorReader::MapWindow::~MapWindow() {
  if (base != nullptr) ::munmap(const_cast<char*>(base), length);
}

Result<std::shared_ptr<const TensorReader::MapWindow>> TensorReader::Window(uint32_t file, uint64_t index) {
  const uint64_t key = (uint64_t{file} << 32) | index;
  {
    std::lock_guard<std::mutex> lock(map_mu_);
    for (size_t i = windows_.size(); i-- > 0;) {
      if (windows_[i].first != key) continue;
      auto w = windows_[i].second;
      std::rotate(windows_.begin() + static_cast<std::ptrdiff_t>(i),
                  windows_.begin() + static_cast<std::ptrdiff_t>(i) + 1, windows_.end());
      return w;
    }
  }
  // Mapped outside the lock; two threads may map the same window, and the
  // later one replaces the earlier in the cache (both stay valid while used).
  const SourceFile& sf = index_.files()[file];
  auto w = std::make_shared<MapWindow>();
  w->start = index * kMapStep;
  if (w->start >= sf.size) return Internal("mapping past the end of " + sf.rel_path);
  w->length = std::min(kMapWindow, sf.size - w->start);
  void* m = ::mmap(nullptr, w->length, PROT_READ, MAP_SHARED, fds_[file], static_cast<off_t>(w->start));
  if (m == MAP_FAILED) return ErrnoStatus("mmap", index_.src_dir() + "/" + sf.rel_path, errno);
  w->base = static_cast<const char*>(m);
  std::lock_guard<std::mutex> lock(map_mu_);
  std::erase_if(windows_, [&](const auto& e) { return e.first == key; });
  windows_.emplace_back(key, w);
  if (windows_.size() > kMapWindows) windows_.erase(windows_.begin());
  return std::shared_ptr<const MapWindow>(w);
}

Status TensorReader::MapSpans(std::span<const SourceSpan> spans, MappedBytes* out) {
  // The files checked and the windows used by this call: a TP merge
  // alternates between a few files row by row.
  struct Used {
    uint32_t file;
    uint64_t index;
    const MapWindow* w;
  };
  Used used[16];
  size_t n_used = 0;
  uint32_t checked[16];
  size_t n_checked = 0;
  uint64_t bytes = 0;
  for (const SourceSpan& sp : spans) {
    if (sp.file >= index_.files().size()) return Internal("a span names an unknown file");
    const SourceFile& sf = index_.files()[sp.file];
    if (sp.length == 0) continue;
    if (sp.length > kMapWindow - kMapStep || sp.offset > sf.size || sp.length > sf.size - sp.offset) {
      return Internal("span " + std::to_string(sp.offset) + "+" + std::to_string(sp.length) +
                      " cannot be mapped from " + sf.rel_path);
    }
    if (std::find(checked, checked + n_checked, sp.file) == checked + n_checked) {
      RETURN_IF_ERROR(CheckFd(FileId{sp.file}));
      if (n_checked < std::size(checked)) checked[n_checked++] = sp.file;
    }
    const uint64_t index = sp.offset / kMapStep;
    const MapWindow* w = nullptr;
    for (size_t i = 0; i < n_used && w == nullptr; ++i) {
      if (used[i].file == sp.file && used[i].index == index) w = used[i].w;
    }
    if (w == nullptr) {
      ASSIGN_OR_RETURN(auto pin, Window(sp.file, index));
      w = pin.get();
      if (n_used < std::size(used)) used[n_used++] = Used{sp.file, index, w};
      out->pins.push_back(std::move(pin));
    }
    out->pieces.push_back(iovec{const_cast<char*>(w->base + (sp.offset - w->start)), sp.length});
    bytes += sp.length;
  }
  source_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  source_reads_.fetch_add(1, std::memory_order_relaxed);
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

Result<uint64_t> TensorReader::Xxh3Raw(TensorId id) {
  if (id.v >= index_.tensors().size()) return NotFound("no tensor " + std::to_string(id.v));
  {
    std::lock_guard<std::mutex> lock(hash_mu_);
    auto it = hash_cache_.find(id.v);
    if (it != hash_cache_.end()) return it->second;
  }
  const TensorRecord& t = index_.tensors()[id.v];
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(st.get());
  RETURN_IF_ERROR(Stream(id, t.encoding == Encoding::kBytes ? DType::kU8 : t.dtype, nullptr,
                         [&](const char* p, size_t n) { XXH3_64bits_update(st.get(), p, n); }));
  const uint64_t h = XXH3_64bits_digest(st.get());
  std::lock_guard<std::mutex> lock(hash_mu_);
  hash_cache_[id.v] = h;
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
  uLong crc = crc32(0L, Z_NULL, 0);
  auto update = [&](const char* p, size_t n) { crc = crc32_z(crc, reinterpret_cast<const Bytef*>(p), n); };
  if (boxes.empty()) RETURN_IF_ERROR(Stream(id, out, nullptr, update));
  for (const Box& b : boxes) RETURN_IF_ERROR(Stream(id, out, &b, update));
  std::lock_guard<std::mutex> lock(hash_mu_);
  crc_cache_[key] = static_cast<uint32_t>(crc);
  return static_cast<uint32_t>(crc);
}

}  // namespace ckptfs
