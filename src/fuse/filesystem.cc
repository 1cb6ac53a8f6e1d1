#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "ckptfs/fs.h"

namespace ckptfs {
namespace {

// Source spans one converted piece of a mapped read may take (a TP merge of
// a widened tensor is a span per row and shard: 2048 for a 1 MiB read of
// 128-element rows). The daemon walks them, not the kernel; a read of
// shorter runs goes through the engine, and each worker's plan stays small.
constexpr size_t kMaxConvertSpans = 1 << 12;

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Microseconds with one decimal: sub-microsecond reads (cached literals) are not 0.
std::string Micros(uint64_t ns) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", static_cast<double>(ns) / 1000.0);
  return b;
}

// Calls fn(segment, offset in it, byte count, offset in the request) for
// each segment of `layout` that bytes [offset, offset + size) overlap, in
// order, while fn returns true; false if fn stopped it. A kArchive segment is
// expanded into its archive's segments (`expand`; a failure goes to *err and
// stops it). `base`: where this layout's bytes start in the request.
using ArchiveExpander = std::function<Result<std::shared_ptr<const FileLayout>>(const Segment&)>;
template <typename Fn>
bool ForEachSegment(const FileLayout& layout, uint64_t offset, uint64_t size, const ArchiveExpander& expand,
                    Status* err, Fn&& fn, uint64_t base = 0) {
  // The first segment that ends after `offset`.
  size_t first =
      static_cast<size_t>(std::upper_bound(layout.starts.begin(), layout.starts.end(), offset) - layout.starts.begin());
  first = first == 0 ? 0 : first - 1;
  for (size_t si = first; si < layout.segments.size(); ++si) {
    const Segment& s = layout.segments[si];
    const uint64_t seg_start = layout.starts[si], seg_end = seg_start + s.size;
    const uint64_t lo = std::max(offset, seg_start), hi = std::min<uint64_t>(offset + size, seg_end);
    if (lo < hi) {
      if (s.kind == SegmentKind::kArchive) {
        auto sub = expand(s);
        if (!sub.ok()) {
          if (err != nullptr) *err = sub.status();
          return false;
        }
        if (!ForEachSegment(**sub, lo - seg_start, hi - lo, expand, err, fn, base + (lo - offset))) return false;
      } else if (!fn(s, lo - seg_start, hi - lo, base + (lo - offset))) {
        return false;
      }
    }
    if (seg_end >= offset + size) break;
  }
  return true;
}

// Bytes [in, in + n) of a segment whose elements are scaled and offset
// (hf/'s MaxText query kernels, Gemma's embedding and norms): the elements
// they overlap rendered as float32, then x * scale + add rounded once to the
// segment's dtype (ScaleFloats).
Status ReadScaled(TensorReader& reader, const Segment& s, uint64_t in, uint64_t n, char* dst) {
  const uint64_t osz = DTypeSize(s.out_dtype);
  const uint64_t e0 = in / osz, e1 = (in + n + osz - 1) / osz;
  thread_local std::vector<char> wide, out;  // at most a request's elements (FUSE: 1 MiB)
  wide.resize((e1 - e0) * 4);
  out.resize((e1 - e0) * osz);
  RETURN_IF_ERROR(
      s.transposed
          ? reader.ReadTransposedRows(s.tensor, DType::kF32, s.boxes, s.how(), e0 * 4, wide.size(), wide.data())
          : reader.ReadBox(s.tensor, DType::kF32, s.box_or_null(), e0 * 4, wide.size(), wide.data()));
  RETURN_IF_ERROR(ScaleFloats(wide.data(), e1 - e0, s.scale(), s.add(), s.out_dtype, out.data()));
  std::memcpy(dst, out.data() + (in - e0 * osz), n);
  return Status::Ok();
}

}  // namespace

Result<std::string> Filesystem::DigestBytes(const Segment& s) {
  if (s.kind == SegmentKind::kCrc32) {
    ASSIGN_OR_RETURN(uint32_t c, reader_->Crc32(s.tensor, s.out_dtype, s.boxes));
    std::string le(4, '\0');
    StoreLE<uint32_t>(le.data(), c);
    return le;
  }
  ASSIGN_OR_RETURN(uint64_t h, reader_->Xxh3Raw(s.tensor, s.box_or_null()));
  return Hex64(h);
}

