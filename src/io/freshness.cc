// Freshness and integrity of the source files behind a read: CheckFd (the fd
// still names the indexed inode, fingerprint unchanged, the path re-checked at
// most once a second per file), CheckFresh on open, and the ZIP CRC-32 ranges
// (CheckChecksum, CheckRanges). Stale sources are kStale, failed ranges
// kInvalid. Locking: range_mu_ (a leaf) guards the range verdicts, never held
// while reading; path_checked_ns_ is per-file atomics.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <set>

#include "ckptfs/io.h"
#include "common/crc32.h"

namespace ckptfs {

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
  uint32_t crc = 0;
  for (uint64_t off = 0; off < c.length; off += kPiece) {
    const uint64_t n = std::min(kPiece, c.length - off);
    IoRequest req{fds_[c.file.v], c.offset + off, n, buf.data()};
    RETURN_IF_ERROR(ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel));
    crc = Crc32Update(crc, buf.data(), n);
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

}  // namespace ckptfs
