// The FUSE-free filesystem core: everything a mount does, callable directly.
//
// Design note. The FUSE adapter (src/fuse/fuse_adapter.cc) only translates
// requests into calls here and replies; the CLI's `cat` and `ls` use the same
// calls without FUSE, and unit tests drive it in-process. Errors come back as
// Status; ToErrno() is the one place they become errno values. Every failed
// read is logged with the virtual path and the reason, so an EIO in a user's
// tool can be traced to a file and offset in the checkpoint.
#ifndef CKPTFS_FS_H_
#define CKPTFS_FS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"
#include "ckptfs/read_ahead.h"
#include "ckptfs/verify.h"
#include "ckptfs/views.h"

namespace ckptfs {

struct Attr {
  uint64_t ino = 0;
  bool is_dir = false;
  uint64_t size = 0;
  uint32_t nlink = 1;
  int64_t mtime_ns = 0;
  // Content that changes while mounted (topo/ gains views, topo/ERRORS grows):
  // the kernel must not cache its attributes, listing or pages.
  bool dynamic = false;
};

// A read answered as pieces for one writev (Filesystem::ReadMapped): mapped
// source bytes, and the reply's own bytes (headers, CRCs, elements converted
// from mappings) written into `scratch`, whose first `used` bytes are taken.
// It never reallocates during a read (pieces point into it) and keeps its
// size between reads (a FUSE worker's, like its reply buffer).
struct MappedRead {
  MappedBytes bytes;
  std::vector<char> scratch;
  size_t used = 0;
  void Clear() {
    bytes.Clear();
    used = 0;
  }
};

struct DirEntry {
  std::string name;
  uint64_t ino = 0;
  bool is_dir = false;
  uint64_t next = 0;  // ReadDirPage: the offset that resumes after this entry
};

// Read latencies in log2 buckets of nanoseconds: bucket i holds [2^i, 2^(i+1))
// ns (bucket 0 also 0 ns). Record() is three relaxed atomic operations and
// no lock, so every read path thread may call it; percentiles are the upper
// edge of the bucket that holds them (at most 2x off), capped at the maximum.
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 64;
  void Record(uint64_t ns);
  uint64_t count() const;
  uint64_t max_ns() const { return max_ns_.load(std::memory_order_relaxed); }
  // q in (0, 1]: the latency at or below which a fraction q of the reads
  // finished; 0 when nothing was recorded.
  uint64_t PercentileNs(double q) const;

 private:
  std::atomic<uint64_t> buckets_[kBuckets] = {};
  std::atomic<uint64_t> max_ns_{0};
};

struct FsOptions {
  std::string src;
  std::string index_dir;  // empty: DefaultIndexDir(src)
  EngineKind engine = EngineKind::kAuto;
  // Transforms backend: auto uses a GPU where a calibration (cached in
  // UserCacheDir()/gpu-calibration.json) measured it faster (auto).
  GpuMode gpu = GpuMode::kAuto;
  bool force_rebuild = false;
  // --family: read src as this family (formats.h ReadCheckpoint; kUnknown: detect).
  Family family = Family::kUnknown;
  // Check the CRC-32 of every source range (ZIP entry) before serving the
  // first byte over it; a failed range is EIO for the tensors over it (false).
  bool verify_on_read = false;
  // Reads that are plain copies of source bytes are answered from read-only
  // mappings of the sources (ReadMapped; --mapped-reads=off: always copied).
  bool mapped_reads = true;
  // Cross-file read-ahead for readers that walk the tree (read_ahead.h;
  // --read-ahead=on). Off by default: on local storage it measured slower
  // (docs/performance.md, "Cross-file read-ahead").
  bool read_ahead = false;
  TopoOptions topo;  // --rules, --pp-layers, --hf-shard-size
  // The GPU backend's settings (device, idle release; the Python package
  // keeps the context it shares with torch: reset_when_idle = false).
  CudaOptions cuda;
};

class Filesystem {
 public:
  static Result<std::unique_ptr<Filesystem>> Open(const FsOptions& opts);