void LatencyHistogram::Record(uint64_t ns) {
  const int b = ns == 0 ? 0 : std::bit_width(ns) - 1;
  buckets_[b].fetch_add(1, std::memory_order_relaxed);
  uint64_t m = max_ns_.load(std::memory_order_relaxed);
  while (ns > m && !max_ns_.compare_exchange_weak(m, ns, std::memory_order_relaxed)) {
  }
}

uint64_t LatencyHistogram::count() const {
  uint64_t n = 0;
  for (const auto& b : buckets_) n += b.load(std::memory_order_relaxed);
  return n;
}

uint64_t LatencyHistogram::PercentileNs(double q) const {
  uint64_t counts[kBuckets], n = 0;
  for (int i = 0; i < kBuckets; ++i) n += counts[i] = buckets_[i].load(std::memory_order_relaxed);
  if (n == 0) return 0;
  // The rank of the q-quantile, 1-based: ceil(q * n) (less a rounding
  // error's worth: 0.9 * 100 is 90, not 91), at least 1.
  const uint64_t want = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * static_cast<double>(n) - 1e-9)));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += counts[i];
    if (seen >= want) {
      const uint64_t upper = i >= 63 ? UINT64_MAX : (uint64_t{2} << i) - 1;
      return std::min(upper, max_ns());
    }
  }
  return max_ns();
}

Result<std::unique_ptr<Filesystem>> Filesystem::Open(const FsOptions& opts) {
  std::unique_ptr<Filesystem> fs(new Filesystem());
  // kArchive segments: each thread keeps the last few archives it laid out
  // (a sequential read of a 256 MiB item is hundreds of requests), keyed by
  // this filesystem's serial (never reused, unlike its address) and the
  // segment's address (layouts never move).
  static std::atomic<uint64_t> serials{0};
  const uint64_t serial = ++serials;
  const Filesystem* self = fs.get();  // owns the expander, so outlives it
  fs->expander_ = [serial, self](const Segment& s) -> Result<std::shared_ptr<const FileLayout>> {
    struct Kept {
      uint64_t serial;
      const Segment* seg;
      std::shared_ptr<const FileLayout> layout;
    };
    thread_local std::vector<Kept> kept;  // most recent last
    for (size_t i = 0; i < kept.size(); ++i) {
      if (kept[i].serial == serial && kept[i].seg == &s) {
        Kept k = std::move(kept[i]);
        kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
        kept.push_back(std::move(k));
        return kept.back().layout;
      }
    }
    ASSIGN_OR_RETURN(FileLayout l, self->view_->ArchiveLayout(s));
    kept.push_back(Kept{serial, &s, std::make_shared<const FileLayout>(std::move(l))});
    if (kept.size() > 4) kept.erase(kept.begin());
    return kept.back().layout;
  };
  fs->start_ns_ = SteadyNs();
  ASSIGN_OR_RETURN(fs->opened_, OpenOrBuild(opts.src, opts.index_dir, opts.force_rebuild, opts.family));
  fs->index_ = std::move(fs->opened_.index);
  ASSIGN_OR_RETURN(fs->view_, View::Build(*fs->index_, opts.topo));
  std::error_code ec;
  const std::string cache_dir = UserCacheDir();
  std::filesystem::create_directories(cache_dir, ec);  // no cache dir: calibrate at every mount
  ASSIGN_OR_RETURN(auto policy,
                   TransformPolicy::Make(opts.gpu, ec ? "" : cache_dir + "/gpu-calibration.json", opts.cuda));
  ASSIGN_OR_RETURN(fs->reader_, TensorReader::Open(*fs->index_, opts.engine, std::move(policy)));
  fs->reader_->set_verify_on_read(opts.verify_on_read);
  fs->mapped_reads_ = opts.mapped_reads;
  if (opts.read_ahead) {
    Filesystem* raw = fs.get();  // owns the read-ahead, so outlives its worker
    fs->read_ahead_ = std::make_unique<ReadAhead>(
        *fs->view_, [raw](uint64_t ino, uint64_t budget) { return raw->AskAhead(ino, budget); });
  }
  if (!fs->index_->files().empty()) fs->mtime_ns_ = fs->index_->files()[0].mtime_ns;
  return fs;
}

