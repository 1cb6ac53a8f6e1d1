// Mapped reads: MapSpans serves planned spans (PlanCopy / PlanConvert) as
// pieces of read-only mappings of the sources, after CheckFd; ConvertMapped
// converts straight from them under RunGuarded (a source cut short is kStale).
// Windows of kMapWindow bytes every kMapStep are kept, most recent last.
// AskAhead starts the kernel's reads of spans for cross-file read-ahead.
// Locking: map_mu_ (a leaf) guards windows_; mmap runs outside it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "ckptfs/io.h"
#include "common/crc32.h"

namespace ckptfs {

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

// CrcMapped's work, run under RunGuarded (nothing here locks or allocates).
struct MappedCrc {
  const std::vector<iovec>* pieces;
  uint32_t crc;

  static void Run(void* self) {
    auto* c = static_cast<MappedCrc*>(self);
    for (const iovec& p : *c->pieces) c->crc = Crc32Update(c->crc, static_cast<const char*>(p.iov_base), p.iov_len);
  }
};

// Maps `spans` through `reader` (MapSpans' checks first) and runs `work`
// (a MappedConversion or MappedCrc, its `pieces` set to the mapping) under
// RunGuarded; the windows are unpinned after. A source cut short meanwhile is
// kStale.
template <typename Work>
Status RunOnMapping(TensorReader& reader, std::span<const SourceSpan> spans, Work& work, const std::string& src_dir) {
  if (!SigbusGuardInstalled()) return Internal("mapped reads need InstallSigbusGuard()");
  thread_local MappedBytes mapped;
  mapped.Clear();
  Status s = reader.MapSpans(spans, &mapped);
  if (!s.ok()) {
    mapped.Clear();
    return s;
  }
  work.pieces = &mapped.pieces;
  const bool done = RunGuarded(&Work::Run, &work);
  mapped.Clear();
  if (!done) {
    return Stale(src_dir +
                 ": a source file was cut short while its bytes were read from a mapping; remount to "
                 "rebuild the index");
  }
  return Status::Ok();
}

}  // namespace

Status TensorReader::CrcMapped(std::span<const SourceSpan> spans, uint32_t* crc) {
  MappedCrc c{nullptr, *crc};
  RETURN_IF_ERROR(RunOnMapping(*this, spans, c, index_.src_dir()));
  *crc = c.crc;
  return Status::Ok();
}

Status TensorReader::ConvertMapped(const ConvertPlan& plan, char* dst) {
  MappedConversion c{nullptr, plan.src, plan.out, plan.skip, plan.len, dst};
  return RunOnMapping(*this, plan.spans, c, index_.src_dir());
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

uint64_t TensorReader::AskAhead(std::span<const SourceSpan> spans) {
  uint64_t asked = 0;
  for (size_t i = 0; i < spans.size();) {
    const SourceSpan& a = spans[i];
    uint64_t end = a.offset + a.length;
    size_t j = i + 1;
    for (; j < spans.size() && spans[j].file == a.file && spans[j].offset == end; ++j) end += spans[j].length;
    if (a.file < fds_.size() && fds_[a.file] >= 0 && end > a.offset &&
        ::posix_fadvise(fds_[a.file], static_cast<off_t>(a.offset), static_cast<off_t>(end - a.offset),
                        POSIX_FADV_WILLNEED) == 0) {
      asked += end - a.offset;
    }
    i = j;
  }
  return asked;
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

}  // namespace ckptfs