  Result<Attr> Lookup(uint64_t parent, std::string_view name) const;
  Result<Attr> GetAttr(uint64_t ino) const;
  Result<std::vector<DirEntry>> ReadDir(uint64_t ino) const;
  // At most `max` entries of a directory from `offset` on (0: the start, then
  // an entry's `next`), "." and ".." first: a FUSE listing, which resumes at
  // an offset and holds no open handle. Counted as `listings` in the stats.
  Result<std::vector<DirEntry>> ReadDirPage(uint64_t ino, uint64_t offset, size_t max) const;
  // topo/ and topo/ERRORS change while mounted: the adapter gives them no
  // attribute timeout (and topo/ERRORS no page cache).
  bool Dynamic(uint64_t ino) const { return view_->Dynamic(ino); }
  // Called on open(2): refuses files whose sources changed since indexing.
  // `pid`: the opening process, whose walk of the tree read-ahead follows.
  Status OpenFile(uint64_t ino, uint32_t pid = 0);
  // Reads up to `size` bytes at `offset`; short only at end of file.
  Result<size_t> Read(uint64_t ino, uint64_t offset, size_t size, char* buf);
  // The same bytes as Read, as at most `max_pieces` pieces of mapped source
  // bytes and literals (see io.h, "Mapped replies") when every tensor byte in
  // the range is a plain copy of source bytes and the sources check fresh.
  // false: not so, or anything failed; Read then serves (and reports) it.
  bool ReadMapped(uint64_t ino, uint64_t offset, size_t size, size_t max_pieces, MappedRead* r);
  // The kernel could not copy a mapped reply (errno `err`; the request got
  // EIO): a source file shrank after its check. Logged and counted.
  void MappedReplyFailed(uint64_t ino, uint64_t offset, int err);
  // The sub-box `box` (null: the whole tensor) of tensor `id` rendered as
  // `out` in C order of the box's shape, `len` bytes exactly: the bytes its
  // params/ file serves, without a path (the Python package's read). Checks
  // the box against the shape and the sources' freshness first; a failure is
  // logged like a failed read of the file.
  // With `device`, `dst` is device memory of device->backend and the bytes
  // are rendered there (TensorReader::ReadToDevice): the Python package's
  // device= reads.
  Status ReadTensor(TensorId id, DType out, const Box* box, char* dst, uint64_t len,
                    const DeviceTarget* device = nullptr);
  // .ckptfs/stats: the counters below as one JSON object (no checkpoint I/O,
  // never a verify). A read at offset 0 takes a fresh snapshot; reads past 0
  // continue the latest one (the adapter passes no file handle), so a reader
  // that takes the document in pieces while another starts over may see two
  // snapshots: read it whole (any buffer of 4 KiB or more does).
  std::string StatsJson() const;

  // `ckptfs verify` over this filesystem's index and read engine.
  Result<Report> Verify(const VerifyOptions& opts) const;

  const Index& index() const { return *index_; }
  bool mapped_reads() const { return mapped_reads_; }
  const View& view() const { return *view_; }
  const OpenResult& open_result() const { return opened_; }
  const char* engine_name() const { return reader_->engine_name(); }
  // "cpu", "gpu (<device>)" or "auto (<device> where calibrated faster)".
  std::string transforms_name() const { return reader_->policy() ? reader_->policy()->Describe() : "cpu"; }
  const TensorReader& reader() const { return *reader_; }
  // Reads served of the tree's files (not .ckptfs/ or topo/ERRORS) and their bytes.
  uint64_t reads() const { return reads_.load(); }
  uint64_t bytes_read() const { return bytes_.load(); }
  // Opens and reads that failed (EIO, ESTALE, ...), of any file.
  uint64_t errors() const { return errors_.load(); }
  const LatencyHistogram& read_latency() const { return latency_; }
  // Cross-file read-ahead's counts so far (zero when it is off), after the
  // read-ahead already decided is done (Drain: tests).
  ReadAhead::Counts read_ahead_counts(bool drain = false) const;

 private:
  Filesystem() = default;
  Attr AttrOf(const Node& n, uint64_t size) const;
  Result<Attr> AttrOfIno(uint64_t ino) const;  // GetAttr, uncounted
  Result<size_t> ReadData(uint64_t ino, uint64_t offset, size_t size, char* buf);
  Result<size_t> ReadStats(uint64_t offset, size_t size, char* buf);
  // Read-ahead's fetch: asks the kernel for the sources of file `ino`'s
  // plain-copy and conversion segments, at most `budget` bytes of its output.
  uint64_t AskAhead(uint64_t ino, uint64_t budget);
  // A kCrc32 segment's 4 little-endian bytes, a kHash segment's 16 hex digits.
  Result<std::string> DigestBytes(const Segment& s);
  // .ckptfs/report.json, made by the first caller; later callers wait for it.
  Result<std::shared_ptr<const std::string>> ReportBytes() const;

  OpenResult opened_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<View> view_;
  // Lays out a kArchive segment (View::ArchiveLayout), cached per thread.
  std::function<Result<std::shared_ptr<const FileLayout>>(const Segment&)> expander_;
  std::unique_ptr<TensorReader> reader_;
  // After reader_: its worker stops before the reader goes.
  std::unique_ptr<ReadAhead> read_ahead_;
  int64_t mtime_ns_ = 0;
  // Copies of source bytes are replied from the sources' mappings; so are
  // conversions (bf16 -> f32 and the like) once the process's SIGBUS guard
  // is installed (InstallSigbusGuard; the mount does it).
  bool mapped_reads_ = true;
  // Counters for .ckptfs/stats: relaxed atomics, no lock on any FUSE path.
  std::atomic<uint64_t> reads_{0}, bytes_{0}, errors_{0}, opens_{0}, mapped_reads_count_{0}, mapped_conversions_{0};
  mutable std::atomic<uint64_t> lookups_{0}, getattrs_{0}, listings_{0};
  LatencyHistogram latency_;
  int64_t start_ns_ = 0;  // steady clock at Open, for uptime_s
  // Leaf lock: guards stats_, the latest .ckptfs/stats snapshot.
  std::mutex stats_mu_;
  std::shared_ptr<const std::string> stats_;
  // Leaf lock: guards report_; held while the report is made (a second
  // reader of report.json waits rather than verifying twice).
  mutable std::mutex report_mu_;
  mutable std::shared_ptr<const std::string> report_;
  // report_'s size once made (0 before): what a stat shows, without the lock.
  mutable std::atomic<uint64_t> report_size_{0};
};

// The one errno map (ENOENT, EIO, ESTALE, EROFS, ...).
int ToErrno(const Status& s);

}  // namespace ckptfs

#endif  // CKPTFS_FS_H_