Attr Filesystem::AttrOf(const Node& n, uint64_t size) const {
  Attr a;
  a.ino = n.ino;
  a.is_dir = n.is_dir;
  a.size = size;
  a.mtime_ns = mtime_ns_;
  if (uint64_t changed = view_->ChangedNs(n.ino)) a.mtime_ns = changed;  // topo/ once it grew
  a.nlink = view_->NLink(n.ino);
  a.dynamic = view_->Dynamic(n.ino);
  return a;
}

Result<Report> Filesystem::Verify(const VerifyOptions& opts) const { return ckptfs::Verify(*index_, *reader_, opts); }

Result<std::shared_ptr<const std::string>> Filesystem::ReportBytes() const {
  std::lock_guard<std::mutex> lock(report_mu_);
  if (report_) return report_;
  LogInfo("verifying " + index_->src_dir() + " for .ckptfs/report.json");
  auto r = Verify(VerifyOptions{});
  if (!r.ok()) {
    LogError(".ckptfs/report.json: " + r.status().message());
    return r.status();
  }
  LogInfo("verified " + index_->src_dir() + ": " + std::to_string(r->findings.size()) + " finding(s), " +
          std::to_string(r->bytes_read) + " bytes read in " + std::to_string(r->seconds) + " s");
  report_ = std::make_shared<const std::string>(ReportJson(*r, *index_, /*timing=*/false));
  report_size_.store(report_->size(), std::memory_order_release);
  return report_;
}

Result<Attr> Filesystem::GetAttr(uint64_t ino) const {
  getattrs_.fetch_add(1, std::memory_order_relaxed);
  return AttrOfIno(ino);
}

Result<Attr> Filesystem::AttrOfIno(uint64_t ino) const {
  const Node* n = view_->Get(ino);
  if (n == nullptr) return NotFound("no inode " + std::to_string(ino));
  if (n->is_dir) return AttrOf(*n, 4096);
  if (n->stats) return AttrOf(*n, 0);  // like /proc: read it to the end, never trust the size
  if (n->report) {
    // A stat never runs the checks (du, find, ls -la, file managers and
    // backup tools stat everything): size 0 until the first open/read has
    // made the report, as /proc files do; reads are direct_io (Dynamic).
    return AttrOf(*n, report_size_.load(std::memory_order_acquire));
  }
  if (n->topo_errors) return AttrOf(*n, view_->TopoErrors().size());
  auto size = view_->Size(ino);  // an info.json's size without reading its fragments
  if (!size.ok()) {
    LogError(view_->PathOf(ino) + ": " + size.status().message());
    return size.status();
  }
  return AttrOf(*n, *size);
}

Result<Attr> Filesystem::Lookup(uint64_t parent, std::string_view name) const {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  const Node* n = view_->Lookup(parent, name);
  if (n == nullptr) return NotFound(std::string(name));
  return AttrOfIno(n->ino);
}

Status Filesystem::ReadTensor(TensorId id, DType out, const Box* box, char* dst, uint64_t len,
                              const DeviceTarget* device) {
  const auto& tensors = index_->tensors();
  if (id.v >= tensors.size()) return NotFound("cannot read tensor " + std::to_string(id.v) + ": no such tensor");
  const TensorRecord& t = tensors[id.v];
  const std::string name = (t.fqn.empty() ? t.key : t.fqn) + (t.state.empty() ? "" : " (" + t.state + ")");
  // The caller's mistakes (a box outside the shape, a buffer of another size) are
  // refused before any I/O and not logged; checkpoint failures are, like a file's.
  auto bad = [&](const std::string& why) { return Invalid("cannot read " + name + ": " + why); };
  auto fail = [&](Status st) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    LogError(name + ": " + st.message());
    return st;
  };
  if (!t.error.empty()) return fail(Invalid(t.error));
  if (t.encoding != Encoding::kTensor) return bad("a pickled object, not a tensor");
  if (out != t.dtype && !CanConvert(t.dtype, out)) {
    return bad("cannot render " + std::string(DTypeName(t.dtype)) + " as " + std::string(DTypeName(out)) +
               " (only identity, widening to float32 and float32 to bf16 / f16)");
  }
  uint64_t numel = t.Numel();
  if (box != nullptr) {
    if (box->offsets.size() != t.shape.size() || box->lengths.size() != t.shape.size()) {
      return bad("a box of rank " + std::to_string(box->offsets.size()) + " for shape " + ShapeStr(t.shape));
    }
    numel = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      const int64_t o = box->offsets[d], l = box->lengths[d];
      if (o < 0 || l < 0 || o > t.shape[d] || l > t.shape[d] - o) {
        return bad("box [" + std::to_string(o) + ", " + std::to_string(o + l) + ") of dim " + std::to_string(d) +
                   " is outside shape " + ShapeStr(t.shape));
      }
      numel *= static_cast<uint64_t>(l);
    }
  }
  if (len != numel * DTypeSize(out)) {
    return bad("a buffer of " + std::to_string(len) + " bytes for " + std::to_string(numel * DTypeSize(out)));
  }
  // Each call is an open and a read in one (there is no file handle to check
  // once): a stat per source file of this tensor, so a checkpoint rewritten
  // after indexing is refused, never served.
  if (Status st = reader_->CheckFresh(id); !st.ok()) return fail(st);
  const int64_t t0 = SteadyNs();
  Status st = device != nullptr ? reader_->ReadToDevice(id, out, box, *device, dst, len)
                                : reader_->ReadBox(id, out, box, 0, len, dst);
  if (!st.ok()) return fail(st);
  latency_.Record(static_cast<uint64_t>(SteadyNs() - t0));
  reads_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(len, std::memory_order_relaxed);
  return Status::Ok();
}

Result<std::vector<DirEntry>> Filesystem::ReadDir(uint64_t ino) const {
  const Node* n = view_->Get(ino);
  if (n == nullptr) return NotFound("no inode " + std::to_string(ino));
  if (!n->is_dir) return Status(Code::kInvalid, "not a directory");
  auto children = view_->List(ino);
  std::vector<DirEntry> out;
  out.reserve(children.size() + 2);
  out.push_back({".", n->ino, true});
  out.push_back({"..", n->parent, true});
  for (auto& [name, child, is_dir] : children) out.push_back({std::move(name), child, is_dir});
  return out;
}

Result<std::vector<DirEntry>> Filesystem::ReadDirPage(uint64_t ino, uint64_t offset, size_t max) const {
  listings_.fetch_add(1, std::memory_order_relaxed);
  const Node* n = view_->Get(ino);
  if (n == nullptr) return NotFound("no inode " + std::to_string(ino));
  if (!n->is_dir) return Status(Code::kInvalid, "not a directory");
  std::vector<DirEntry> out;
  if (offset == 0 && out.size() < max) out.push_back({".", n->ino, true, 1});
  if (offset <= 1 && out.size() < max) out.push_back({"..", n->parent, true, 2});
  if (out.size() == max) return out;
  const uint64_t from = offset < 2 ? 0 : offset - 2;
  for (View::Child& c : view_->ListFrom(ino, from, max - out.size())) {
    out.push_back({std::move(c.name), c.ino, c.is_dir, c.next + 2});
  }
  return out;
}

ReadAhead::Counts Filesystem::read_ahead_counts(bool drain) const {
  if (read_ahead_ == nullptr) return {};
  if (drain) read_ahead_->Drain();
  return read_ahead_->counts();
}

uint64_t Filesystem::AskAhead(uint64_t ino, uint64_t budget) {
  auto layout = view_->Layout(ino);
  if (!layout.ok()) return 0;  // the open that follows reports it
  std::vector<SourceSpan> all, spans;
  ConvertPlan convert;
  uint64_t left = budget;
  ForEachSegment(
      **layout, 0, (*layout)->size, expander_, nullptr, [&](const Segment& s, uint64_t in, uint64_t n, uint64_t) {
        if (s.kind != SegmentKind::kTensor || s.transposed || s.Affine()) return true;
        // The segment's first `left` bytes, or its first MiB when
        // those take too many spans (a merge of thin rows): the
        // kernel's read-around covers the rest once it is read.
        for (uint64_t take : {std::min(n, left), std::min<uint64_t>({n, left, 1 << 20})}) {
          spans.clear();
          bool planned = reader_->PlanCopy(s.tensor, s.out_dtype, s.box_or_null(), in, take, kMaxConvertSpans, &spans);
          if (!planned &&
              reader_->PlanConvert(s.tensor, s.out_dtype, s.box_or_null(), in, take, kMaxConvertSpans, &convert)) {
            spans.swap(convert.spans);
            planned = true;
          }
          if (!planned) continue;  // compressed, a mean of copies: the read itself fetches it
          all.insert(all.end(), spans.begin(), spans.end());
          left -= take;
          break;
        }
        return left > 0;
      });
  return reader_->AskAhead(all);
}

Status Filesystem::OpenFile(uint64_t ino, uint32_t pid) {
  opens_.fetch_add(1, std::memory_order_relaxed);
  const Node* node = view_->Get(ino);
  if (node != nullptr && node->report) {
    Status st = ReportBytes().status();
    if (!st.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
    return st;
  }
  if (node != nullptr && (node->topo_errors || node->stats)) return Status::Ok();
  auto layout = view_->Layout(ino);
  if (!layout.ok()) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    return layout.status();
  }
  std::vector<uint32_t> checked;  // an archive names its tensor in several segments
  for (const Segment& s : (*layout)->segments) {
    if (s.kind == SegmentKind::kLiteral || s.kind == SegmentKind::kSpooled ||
        std::find(checked.begin(), checked.end(), s.tensor.v) != checked.end()) {
      continue;
    }
    checked.push_back(s.tensor.v);
    Status st = reader_->CheckFresh(s.tensor);
    if (!st.ok()) {
      errors_.fetch_add(1, std::memory_order_relaxed);
      LogError(view_->PathOf(ino) + ": " + st.message());
      return st;
    }
  }
  if (read_ahead_ != nullptr) read_ahead_->Opened(ino, pid);
  return Status::Ok();
}

Result<size_t> Filesystem::Read(uint64_t ino, uint64_t offset, size_t size, char* buf) {
  const Node* node = view_->Get(ino);
  if (node != nullptr && node->stats) return ReadStats(offset, size, buf);
  const bool timed = node != nullptr && !node->report && !node->topo_errors;
  const int64_t t0 = timed ? SteadyNs() : 0;
  auto n = ReadData(ino, offset, size, buf);
  if (!n.ok()) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    return n;
  }
  if (timed) {
    latency_.Record(static_cast<uint64_t>(SteadyNs() - t0));
    reads_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(*n, std::memory_order_relaxed);
  }
  return n;
}

bool Filesystem::ReadMapped(uint64_t ino, uint64_t offset, size_t size, size_t max_pieces, MappedRead* r) {
  r->Clear();
  if (!mapped_reads_) return false;
  const Node* node = view_->Get(ino);
  if (node == nullptr || node->is_dir || node->stats || node->report || node->topo_errors) return false;
  const int64_t t0 = SteadyNs();
  auto layout_or = view_->Layout(ino);
  if (!layout_or.ok()) return false;
  const FileLayout& layout = **layout_or;
  if (offset >= layout.size) return false;
  size = static_cast<size_t>(std::min<uint64_t>(size, layout.size - offset));
  // The reply's own bytes go to `scratch`, which holds a whole request, so
  // it never reallocates under the pieces that point into it.
  if (r->scratch.size() < size) r->scratch.resize(size);
  auto take = [&](uint64_t n) -> char* {
    if (n > r->scratch.size() - r->used) return nullptr;
    char* at = r->scratch.data() + r->used;
    r->used += n;
    return at;
  };
  auto own = [&](const char* at, uint64_t n) {  // a piece of scratch, joined to the previous one if adjacent
    auto& pieces = r->bytes.pieces;
    if (!pieces.empty() && static_cast<char*>(pieces.back().iov_base) + pieces.back().iov_len == at) {
      pieces.back().iov_len += n;
    } else {
      pieces.push_back(iovec{const_cast<char*>(at), n});
    }
  };
  auto literal = [&](const char* p, uint64_t n) {
    char* at = take(n);
    if (at == nullptr) return false;
    std::memcpy(at, p, n);
    own(at, n);
    return true;
  };
  thread_local std::vector<SourceSpan> spans;
  thread_local ConvertPlan convert;
  bool converted = false;
  const bool all = ForEachSegment(
      layout, offset, size, expander_, nullptr, [&](const Segment& s, uint64_t in, uint64_t n, uint64_t) {
        const size_t room = max_pieces - std::min(max_pieces, r->bytes.pieces.size());
        switch (s.kind) {
          case SegmentKind::kLiteral:
            return room > 0 && literal(s.literal().data() + in, n);
          case SegmentKind::kTensor: {
            if (s.transposed || s.Affine()) return false;
            if (reader_->PlanCopy(s.tensor, s.out_dtype, s.box_or_null(), in, n, room, &spans)) {
              return reader_->MapSpans(spans, &r->bytes).ok();
            }
            // A conversion (not bounded by the reply's iovecs: it is converted
            // here). Any failure falls back to the engine, which reports it.
            if (!SigbusGuardInstalled() || room == 0 ||
                !reader_->PlanConvert(s.tensor, s.out_dtype, s.box_or_null(), in, n, kMaxConvertSpans, &convert)) {
              return false;
            }
            char* at = take(n);
            if (at == nullptr || !reader_->ConvertMapped(convert, at).ok()) return false;
            own(at, n);
            converted = true;
            return true;
          }
          case SegmentKind::kCrc32:
          case SegmentKind::kHash: {
            auto d = DigestBytes(s);
            return d.ok() && room > 0 && literal(d->data() + in, n);
          }
          case SegmentKind::kArchive:  // expanded by ForEachSegment
          case SegmentKind::kSpooled:  // a file of the daemon's, not the checkpoint's: read below
            return false;
        }
        return false;
      });
  if (!all) return false;
  if (r->bytes.pieces.size() > max_pieces) return false;
  // The latency of planning and mapping: the kernel's copy comes after.
  latency_.Record(static_cast<uint64_t>(SteadyNs() - t0));
  reads_.fetch_add(1, std::memory_order_relaxed);
  mapped_reads_count_.fetch_add(1, std::memory_order_relaxed);
  if (converted) mapped_conversions_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(size, std::memory_order_relaxed);
  return true;
}

void Filesystem::MappedReplyFailed(uint64_t ino, uint64_t offset, int err) {
  errors_.fetch_add(1, std::memory_order_relaxed);
  LogError(view_->PathOf(ino) + " @ " + std::to_string(offset) +
           ": the kernel could not copy the mapped source bytes (" + std::strerror(err) +
           "): a source file changed during the read; remount to rebuild the index");
}

Result<size_t> Filesystem::ReadStats(uint64_t offset, size_t size, char* buf) {
  std::shared_ptr<const std::string> doc;
  if (offset != 0) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    doc = stats_;
  }
  if (doc == nullptr) {
    doc = std::make_shared<const std::string>(StatsJson());
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = doc;
  }
  if (offset >= doc->size()) return size_t{0};
  const size_t k = static_cast<size_t>(std::min<uint64_t>(size, doc->size() - offset));
  std::memcpy(buf, doc->data() + offset, k);
  return k;
}

std::string Filesystem::StatsJson() const {
  auto u = [](uint64_t v) { return std::to_string(v); };
  char uptime[32];
  std::snprintf(uptime, sizeof(uptime), "%.3f", static_cast<double>(SteadyNs() - start_ns_) / 1e9);
  const TensorReader::TransformCounts tc = reader_->transform_counts();
  std::string j = "{\n";
  j += "  \"uptime_s\": " + std::string(uptime) + ",\n";
  j += "  \"reads\": " + u(reads_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"bytes\": " + u(bytes_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"mapped_reads\": " + u(mapped_reads_count_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"mapped_conversions\": " + u(mapped_conversions_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"errors\": " + u(errors_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"opens\": " + u(opens_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"lookups\": " + u(lookups_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"getattrs\": " + u(getattrs_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"listings\": " + u(listings_.load(std::memory_order_relaxed)) + ",\n";
  j += "  \"read_latency_us\": {\"count\": " + u(latency_.count()) +
       ", \"p50\": " + Micros(latency_.PercentileNs(0.50)) + ", \"p90\": " + Micros(latency_.PercentileNs(0.90)) +
       ", \"p99\": " + Micros(latency_.PercentileNs(0.99)) + ", \"max\": " + Micros(latency_.max_ns()) + "},\n";
  j += "  \"source_bytes_read\": " + u(reader_->source_bytes_read()) + ",\n";
  j += "  \"source_reads\": " + u(reader_->source_reads()) + ",\n";
  const ReadAhead::Counts ra = read_ahead_counts();
  j += "  \"read_ahead\": {\"on\": " + std::string(read_ahead_ != nullptr ? "true" : "false") +
       ", \"files\": " + u(ra.files) + ", \"bytes\": " + u(ra.bytes) + ", \"hits\": " + u(ra.hits) + "},\n";
  j += "  \"engine\": " + JsonEscape(engine_name()) + ",\n";
  j += "  \"transforms\": " + JsonEscape(transforms_name()) + ",\n";
  j += "  \"cpu_plans\": " + u(tc.cpu_plans) + ",\n";
  j += "  \"gpu_plans\": " + u(tc.gpu_plans) + ",\n";
  j += "  \"gpu_fallbacks\": " + u(tc.gpu_fallbacks) + ",\n";
  j += "  \"report_made\": " + std::string(report_size_.load(std::memory_order_acquire) > 0 ? "true" : "false") + "\n";
  j += "}\n";
  return j;
}

Result<size_t> Filesystem::ReadData(uint64_t ino, uint64_t offset, size_t size, char* buf) {
  if (const Node* n = view_->Get(ino); n != nullptr && (n->report || n->topo_errors)) {
    std::shared_ptr<const std::string> bytes;
    if (n->report) {
      ASSIGN_OR_RETURN(bytes, ReportBytes());
    } else {
      bytes = std::make_shared<const std::string>(view_->TopoErrors());
    }
    if (offset >= bytes->size()) return size_t{0};
    const size_t k = static_cast<size_t>(std::min<uint64_t>(size, bytes->size() - offset));
    std::memcpy(buf, bytes->data() + offset, k);
    return k;
  }
  auto layout_or = view_->Layout(ino);
  if (!layout_or.ok()) return layout_or.status();
  const FileLayout& layout = **layout_or;
  if (offset >= layout.size) return size_t{0};
  size = static_cast<size_t>(std::min<uint64_t>(size, layout.size - offset));
  Status st;
  ForEachSegment(layout, offset, size, expander_, &st, [&](const Segment& s, uint64_t in, uint64_t n, uint64_t at) {
    char* dst = buf + at;
    switch (s.kind) {
      case SegmentKind::kLiteral:
        std::memcpy(dst, s.literal().data() + in, n);
        break;
      case SegmentKind::kSpooled:
        st = s.spooled()->Read(in, n, dst);
        break;
      case SegmentKind::kTensor:
        st = s.Affine()     ? ReadScaled(*reader_, s, in, n, dst)
             : s.transposed ? reader_->ReadTransposedRows(s.tensor, s.out_dtype, s.boxes, s.how(), in, n, dst)
                            : reader_->ReadBox(s.tensor, s.out_dtype, s.box_or_null(), in, n, dst);
        break;
      case SegmentKind::kCrc32:
      case SegmentKind::kHash: {
        auto d = DigestBytes(s);
        if (d.ok()) std::memcpy(dst, d->data() + in, n);
        st = d.status();
        break;
      }
      case SegmentKind::kArchive:  // expanded by ForEachSegment
        st = Internal("an archive segment was not expanded");
        break;
    }
    return st.ok();
  });
  if (!st.ok()) {
    LogError(view_->PathOf(ino) + " @ " + std::to_string(offset) + ": " + st.message());
    return st;
  }
  return size;
}

}  // namespace ckptfs
